"""A TrainJob's two pods as two containers of the real image on this machine's Docker engine, their run
dir in a bucket (moto's S3 server, tests/helpers/s3.py, on the Docker network's gateway address).

`make submit-k8s KIND=trainjob NODES=2 GPUS_PER_NODE=0 CONFIG=<a config of the user's own>
RUN_DIR=s3://BUCKET/PREFIX S3_SECRET=... AWS_ENDPOINT_URL=...` renders the TrainJob and its ConfigMap; each
container is one of its pods as the kubelet would run it: the TrainJob's command (the image's tini) and
args, its variables (TRAINER_S3_STAGING, AWS_ENDPOINT_URL) and the Secret's keys it names, the variables
Kubeflow Trainer's torch runtime sets on the pod (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR, PET_MASTER_PORT: tests/unit/test_k8s.py _pod_env), the host name the JobSet gives it and
the first pod's DNS name (JOB-node-0-0.JOB, here a network alias on one Docker network; not the host's
network, where both pods had one host name and, by chance, one launcher pid: torchrun's rendezvous took
them for one node), the ConfigMap's file laid out as the kubelet mounts one (links to a timestamped folder),
read-only, and the staging emptyDir as a host folder. No run volume: the bucket is the run dir. The root
filesystem is read-only with a fresh /tmp and staging folder at every start, so the second start of a
container begins from the image and the bucket as a new pod would. (A run dir on the claim, a folder,
is the same launcher's: tests/system/test_k8s_pods.py runs those pods as two launchers.)

The pods rendezvous and train on the CPU (gloo: the image falls back where there is no GPU); `docker stop`
gives each SIGTERM and SIGKILL after the TrainJob's terminationGracePeriodSeconds, as the kubelet does;
they save to the bucket and exit 143 (the JobSet restarts the set on it); started again they resume from
that checkpoint in the bucket and run to the end, exit 0. Under vfs each container is a full copy of the
image (minutes on 2 cores): the two are made once, in parallel, and started twice.
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
from tests.helpers.s3 import Server, download, keys, missing
from tests.unit.test_k8s import _pod_env, _pod_parts, problems
from trainer.launchers import k8s
from trainer.resilience import outcomes
from trainer.rundir import layout

NAME = f"k8spods{os.getpid()}"  # the TrainJob's, the Docker network's and (with -0/-1) the containers'
SECRET = "s3-credentials"  # the Secret S3_SECRET names: its keys as the kubelet would read them (s3 fixture's)
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


def _secret_env(doc: dict, secret: dict) -> dict:
    """The variables the kubelet sets from the Secret (`secret`: its keys) where the job names them; an
    optional key the Secret lacks is left unset, a required one fails the test, as the pod would not start."""
    env, _, _ = _pod_parts(doc)
    found = {}
    for name, var in env.items():
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            continue
        assert ref["name"] == SECRET
        if ref["key"] in secret:
            found[name] = secret[ref["key"]]
        else:
            assert ref.get("optional"), f"the Secret has no {ref['key']}: the pod would not start"
    return found


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """(the Docker network, the ConfigMap's folder, an S3 server on the network's gateway address with this
    process's AWS variables pointing at it); removed with every container named NAME-* at the end."""
    configmap = tmp_path / "configmap"
    tmp_path.chmod(0o755)
    why = missing()
    if why:
        pytest.skip(why)
    sh("docker", "network", "create", NAME)
    gateway = sh("docker", "network", "inspect", "-f", "{{(index .IPAM.Config 0).Gateway}}", NAME).stdout.strip()
    server = Server(host=gateway)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield NAME, configmap, server
    server.stop()
    # Deleting two 6 GB copies under vfs took 49 to 83 s: the engine does it while the next tests run.
    subprocess.Popen(
        ["sh", "-c", f"docker rm -f {NAME}-0 {NAME}-1; docker network rm {NAME}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@engine
def test_two_pods_of_the_image_in_a_bucket_rendezvous_a_stop_saves_exits_143_and_the_set_started_again_resumes(
    trainer_image, cluster, tmp_path, capsys
):
    network, configmap, server = cluster
    bucket = server.bucket()
    prefix = f"runs/{NAME}"
    url = f"s3://{bucket}/{prefix}"
    mine = tmp_path / "my.yaml"
    mine.write_text(MY_CONFIG)
    job_file = tmp_path / "job.yaml"
    argv = ["--nodes", "2", "--gpus-per-node", "0", "--image", trainer_image, "--name", NAME, "--run-dir", url]
    argv += ["--s3-secret", SECRET, "--s3-endpoint", server.url]
    assert k8s.main([*argv, "--config", str(mine), "--out", str(job_file)]) == 0, capsys.readouterr().err
    config_map, trainjob = yaml.safe_load_all(job_file.read_text())
    assert problems(config_map) == [] and problems(trainjob) == []
    assert config_map["data"] == {k8s.CONFIG_KEY: MY_CONFIG}
    (patch,) = trainjob["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod_spec = rjob["template"]["spec"]["template"]["spec"]
    grace = pod_spec["terminationGracePeriodSeconds"]
    assert [m["mountPath"] for m in pod_spec["containers"][0]["volumeMounts"]] == [
        "/dev/shm", k8s.CONFIG_MOUNT, k8s.STAGING_MOUNT
    ]  # fmt: skip
    secret = {k: v for k, v in server.env.items() if k != "AWS_ENDPOINT_URL"}  # the keys, the region
    secret_env = _secret_env(trainjob, {**secret, "AWS_REGION": secret["AWS_DEFAULT_REGION"]})
    _configmap_volume(configmap, config_map["data"])
    user = f"{os.getuid() or 1000}:{os.getgid() or 1000}"
    # Each pod's emptyDir, a host folder of mode 0777 made afresh before each start as for a new pod (a
    # --tmpfs there took the mode of the folder under it at the second start: 0755, the trainer's user
    # could not write).
    staging = [tmp_path / f"staging-{index}" for index in range(2)]

    def empty_dirs():
        for folder in staging:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            folder.chmod(0o777)

    # The two pods, made once (each a copy of the image), in parallel.
    containers = []
    for index in range(2):
        pet, args = _pod_env(trainjob, index)
        pet |= secret_env
        assert pet["AWS_ENDPOINT_URL"] == server.url and pet["TRAINER_S3_STAGING"] == k8s.STAGING_ROOT
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
                "-v",
                f"{staging[index]}:{k8s.STAGING_MOUNT}",  # the emptyDir: made empty before every start
                "--shm-size",
                "256m",
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

    # 1. The set starts: both pods rendezvous and train. After a checkpoint in the bucket the second pod's node
    # is drained: its kubelet stops it with the TrainJob's grace period; both ranks save and upload, and it
    # exits 143. Its Job fails, and the JobSet deletes the first pod (waiting at torchrun's exit barrier) to
    # start the set again.
    empty_dirs()
    sh("docker", "start", *names)
    committed = "checkpoints/step_00000005/manifest.json"
    wait_for(
        lambda: committed in keys(server, bucket, prefix) or any(_state(n) != "running" for n in names),
        300,
        "the two pods to commit their first checkpoint to the bucket",
        interval=0.5,
    )
    assert all(_state(n) == "running" for n in names), [_logs(n)[-3000:] for n in names]
    moments["trained"] = time.monotonic()
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
    assert saved < STEPS, "training ended before it could be stopped; raise STEPS"
    run_dir = download(server, bucket, prefix, tmp_path / "stopped")  # the bucket, read as a folder
    assert [r["step"] for r in rows(run_dir)] == list(range(1, saved + 1))
    assert rows(run_dir)[-1]["world_size"] == 2
    status = layout.read_status(run_dir)
    assert (status["state"], status["step"], layout.latest_committed_step(run_dir)) == ("stopped", saved, saved)

    # 2. The set started again (the JobSet's failurePolicy): the same pods, a new rendezvous; they resume
    # from the saved step and run to the end, each step logged once, and exit 0.
    empty_dirs()
    sh("docker", "start", *names)
    done = [sh("docker", "wait", n, timeout=600).stdout.strip() for n in names]
    logs = [_logs(n) for n in names]
    assert done == ["0", "0"], [log[-3000:] for log in logs]
    assert f" at step {saved} (saved by 2 processes" in logs[0], logs[0][-3000:]
    run_dir = download(server, bucket, prefix, tmp_path / "finished")
    assert [r["step"] for r in rows(run_dir)] == list(range(1, STEPS + 1))
    status = layout.read_status(run_dir)
    assert (status["state"], layout.latest_committed_step(run_dir)) == ("finished", STEPS)
    moments["resumed to the end"] = time.monotonic()
    times = list(moments.values())
    print(
        "pods:",
        ", ".join(f"{what} +{now - then:.0f} s" for (what, now), then in zip(moments.items(), [times[0], *times])),
    )


def _state(container: str) -> str:
    return sh("docker", "inspect", "-f", "{{.State.Status}}", container).stdout.strip()
