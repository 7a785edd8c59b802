"""Slurm launchers against the real local cluster (make slurm-up), plus golden batch scripts.

The cluster tests are skipped with one line when the cluster is not up. Every job is tiny: one
CPU process per emulated node, the default config's tiny transformer, a few dozen steps.
Run directories live under runs/ (a path every node sees), or under ~/.cache when the repository
itself sits on a node-local path such as /tmp, which multi-node submissions rightly refuse.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer import submit

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def _cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
    return out.returncode == 0 and len(re.findall(r" (idle|mix|alloc)", out.stdout)) >= 4


cluster = pytest.mark.skipif(not _cluster_up(), reason="local Slurm cluster is not up (make slurm-up)")


@pytest.fixture(scope="module")
def runs():
    root = REPO / "runs" / f"test-slurm-{os.getpid()}"
    try:
        submit.check_shared(root, nodes=4)
    except submit.SubmitError:  # e.g. a CI clone in /tmp
        root = Path.home() / ".cache" / "fsdp-trainer-tests" / f"slurm-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ---- helpers ------------------------------------------------------------------------------------


def submit_job(*args: str, env: dict[str, str] | None = None) -> str:
    """Run python -m trainer.submit; return the job id it prints."""
    out = subprocess.run([sys.executable, "-m", "trainer.submit", *args], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_job(job_id: str, timeout: float = 240, release: bool = True) -> dict[str, str]:
    """Wait until job_id ends; a requeued job is released after 2 s instead of Slurm's ~120 s.

    Not at once: slurmd refuses a launch whose credential is not newer, to the second, than the
    requeue's revocation ("Job credential revoked"), and Slurm then fails the job for good."""
    deadline, released = time.time() + timeout, None  # the restart count last released
    while time.time() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in FINAL_STATES:
            return info
        if (release and info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
                and info.get("Restarts") != released):
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now+2"], check=True)
            released = info.get("Restarts")
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not end within {timeout} s: {job_info(job_id)}")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def log_text(run_dir: Path, job_id: str) -> str:
    return (run_dir / "slurm" / f"{job_id}.out").read_text()


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint (model, optimizer), read in this one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = submit.latest_step(run_dir)
    out = run_dir / "final.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}", out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)

    walk("", torch.load(out, weights_only=False))
    return flat


COMMON = ["checkpoint.interval=5", "log.interval=5"]


# ---- jobs on the local cluster ------------------------------------------------------------------


@cluster
def test_four_nodes_then_continue_on_two(runs):
    run_dir = runs / "nodes-4-then-2"
    job = submit_job("--nodes", "4", "--run-dir", str(run_dir), "train.steps=10", *COMMON)
    info = wait_job(job)
    assert info["JobState"] == "COMPLETED", log_text(run_dir, job)
    assert {row["world_size"] for row in metrics(run_dir)} == {4}
    assert submit.latest_step(run_dir) == 10
    # Same run directory, half the nodes, more steps: resumes at step 10 with 2 ranks.
    job2 = submit_job("--nodes", "2", "--run-dir", str(run_dir), "train.steps=20", *COMMON)
    info = wait_job(job2)
    assert info["JobState"] == "COMPLETED", log_text(run_dir, job2)
    rows = metrics(run_dir)
    assert [r["world_size"] for r in rows if r["step"] > 10] and all(r["world_size"] == 2 for r in rows if r["step"] > 10)
    assert "resumed from" in log_text(run_dir, job2) and "at step 10" in log_text(run_dir, job2)
    assert submit.latest_step(run_dir) == 20


@cluster
def test_preempted_job_requeues_and_matches_uninterrupted_run(runs):
    # Long enough that the preemption lands mid-run also on a quiet machine (30 steps once ended first).
    steps = ["train.steps=60", *COMMON]
    reference, victim = runs / "reference", runs / "preempted"
    # Whole nodes (sbatch reads SBATCH_EXCLUSIVE), so that preempting one job leaves the other alone.
    whole_nodes = {"SBATCH_EXCLUSIVE": "exclusive"}
    ref_job = submit_job("--nodes", "2", "--run-dir", str(reference), *steps, env=whole_nodes)
    job = submit_job("--nodes", "2", "--run-dir", str(victim), *steps, env=whole_nodes)
    wait_for(lambda: job_info(job).get("JobState") == "RUNNING", 60, "the job to start")
    nodes = job_info(job)["NodeList"]
    wait_for(lambda: submit.latest_step(victim), 90, "the first checkpoint")
    # An exclusive job in the urgent partition needs the victim's nodes: Slurm preempts it.
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-N2", f"--nodelist={nodes}",
                             "-o", str(runs / "urgent-%j.out"), "--wrap", "sleep 1"],
                            capture_output=True, text=True, check=True).stdout.strip()
    wait_for(lambda: int(job_info(job).get("Restarts", 0)) >= 1, 60, "the preempted job to be requeued")
    stopped_at = submit.latest_step(victim)
    assert stopped_at is not None and stopped_at < 60
    assert wait_job(urgent)["JobState"] == "COMPLETED"
    info = wait_job(job)
    assert info["JobState"] == "COMPLETED", log_text(victim, job)
    log = log_text(victim, job)
    assert "received SIGTERM" in log and "restart 1" in log and f"at step {stopped_at}" in log
    assert wait_job(ref_job)["JobState"] == "COMPLETED"
    assert int(job_info(ref_job).get("Restarts", 0)) == 0
    got, want = final_state(victim), final_state(reference)
    assert got.keys() == want.keys() and len(got) > 0
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs after preemption"


