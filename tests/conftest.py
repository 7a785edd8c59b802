"""The tests' fixtures and hooks; their plain helpers are in tests/helpers/ (imported as
`from tests.helpers.run import train`).

Two tiers, by folder: tests/unit/ runs in this process (config, checks, layout, messages, readers on
small files: `make test-fast`), tests/system/ starts ranks, launchers, Slurm jobs or images (`make
test`). The `slow` marker stays on the system tests, so `-m "not slow"` selects the same tests as
tests/unit/; the hook below keeps the two in step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.inputs import SECRET
from tests.helpers.run import ROOT
from tests.helpers.s3 import moto_server, s3  # noqa: F401 - the S3 server's fixtures, for every test

# The in-process tests run on one thread, as the processes they start do (helpers.run.env): their
# tensors are small, and on a loaded 2-core machine two threads of each op wait for each other.
torch.set_num_threads(1)

UNIT, SYSTEM = ROOT / "tests" / "unit", ROOT / "tests" / "system"


def pytest_collection_modifyitems(config, items):
    """The folder is the tier: a test under tests/system/ is slow (marked here if its file forgot); one
    under tests/unit/ may not be (it belongs in tests/system/); a test file in neither would not run
    (make test names the two folders), so it is refused."""
    outside = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py"))
    if outside:
        raise pytest.UsageError(
            f"test files outside tests/unit/ and tests/system/: {', '.join(outside)}; move each into its tier "
            "(unit: in this process, no ranks; system: starts ranks, launchers, Slurm or Docker)"
        )
    misplaced = []
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(SYSTEM):
            if item.get_closest_marker("slow") is None:
                item.add_marker(pytest.mark.slow)
        elif path.is_relative_to(UNIT) and item.get_closest_marker("slow") is not None:
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(
            f"marked slow but under tests/unit/: {', '.join(misplaced)}; move them to tests/system/"
        )


@pytest.fixture
def secret(tmp_path):
    """A file of the victim's own, which a link planted in a run dir points to."""
    path = tmp_path / "secret"
    path.write_text(SECRET)
    return path


@pytest.fixture
def handlers():
    """The test process's own signal handlers back after a main() that installs its own (trainer.launch)."""
    import signal

    from trainer.resilience import signals

    saved = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def group():
    """A gloo process group of one in this process (a HashStore, no port): for a test file's
    Checkpointer and DCP saves and loads."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    """A run dir root the nodes see and that only this user can swap: submitit refuses a run dir
    whose folders above let another user rename it (a CI clone owned by another uid than the one
    running the tests, or one in /tmp, falls back to a folder under home)."""
    from trainer.launchers import slurm
    from trainer.rundir import files

    root = ROOT / "runs" / f"test-slurm-{os.getpid()}"
    try:
        slurm.check_shared(root, nodes=4)
        root.mkdir(parents=True, exist_ok=True)
        safe = files.replaceable(root) is None
    except (slurm.SubmitError, OSError):
        safe = False
    if not safe:
        shutil.rmtree(root, ignore_errors=True)
        root = Path.home() / ".cache" / "fsdp-trainer-tests" / f"slurm-{os.getpid()}"
        root.mkdir(parents=True, exist_ok=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def trainer_image():
    """The trainer's image, built once per session by docker/build-image.sh exactly as `make image` (the
    CUDA build of torch from PyPI, which also runs on the CPU here), for every container test; removed
    at the end if this session made it. A test that asks for it needs a Docker engine (helpers.docker.engine)."""
    import subprocess
    import time

    from tests.helpers.docker import IMAGE, sh

    existed = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode == 0
    started = time.monotonic()
    out = sh(str(ROOT / "docker" / "build-image.sh"), IMAGE, timeout=1500)
    print(out.stdout.strip().splitlines()[-1], f"(fixture: {time.monotonic() - started:.0f} s)")
    yield IMAGE
    if not existed:
        subprocess.run(["docker", "rmi", IMAGE], capture_output=True)
        subprocess.run(
            ["docker", "image", "prune", "-f", "--filter", "label=fsdp-trainer.stage=build"], capture_output=True
        )
