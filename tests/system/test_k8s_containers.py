"""A TrainJob's two pods as two containers of the real image on this machine's Docker engine.

`make submit-k8s KIND=trainjob NODES=2 GPUS_PER_NODE=0 CONFIG=<a config of the user's own>` renders the
TrainJob and its ConfigMap; each container is one of its pods as the kubelet would run it: the TrainJob's
command (the image's tini) and args, the variables Kubeflow Trainer's torch runtime sets on the pod
(PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT: tests/unit/test_k8s.py
_pod_env), the host name the JobSet gives it and the first pod's DNS name
(JOB-node-0-0.JOB, here a network alias on one Docker network), the ConfigMap's file laid out as the
kubelet mounts one (links to a timestamped folder), read-only, and one host folder as the run dirs' volume
(the ReadWriteMany PersistentVolumeClaim's stand-in). The root filesystem is read-only with a fresh /tmp
at every start, so the second start of a container begins from the image as a new pod would.

The pods rendezvous and train on the CPU (gloo: the image falls back where there is no GPU); `docker stop`
gives each SIGTERM and SIGKILL after the TrainJob's terminationGracePeriodSeconds, as the kubelet does;
they save and exit 143 (the JobSet restarts the set on it); started again they resume from that checkpoint
and run to the end, exit 0. Under vfs each container is a full copy of the image (minutes on 2 cores):
the two are made once, in parallel, and started twice.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from tests.helpers.docker import engine, sh
from tests.helpers.outputs import rows
from tests.helpers.run import wait_for
from tests.unit.test_k8s import _pod_env, problems
from trainer.launchers import k8s
from trainer.resilience import outcomes
from trainer.rundir import layout

NAME = f"k8spods{os.getpid()}"  # the TrainJob's, the Docker network's and (with -0/-1) the containers'
STEPS = 30
# A config of the user's own: the tiny model (tests.helpers.run.TINY), saved every 5 steps.
MY_CONFIG = f"""# my config: the tiny transformer on generated data
model:
  seq_len: 32
train:
  global_batch_size: 12
  steps: {STEPS}
optim:
  warmup_steps: 2
checkpoint:
  interval: 5
log:
  interval: 1
  progress: false
