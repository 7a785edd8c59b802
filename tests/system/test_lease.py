"""The system tier of tests/unit/test_lease.py, whose docstring says what both halves test."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.outputs import rows
from tests.helpers.run import PYTHON, ROOT, TINY, run_command, wait_for
from tests.unit.test_lease import _dead_pid, _token, _write
from trainer.rundir import layout
from trainer.rundir import lease as lease_module
from trainer.rundir.lease import STALE_S, Lease, LeaseError


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


@pytest.mark.slow  # forks racing processes
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
    racers = [ctx.Process(target=_racer, args=(k, run_dirs, barriers, done_line, results)) for k in range(max(sizes))]
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


def _unshare_works() -> bool:
    try:
        return (
            subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0
        )
    except FileNotFoundError:
        return False


def _folders(run_dir: Path) -> set[str]:
    return {name for name in os.listdir(run_dir / "checkpoints") if name.startswith("step_")}


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (root, util-linux)")
@pytest.mark.slow
def test_a_run_in_another_pid_namespace_is_refused_and_a_run_that_loses_its_lease_stops_at_once(tmp_path):
    """One run (2 ranks, a save at every step: each commits and deletes, so a late one would show).
    1. A second run started under `unshare --pid --fork --mount-proc` (same hostname, its own pids) is
       refused with exit 2 and one line naming the owner; the first goes on (the issue: it judged the
       live owner gone, took the run dir, and each run deleted the other's checkpoints).
    2. lease.json then overwritten by another run: no checkpoint is committed or deleted after it,
       every rank stops within a step or two, one line names the new owner, and the launcher exits
       with requeue.LEASE_LOST (not 0, a clean stop; not 2, bad input)."""
    from tests.helpers.run import launch
    from trainer.launchers.requeue import LEASE_LOST

    run_dir = tmp_path / "run"
    proc = launch(run_dir, "train.steps=100000", "checkpoint.interval=1", "checkpoint.keep=2")
    try:
        wait_for(lambda: (layout.latest_committed_step(run_dir) or 0) >= 2, 120, "the run to save")
        owner = json.loads((run_dir / "lease.json").read_text())
        second = run_command(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                PYTHON,
                "-m",
                "trainer",
                "--config",
                str(ROOT / "configs/default.yaml"),
                f"run_dir={run_dir}",
                *TINY,
                "train.steps=100000",
            ],
            timeout=60,
        )
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: run_dir {run_dir} is in use by process {owner['pid']} on {owner['host']} (lease renewed "
        ), second.stderr[-3000:]
        assert json.loads((run_dir / "lease.json").read_text())["token"] == owner["token"]
        saved = layout.latest_committed_step(run_dir)
        wait_for(lambda: (layout.latest_committed_step(run_dir) or 0) > saved + 1, 60, "the first run to go on saving")

        before = _folders(run_dir)
        other = {"host": "elsewhere", "pid": 4242, "slurm_job": "77", "token": uuid.uuid4().hex, "renewed": time.time()}
        tmp = run_dir / "lease.json.other"
        tmp.write_text(json.dumps(other))
        os.replace(tmp, run_dir / "lease.json")  # as a takeover does
        time.sleep(0.5)  # a few saves at this pace, had the run gone on
        after = _folders(run_dir)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # its ranks, in sessions of their own, get SIGTERM when it dies
            proc.kill()
            proc.wait()
    assert proc.returncode == LEASE_LOST, err[-3000:]
    assert len(before ^ after) <= 2, f"more than the commit and deletion in flight: {before} -> {after}"
    assert _folders(run_dir) == after, "nothing committed or deleted after the lease was lost"
    newest = max(int(name.split("_")[1]) for name in after)
    assert max(r["step"] for r in rows(run_dir)) <= newest + 3, "stopped within a step or two"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: lost the lease of run_dir {run_dir} to process 4242 on elsewhere, Slurm job 77 at step "
    ), err[-3000:]
    assert "launch: rank" not in err and "Traceback" not in err, err[-3000:]
    assert json.loads((run_dir / "lease.json").read_text()) == other, "the new owner's lease is left alone"
