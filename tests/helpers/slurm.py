"""The local Slurm cluster (make slurm-up): tests/system/test_slurm_jobs.py, test_slurm_failures.py. The
run dirs' root the nodes see is the `runs` fixture (tests/conftest.py)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.run import ROOT, wait_for

FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
COMMON = ["checkpoint.interval=5", "log.interval=5"]  # the cluster jobs' checkpoint and log interval

# Polls of the cluster (scontrol, sinfo): 5 a second, not 50, on the cores the cluster shares.
wait_for_cluster = functools.partial(wait_for, interval=0.2)


@functools.cache
def _cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
    return out.returncode == 0 and len(re.findall(r" (idle|mix|alloc)", out.stdout)) >= 4


def cluster(test):
    """Needs the local Slurm cluster (skipped without it); slow: each such test runs jobs or submits."""
    no_cluster = pytest.mark.skipif(not _cluster_up(), reason="local Slurm cluster is not up (make slurm-up)")
    return pytest.mark.slow(no_cluster(test))


def submit_job(*args: str, env: dict[str, str] | None = None) -> str:
    """Run python -m trainer.submit; return the job id it prints."""
    out = subprocess.run(
        [sys.executable, "-m", "trainer.submit", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def make_submit(*variables: str) -> str:
    """`make submit VAR=...` as a user types it; return the job id it prints."""
    out = subprocess.run(["make", "submit", *variables], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
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
        if (
            release
            and info.get("JobState") == "PENDING"
            and info.get("Reason") == "BeginTime"
            and info.get("Restarts") != released
        ):
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now+2"], check=True)
            released = info.get("Restarts")
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not end within {timeout} s: {job_info(job_id)}")


def log_text(run_dir: Path, job_id: str) -> str:
    return (run_dir / "slurm" / f"{job_id}.out").read_text()
