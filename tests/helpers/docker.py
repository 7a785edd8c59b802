"""The real Docker engine of the container tests (tests/system/test_docker.py, test_k8s_containers.py):
whether one answers, commands against it, and the image both use (conftest's trainer_image builds it
once per session, exactly as `make image`)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.run import ROOT

IMAGE = "fsdp-trainer:latest"


def sh(*cmd: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """`cmd` run in the checkout, its output kept; with `check`, a non-zero exit fails the test with it."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)
    if check:
        assert out.returncode == 0, (
            f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out


def engine_problem() -> str | None:
    """None when a Docker engine answers, else why not. Nothing is installed or started here: that
    is .ci/run's job (or `make docker-engine`), never a side effect of running the tests."""
    if shutil.which("docker") is None:
        return "no docker client (make docker-engine installs one on Debian)"
    out = subprocess.run(["docker", "info"], capture_output=True, text=True)
    return None if out.returncode == 0 else "no engine answers `docker info` (make docker-engine starts one)"


_why_not = engine_problem()
# A test that needs the engine: skipped with one line when none answers.
engine = pytest.mark.skipif(_why_not is not None, reason=f"no Docker engine: {_why_not}")
