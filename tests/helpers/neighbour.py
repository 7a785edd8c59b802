"""The neighbour of issue 41: a second user in the victim's group, who can write a group-writable
(2775) shared folder that holds the victim's run dirs, and nothing of the victim's own (0755).

The tests run as root (the CI container): the victim is this process, the neighbour a process of
uid NEIGHBOUR started with subprocess's user=/group=. /tmp/pytest-of-root is 0700, so the shared
folder is made under /tmp where the neighbour can reach it. Without root no second uid can be made:
the tests that need one are skipped."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

NEIGHBOUR = 4321  # uid and gid of the neighbour; the shared folder's group
# The neighbour's Python: the system's (stdlib only); the tests' own may be under root's 0700 home.
NEIGHBOUR_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or NEIGHBOUR_PYTHON is None, reason="a second uid needs root to be made, and a system python3"
)


@contextlib.contextmanager
def shared_folder():
    """A group-writable (2775) folder of the neighbour's group under a folder both can reach
    (a test file's `shared` fixture yields it)."""
    base = Path(tempfile.mkdtemp(prefix="neighbour-", dir="/tmp"))
    base.chmod(0o755)
    folder = base / "shared"
    folder.mkdir()
    os.chown(folder, os.geteuid(), NEIGHBOUR)
    folder.chmod(0o2775)
    try:
        yield folder
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_dir(shared: Path, name: str) -> Path:
    """A run dir of the victim's in `shared`, group-writable as the issue's (2775)."""
    path = shared / name
    path.mkdir()
    os.chown(path, os.geteuid(), NEIGHBOUR)
    path.chmod(0o2775)
    return path


def as_neighbour(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a Python `script` (with `args`) as the neighbour; fails the test if it fails."""
    proc = subprocess.run(
        [NEIGHBOUR_PYTHON, "-c", script, *args],
        user=NEIGHBOUR,
        group=NEIGHBOUR,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def tree_hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes, or 'link -> target'} of every file under `folder`."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[relative] = "link -> " + os.readlink(path)
            elif os.path.isfile(path):
                found[relative] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            else:
                found[relative] = "special"
    return found
