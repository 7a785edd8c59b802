"""The system tier of tests/unit/test_k8s.py, whose docstring says what both halves test: two pods of a
TrainJob as two launchers on this machine, each with the variables Kubeflow Trainer's torch runtime sets
on its pod (the first pod's address is 127.0.0.1 here, its headless service name on a cluster), their run
dir a folder (the ReadWriteMany claim's). tests/system/test_k8s_containers.py runs the same two pods, the
same stop and resume, as two containers of the image with their run dir in a bucket."""

from __future__ import annotations

import signal
import subprocess

import pytest
import yaml

from tests.helpers.outputs import rows
from tests.helpers.pages import block
from tests.helpers.run import PYTHON, ROOT, TINY, env, wait_for
from tests.unit.test_k8s import _kubectl, problems
from trainer.dist import free_port
from trainer.resilience import outcomes
from trainer.rundir import layout


def _pods(run_dir, steps: int) -> list[subprocess.Popen]:
    """The two pods' launchers, as the TrainJob's pods run them (`python3 -m trainer.launch --config ...
    run_dir=...`, nothing of the rendezvous on the command line), one rank each (PET_NPROC_PER_NODE)."""
    port = str(free_port("127.0.0.1"))
    pods = []
    for rank in range(2):
        pet = {
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": port,
            "SLURMD_NODENAME": f"pod-{rank}",  # the node's name (trainer.dist.node_name): two pods, one host here
        }
        command = [PYTHON, "-m", "trainer.launch", "--config", "configs/default.yaml", f"run_dir={run_dir}", *TINY]
        pods.append(
            subprocess.Popen(
                [*command, f"train.steps={steps}", "log.interval=1"],
                cwd=ROOT,
                env={**env(), **pet},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return pods


@pytest.mark.slow  # two launchers with a rank each, twice (30 to 44 s on 2 cores, 2026-11-29)
def test_two_pods_rendezvous_a_sigterm_to_one_saves_exits_143_and_the_set_started_again_resumes(tmp_path):
    run_dir = tmp_path / "run"
    pods = _pods(run_dir, 100000)
    try:
        wait_for(lambda: len(rows(run_dir)) >= 3, 150, "the two pods to train")
        pods[1].send_signal(signal.SIGTERM)  # a drained node: the kubelet signals its pod's PID 1, then the launcher
        ended = [None, pods[1].communicate(timeout=120)]
        # Its pod failed (143): the JobSet deletes the other pods to start the set again, and their kubelets
        # send SIGTERM. Until then the first pod's launcher waits at torchrun's exit barrier for the other.
        pods[0].send_signal(signal.SIGTERM)
        ended[0] = pods[0].communicate(timeout=120)
    finally:
        for pod in pods:
            pod.kill()
    status = layout.read_status(run_dir)
    stopped = status["step"]
    assert status["state"] == "stopped" and layout.latest_committed_step(run_dir) == stopped
    sigterm = outcomes.signal_code(signal.SIGTERM)
    assert [pod.returncode for pod in pods] == [sigterm, sigterm], [err[-2000:] for _, err in ended]
    for _, err in ended:  # the JobSet's failure policy restarts the set: the checkpoint is saved
        assert (
            f"launch: stopped before the end of training under Kubeflow Trainer (PET_*): exit code {sigterm}, so that "
            f"the whole set is restarted (the JobSet's failurePolicy) and resumes from step {stopped}, the newest "
            f"checkpoint\n"
        ) in err
    # The set started again: the same variables, a new rendezvous; it resumes there and finishes: exit 0.
    pods = _pods(run_dir, stopped + 3)
    ended = [pod.communicate(timeout=150) for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], [err[-2000:] for _, err in ended]
    assert [r["step"] for r in rows(run_dir) if "loss" in r] == list(range(1, stopped + 4))
    assert layout.read_status(run_dir)["state"] == "finished"


@pytest.mark.slow  # make submit-k8s four times, three a preflight of the default config (15 to 36 s)
def test_the_pages_commands_render_and_apply_as_written(tmp_path):
    """docs/kubernetes.md's commands, the README's among them, run as written: the first prints a
    TrainJob, the second hands a JobSet to kubectl (here one that records what it gets); then the
    runtime for TrainJobs is applied and a TrainJob names it."""
    lines = block("docs/kubernetes.md", "Submitting").splitlines()
    assert block("README.md", "Installing", index=3).splitlines() == lines[:1]
    path = _kubectl(tmp_path / "bin")
    done = [
        subprocess.run(["bash", "-c", line], cwd=ROOT, env={**env(), "PATH": path}, capture_output=True, text=True)
        for line in lines
    ]
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    (trainjob,) = yaml.safe_load_all(done[0].stdout)
    (jobset,) = yaml.safe_load_all((tmp_path / "bin" / "stdin").read_text())
    assert (tmp_path / "bin" / "args").read_text() == "apply -f -\n"
    assert problems(trainjob) == [] and problems(jobset) == []
    assert (trainjob["kind"], trainjob["spec"]["trainer"]["numNodes"]) == ("TrainJob", 4)
    assert trainjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (jobset["kind"], pod["completions"]) == ("JobSet", 4)
    assert pod["template"]["spec"]["containers"][0]["image"] == "registry.example.com/ml/fsdp-trainer:1.4.0"
    # The runtime for TrainJobs, applied once, and a TrainJob that names it.
    lines = block("docs/kubernetes.md", "Stops, preemption and restarts").splitlines()
    done = [
        subprocess.run(["bash", "-c", line], cwd=ROOT, env={**env(), "PATH": path}, capture_output=True, text=True)
        for line in lines
    ]
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    (runtime,) = yaml.safe_load_all((tmp_path / "bin" / "stdin").read_text())
    (trainjob,) = yaml.safe_load_all(done[1].stdout)
    assert problems(runtime) == [] and problems(trainjob) == []
    assert runtime["metadata"]["name"] == trainjob["spec"]["runtimeRef"]["name"] == "fsdp-trainer"
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == jobset["spec"]["failurePolicy"]
