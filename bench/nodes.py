"""A node of the local Slurm cluster (slurm/local/up.sh) killed as a power loss would, and brought
back: shared by bench/goodput.py's node death and tests/system/test_slurm_failures.py's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parent_pid(proc: Path) -> str:
    """The parent's pid of /proc/<pid> (its stat's fourth field), "" once it is gone."""
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


def job_processes(job_id: str, **wanted: str) -> list[int]:
    """The processes of job_id whose environment has every NAME=value of `wanted` (e.g. RANK="1",
    SLURMD_NODENAME="n2"): found by what they are, not by guessing pids (slurmstepd daemonizes, so
    a job's processes are not in its slurmd's process tree)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            pairs = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        environ = dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
        if environ.get("SLURM_JOB_ID") == job_id and all(environ.get(k) == v for k, v in wanted.items()):
            found.append(int(proc.name))
    return found


def kill_node(job_id: str, node: str) -> None:
    """Kill an emulated node as a power loss would: its slurmd, then the job's processes on it (its
    slurmstepd daemonized out of slurmd's tree: found as the parent of the tasks whose environment
    says SLURMD_NODENAME=node)."""
    os.kill(int(Path(f"/run/slurm-local/slurmd-{node}.pid").read_text()), 9)
    tasks = job_processes(job_id, SLURMD_NODENAME=node)
    if not tasks:
        raise RuntimeError(f"no process of job {job_id} on {node}")
    stepds = {int(parent_pid(Path(f"/proc/{p}"))) for p in tasks} - set(tasks)
    for pid in {*stepds, *tasks}:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def restore_node(node: str) -> None:
    """Start the node's slurmd again (slurm/local/up.sh starts what is missing) and resume it, which
    Slurm left DOWN after its SlurmdTimeout."""
    subprocess.run(["bash", str(ROOT / "slurm/local/up.sh")], capture_output=True)
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
