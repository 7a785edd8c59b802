"""One run per run dir (trainer/rundir/lease.py): who is judged alive, exactly one winner of a takeover,
a run in another PID namespace refused, and a run that loses its lease stops at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from trainer.rundir import lease as lease_module
from trainer.rundir.lease import STALE_S, Lease, LeaseError


def _proc_identity(pid: int | str = "self") -> dict:
    """What names a process beyond host and pid, read here from /proc independently of lease.py."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return {
        "host": socket.gethostname(),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
        "start": int(stat.rsplit(")", 1)[1].split()[19]),
    }


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _write(run_dir: Path, **owner) -> dict:
    owner = {"host": socket.gethostname(), "slurm_job": "", "token": uuid.uuid4().hex, "renewed": time.time(), **owner}
    (run_dir / "lease.json").write_text(json.dumps(owner))
    return owner


def _token(run_dir: Path) -> str:
    return json.loads((run_dir / "lease.json").read_text())["token"]


def test_a_live_pid_that_started_at_another_time_is_another_process(tmp_path, caplog):
    """The pid was reused: the process it names now is not the one that took the lease."""
    me = _proc_identity()
    _write(tmp_path, pid=os.getpid(), **{**me, "start": me["start"] + 1})
    mine = Lease(str(tmp_path))
    mine.acquire()
    try:
        assert _token(tmp_path) == mine.me["token"]
        assert f"process {os.getpid()} on {socket.gethostname()} is gone" in caplog.text
    finally:
        mine.release()
    assert not (tmp_path / "lease.json").exists()


def test_a_lease_from_another_pid_namespace_is_judged_by_its_renewal(tmp_path):
    """Its pid means nothing here (a container with host networking, `unshare --pid`): a fresh renewal
    is a live run, even when a process of that number does not exist in this namespace."""
    other_ns = {**_proc_identity(), "pid_ns": "pid:[1]"}
    _write(tmp_path, pid=_dead_pid(), **other_ns)
    with pytest.raises(LeaseError, match=rf"^run_dir {tmp_path} is in use by process \d+ on {socket.gethostname()} "):
        Lease(str(tmp_path)).acquire()
    _write(tmp_path, pid=os.getpid(), **{**other_ns, "renewed": time.time() - STALE_S - 1})
    mine = Lease(str(tmp_path))
    mine.acquire()  # not renewed for STALE_S: taken over, although the pid is alive here
    assert _token(tmp_path) == mine.me["token"]
    mine.release()


def test_takeover_when_a_second_starter_completes_between_the_read_and_the_takeover(tmp_path, monkeypatch):
    """Forced interleaving: A reads the dead owner's lease, B takes it over completely, then A goes
    on with what it read. Exactly one of them holds the lease."""
    _write(tmp_path, pid=_dead_pid(), renewed=time.time() - STALE_S - 1)
    a, b = Lease(str(tmp_path)), Lease(str(tmp_path))
    b_result: list = []
    for name in ("_read", "_read_raw"):  # whichever reads the lease file when acquire() looks at it
        original = getattr(lease_module, name, None)
        if original is None:
            continue

        def hooked(*args, _original=original, **kw):
            result = _original(*args, **kw)
            if not b_result:  # once: B starts and finishes here
                b_result.append("pending")
                try:
                    b.acquire()
                    b_result[0] = "won"
                except LeaseError as e:
                    b_result[0] = f"refused: {e}"
            return result

        monkeypatch.setattr(lease_module, name, hooked)
    try:
        with pytest.raises(LeaseError, match="is in use by process"):
            a.acquire()
        assert b_result == ["won"]
        assert _token(tmp_path) == b.me["token"]
    finally:
        monkeypatch.undo()
        a.release()
        b.release()
    assert not (tmp_path / "lease.json").exists()
    assert os.listdir(tmp_path) == [], "no lock, temporary or stale file left behind"
