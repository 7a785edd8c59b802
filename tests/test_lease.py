"""One run per run dir (trainer/lease.py): who is judged alive, exactly one winner of a takeover,
a run in another PID namespace refused, and a run that loses its lease stops at once."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT, TINY, env, kill_group, rows, start, wait_for
from trainer import layout, lease as lease_module
from trainer.lease import STALE_S, Lease, LeaseError


def _proc_identity(pid: int | str = "self") -> dict:
    """What names a process beyond host and pid, read here from /proc independently of lease.py."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return {"host": socket.gethostname(), "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "pid_ns": os.readlink("/proc/self/ns/pid"), "start": int(stat.rsplit(")", 1)[1].split()[19])}


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


def _racer(k: int, run_dirs: list[str], barriers: list, done_line, results) -> None:
    """Racer k: in each trial it takes part in, wait for the others, then try to take the lease.
    It stays alive to the end, so that a lease it won names a live process. Each read of the lease
    file is followed by a random pause of up to 2 ms (this process only): more interleavings."""
    rng = random.Random(k)
    for name in ("_read", "_read_raw"):
        original = getattr(lease_module, name, None)
        if original is not None:
            def slowed(*args, _original=original, **kw):
                result = _original(*args, **kw)
                time.sleep(rng.uniform(0, 0.002))
                return result

            setattr(lease_module, name, slowed)
    for trial, (run_dir, start_line) in enumerate(zip(run_dirs, barriers)):
        if k >= start_line.parties:
            continue
        mine = Lease(run_dir)
        start_line.wait()
        try:
            mine.acquire()
            results.put((trial, "won", mine.me["token"]))
        except LeaseError:
            results.put((trial, "refused", None))
        except Exception as e:  # noqa: BLE001 - a crash is an outcome too
            results.put((trial, f"crashed: {type(e).__name__}: {e}", None))
        mine._stop.set()
    done_line.wait()  # the last trial's winner lives until every racer has tried
    results.close()
    results.join_thread()  # what was put reaches the parent before the exit below
    os._exit(0)


def test_exactly_one_of_many_starters_takes_over_a_dead_owners_lease(tmp_path):
    """40 trials of 2 to 4 processes starting at once against a dead owner's lease."""
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(27)
    sizes = [rng.randint(2, 4) for _ in range(40)]
    run_dirs = []
    for trial in range(len(sizes)):
        run_dir = tmp_path / f"t{trial}"
        run_dir.mkdir()
        _write(run_dir, pid=_dead_pid(), renewed=time.time() - STALE_S - 1)
        run_dirs.append(str(run_dir))
    barriers, done_line, results = [ctx.Barrier(n) for n in sizes], ctx.Barrier(max(sizes)), ctx.Queue()
    racers = [ctx.Process(target=_racer, args=(k, run_dirs, barriers, done_line, results))
              for k in range(max(sizes))]
    for p in racers:
        p.start()
    try:
        outcomes: dict[int, list] = {trial: [] for trial in range(len(sizes))}
        for _ in range(sum(sizes)):
            trial, outcome, token = results.get(timeout=60)
            outcomes[trial].append((outcome, token))
    finally:
        for p in racers:
            p.join(timeout=60)
            p.kill()
    for trial, n in enumerate(sizes):
        winners = [token for outcome, token in outcomes[trial] if outcome == "won"]
        assert len(winners) == 1, f"trial {trial}: {n} starters, outcomes {outcomes[trial]}"
        assert _token(Path(run_dirs[trial])) == winners[0]
        assert os.listdir(run_dirs[trial]) == ["lease.json"], f"trial {trial}: {os.listdir(run_dirs[trial])}"