"""


def _configmap_volume(folder, data: dict) -> None:
    """`data` as the kubelet lays out a ConfigMap volume: each key a link to ..data/KEY, ..data a link to a
    timestamped folder holding the files (what the trainer opens is a link it did not make)."""
    stamp = folder / "..2026_11_29_08_00_00.000000001"
    stamp.mkdir(parents=True)
    for key, text in data.items():
        (stamp / key).write_text(text)
        (stamp / key).chmod(0o644)
        (folder / key).symlink_to(f"..data/{key}")
    (folder / "..data").symlink_to(stamp.name)
    for path in (folder, stamp):
        path.chmod(0o755)


def _logs(container: str) -> str:
    out = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    return out.stdout + out.stderr


def _exit_code(container: str) -> int:
    return int(sh("docker", "inspect", "-f", "{{.State.ExitCode}}", container).stdout)


@pytest.fixture
def cluster(tmp_path):
    """(the Docker network, the run dirs' folder, the ConfigMap's folder); removed with every container
    named NAME-* at the end."""
    volume, configmap = tmp_path / "runs", tmp_path / "configmap"
    volume.mkdir()
    if os.getuid() == 0:  # the image's user (1000) writes the run dir, as on a PVC made for it
        os.chown(volume, 1000, 1000)
    tmp_path.chmod(0o755)
    sh("docker", "network", "create", NAME)
    yield NAME, volume, configmap
    shutil.rmtree(volume, ignore_errors=True)
    # Deleting two 6 GB copies under vfs took 49 to 83 s: the engine does it while the next tests run.
    subprocess.Popen(
        ["sh", "-c", f"docker rm -f {NAME}-0 {NAME}-1; docker network rm {NAME}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@engine
def test_two_pods_of_the_image_rendezvous_a_stop_saves_exits_143_and_the_set_started_again_resumes(
    trainer_image, cluster, tmp_path, capsys
):
    network, volume, configmap = cluster
    mine = tmp_path / "my.yaml"
    mine.write_text(MY_CONFIG)
    job_file = tmp_path / "job.yaml"
    argv = ["--nodes", "2", "--gpus-per-node", "0", "--image", trainer_image, "--pvc", "runs", "--name", NAME]
    assert k8s.main([*argv, "--config", str(mine), "--out", str(job_file)]) == 0, capsys.readouterr().err
    config_map, trainjob = yaml.safe_load_all(job_file.read_text())
    assert problems(config_map) == [] and problems(trainjob) == []
    assert config_map["data"] == {k8s.CONFIG_KEY: MY_CONFIG}
    (patch,) = trainjob["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    grace = rjob["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    _configmap_volume(configmap, config_map["data"])
    run_dir = volume / NAME  # the pods' /runs/NAME
    user = f"{os.getuid() or 1000}:{os.getgid() or 1000}"

    # The two pods, made once (each a copy of the image), in parallel.
    containers = []
    for index in range(2):
        pet, args = _pod_env(trainjob, index)
        (entrypoint, *before_args) = trainjob["spec"]["trainer"]["command"]  # the image's tini, "--"
        pod = f"{NAME}-node-0-{index}"
        containers.append(
            [
                "docker",
                "create",
                "--name",
                f"{NAME}-{index}",
                "--hostname",
                pod,
                "--network",
                network,
                "--network-alias",
                f"{pod}.{NAME}",
                "--user",
                user,
                "--read-only",
                "--tmpfs",
                "/tmp",
                "--shm-size",
                "256m",
                "-v",
                f"{volume}:{k8s.MOUNT}",
                "-v",
                f"{configmap}:{k8s.CONFIG_MOUNT}:ro",
                *(w for key, value in pet.items() for w in ("-e", f"{key}={value}")),
                # One thread per rank, as every test's trainer (helpers.run.env): two ranks of two threads
                # on a 2-core machine wait for each other.
                "-e",
                "OMP_NUM_THREADS=1",
                "--entrypoint",
                entrypoint,
                trainer_image,
                *before_args,
                *args,
            ]  # fmt: skip
        )
    moments = {"rendered": time.monotonic()}
    made = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in containers]
    for proc in made:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err
    names = [f"{NAME}-{index}" for index in range(2)]
    moments["made"] = time.monotonic()

    # 1. The set starts: both pods rendezvous and train. After a checkpoint the second pod's node is drained:
    # its kubelet stops it with the TrainJob's grace period; both ranks save, and it exits 143. Its Job fails,
    # and the JobSet deletes the first pod (waiting at torchrun's exit barrier) to start the set again.
    sh("docker", "start", *names)
    wait_for(
        lambda: len(rows(run_dir)) >= 7 or any(_state(n) != "running" for n in names),
        300,
        "the two pods to train past their first checkpoint",
        interval=0.5,
    )
    assert all(_state(n) == "running" for n in names), [_logs(n)[-3000:] for n in names]
    moments["trained"] = time.monotonic()
    assert rows(run_dir)[-1]["step"] < STEPS, "training ended before it could be stopped; raise STEPS"
    for name in reversed(names):
        sh("docker", "stop", "-t", str(grace), name, timeout=grace + 120)
        moments[f"{name} stopped"] = time.monotonic()
    logs = [_logs(n) for n in names]
    sigterm = outcomes.signal_code(signal.SIGTERM)
    assert [_exit_code(n) for n in names] == [sigterm, sigterm], [log[-3000:] for log in logs]
    stopped = re.search(r"resumes from step (\d+), the newest checkpoint", logs[0])
    assert stopped, logs[0][-3000:]
    saved = int(stopped.group(1))
    for log in logs:
        assert (
            f"launch: stopped before the end of training under Kubeflow Trainer (PET_*): exit code {sigterm}, so that "
            f"the whole set is restarted (the JobSet's failurePolicy) and resumes from step {saved}, the newest "
            f"checkpoint\n"
        ) in log
    assert [r["step"] for r in rows(run_dir)] == list(range(1, saved + 1))
    assert rows(run_dir)[-1]["world_size"] == 2
    status = layout.read_status(run_dir)
    assert (status["state"], status["step"], layout.latest_committed_step(run_dir)) == ("stopped", saved, saved)

    # 2. The set started again (the JobSet's failurePolicy): the same pods, a new rendezvous; they resume
    # from the saved step and run to the end, each step logged once, and exit 0.
    sh("docker", "start", *names)
    done = [sh("docker", "wait", n, timeout=600).stdout.strip() for n in names]
    logs = [_logs(n) for n in names]
    assert done == ["0", "0"], [log[-3000:] for log in logs]
    assert f" at step {saved} (saved by 2 processes" in logs[0], logs[0][-3000:]
    assert [r["step"] for r in rows(run_dir)] == list(range(1, STEPS + 1))
    assert layout.read_status(run_dir)["state"] == "finished"
    moments["resumed to the end"] = time.monotonic()
    times = list(moments.values())
    print(
        "pods:",
        ", ".join(f"{what} +{now - then:.0f} s" for (what, now), then in zip(moments.items(), [times[0], *times])),
    )


def _state(container: str) -> str:
    return sh("docker", "inspect", "-f", "{{.State.Status}}", container).stdout.strip()