@cluster
def test_time_limit_warning_saves_and_requeues(runs):
    """The warning Slurm sends before the time limit (#SBATCH --signal=USR1@N) is SIGUSR1 to every
    job step; scancel --signal=USR1 sends exactly that now instead of after a minute or more."""
    run_dir = runs / "time-limit"
    job = submit_job("--nodes", "2", "--run-dir", str(run_dir), "--time", "30",
                     "train.steps=1000000", "checkpoint.interval=1000000", "log.interval=5")
    try:
        wait_for(lambda: run_dir.joinpath("metrics.jsonl").is_file(), 90, "training to start")
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        wait_for(lambda: int(job_info(job).get("Restarts", 0)) >= 1, 60, "the job to be requeued")
        log = log_text(run_dir, job)
        assert "received SIGUSR1" in log and "requeueing" in log
        step = submit.latest_step(run_dir)
        assert step is not None and 0 < step < 1000000
    finally:
        subprocess.run(["scancel", job])


@cluster
def test_job_without_progress_is_not_requeued_forever(runs):
    run_dir = runs / "no-progress"
    (run_dir / "metrics.jsonl").mkdir(parents=True)  # the trainer cannot write its metrics: fails at start
    job = submit_job("--nodes", "1", "--run-dir", str(run_dir), "--max-attempts", "2", "train.steps=10",
                     "log.interval=1")
    info = wait_job(job)
    assert info["JobState"] == "FAILED"
    assert info["Restarts"] == "1"
    assert "NOT requeued: 2 attempts in a row saved no new checkpoint" in log_text(run_dir, job)


@cluster
def test_submitit_launcher_checkpoints_requeues_and_finishes(runs):
    """submitit's own path: the warning signal (USR1 here) makes submitit call checkpoint(), which
    waits for the ranks to save; submitit requeues, and the requeued job resumes and finishes."""
    run_dir = runs / "submitit"
    job = submit_job("--launcher", "submitit", "--nodes", "2", "--run-dir", str(run_dir), "--time", "10",
                     "train.steps=100", "checkpoint.interval=100", "log.interval=5")
    wait_for(lambda: run_dir.joinpath("metrics.jsonl").is_file(), 90, "training to start")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    info = wait_job(job)
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "slurm" / "submitit").glob(f"{job}_0_log.*")))
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", logs
    # Resumed, not restarted: every step was logged once (submitit may rewrite its log on requeue).
    steps = [row["step"] for row in metrics(run_dir)]
    assert steps == sorted(set(steps)) and steps[-1] == 100, (steps, logs)
    assert {row["world_size"] for row in metrics(run_dir)} == {2}
    assert submit.latest_step(run_dir) == 100


@cluster
@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "NODES='0'"),
    (["--nodes", "four"], "NODES='four'"),
    (["--config", "configs/missing.yaml"], "CONFIG=configs/missing.yaml: no such file"),
    (["--partition", "nosuch"], "PARTITION=nosuch: unknown partition"),
    (["--nodes", "2", "--run-dir", "/dev/shm/run"], "node-local"),
    (["--nodes", "2", "--run-dir", "/tmp/run"], "node-local"),
    (["train.steps=-3"], "train.steps"),
])
def test_bad_input_is_one_line_before_submitting(args, message):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    out = subprocess.run([sys.executable, "-m", "trainer.submit", *args], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("submit: error:") and message in lines[0], out.stderr
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


# ---- rendered batch scripts for what cannot run here (GPUs, containers) -------------------------


def _gpu_job(container: str | None) -> submit.Job:
    return submit.Job(nodes=4, gpus_per_node=8, config=Path("/shared/fsdp-trainer/configs/llama.yaml"),
                      run_dir=Path("/shared/runs/llama-8b"), overrides=["train.steps=10000"], time="1-00:00:00",
                      partition="gpu", container=container, warn_seconds=300, max_attempts=3)


@pytest.mark.parametrize("name, job", [
    ("gpu-8x4.sbatch", _gpu_job(None)),
    ("gpu-8x4-pyxis.sbatch", _gpu_job("/shared/images/trainer.sqsh")),
    ("gpu-8x4-apptainer.sbatch", _gpu_job("/shared/images/trainer.sif")),
])
def test_rendered_batch_script_matches_golden(name, job):
    text = submit.render_sbatch(job, repo_dir=Path("/shared/fsdp-trainer"),
                                python="/shared/fsdp-trainer/.venv/bin/python", host_python="python3")
    if os.environ.get("UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(text)
    assert text == (GOLDEN / name).read_text(), f"rendered script differs from tests/golden/{name}"
    assert "{{" not in text and "--node-rank=\\$SLURM_NODEID" in text and "srun --kill-on-bad-exit=1" in text


def test_requeue_check_counts_attempts_without_progress(tmp_path, monkeypatch):
    """The guard's bookkeeping, with scontrol replaced by a script that records its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho JobState=RUNNING\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    (run_dir / "config.yaml").write_text("train:\n  steps: 20\n")

    def save(step: int) -> None:
        ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / ".metadata").write_text("")
        (ckpt / "meta.json").write_text("{}")

    assert submit.requeue_check(run_dir, 1, 2, "7") == 0  # nothing saved yet: attempt 1 of 2
    save(5)
    assert submit.requeue_check(run_dir, 0, 2, "7") == 0  # progress resets the count
    assert submit.requeue_check(run_dir, 1, 2, "7") == 0  # attempt 1 without progress
    assert submit.requeue_check(run_dir, 1, 2, "7") == 1  # attempt 2: gives up
    assert calls.read_text().count("requeue 7") == 3
    (run_dir / "checkpoints" / ".step_00000020.tmp").mkdir()  # temporary: ignored
    assert submit.latest_step(run_dir) == 5
    save(20)
    assert submit.requeue_check(run_dir, 0, 2, "8") == 0  # finished: no requeue
    assert calls.read_text().count("requeue") == 3
