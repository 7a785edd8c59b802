"""docker/base-image.sh cleans up after a debootstrap that failed half-way.

debootstrap mounts the host's /proc and /sys (and on some hosts binds /dev) into the folder it
fills. If it fails or is interrupted after that, those mounts are still there when the script
removes its temporary folder, and a plain `rm -rf` walks through them: into the host's /dev when
it is a bind mount. Here a stand-in debootstrap leaves a proc mount and a bind mount of a folder
we own, then fails; the script must unmount both, keep what the bind mount showed, and leave
nothing behind. Needs root (mount), as the script itself does.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.run import ROOT

pytestmark = [
    pytest.mark.slow,  # runs the base image's build script as root, with mounts
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root"),
]

FAKE_DEBOOTSTRAP = """#!/bin/sh
# debootstrap --variant=minbase SUITE TARGET MIRROR: mount like the real one, then fail.
target=$3
mkdir -p "$target/proc" "$target/dev"
mount -t proc proc "$target/proc"
mount --bind "$PRECIOUS" "$target/dev"
echo "E: Couldn't download packages" >&2
exit 1
"""

FAKE_DOCKER = """#!/bin/sh
exit 1  # no image yet: `docker image inspect` fails
"""


def _mounts_under(path: Path) -> list[str]:
    return [
        line.split()[1]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith(str(path))
    ]


def test_a_failed_debootstrap_leaves_no_mounts_and_deletes_nothing_outside(tmp_path):
    bin_dir, tmp, precious = tmp_path / "bin", tmp_path / "tmp", tmp_path / "precious"
    for d in (bin_dir, tmp, precious):
        d.mkdir()
    (precious / "null").write_text("stands for a device node\n")
    for name, text in (("debootstrap", FAKE_DEBOOTSTRAP), ("docker", FAKE_DOCKER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp), "PRECIOUS": str(precious)}
    try:
        out = subprocess.run(
            ["bash", str(ROOT / "docker" / "base-image.sh"), "fsdp-trainer-test-base:none"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == 1
        assert "base-image: debootstrap failed" in out.stderr
        assert _mounts_under(tmp) == []
        assert (precious / "null").read_text() == "stands for a device node\n"
        assert [p.name for p in tmp.iterdir() if p.is_dir()] == []  # the bootstrap folder is gone
    finally:
        for mount in reversed(_mounts_under(tmp_path)):
            subprocess.run(["umount", "-l", mount], capture_output=True)
