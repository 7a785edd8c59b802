"""The system tier of tests/unit/test_plant.py, whose docstring says what both halves test."""

import os
import stat

import pytest

from tests.helpers.run import TINY, command, run_command
from trainer.rundir import layout


@pytest.mark.slow
def test_a_fifo_at_status_json_stops_the_trainer_before_it_starts(tmp_path):
    """Issue 32 item 6: a FIFO at status.json hung the start in read_status while it kept the lease."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / layout.STATUS_FILE)
    proc = run_command(command(run, 1, TINY), timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"{run / layout.STATUS_FILE} is a FIFO, where the run keeps its status.json file" in proc.stderr
    assert stat.S_ISFIFO(os.lstat(run / layout.STATUS_FILE).st_mode)
    assert not (run / layout.METRICS_FILE).exists() and not (run / layout.LEASE_FILE).exists()


@pytest.mark.slow
def test_a_fifo_swapped_in_at_status_json_while_the_run_trains_stops_it_in_one_line(tmp_path):
    """Issue 41 item 9: a FIFO renamed over status.json after the start: rank 0 died at its next save
    with an UnsafeFile traceback. Now one line naming the file, exit 2 (bad input: not restarted, not
    requeued), and the checkpoints saved before it are intact."""
    from tests.helpers.run import launch, wait_for

    run = tmp_path / "run"
    proc = launch(run, "train.steps=400", "checkpoint.interval=2", "checkpoint.keep=0", start_new_session=True)
    try:
        wait_for(lambda: layout.latest_committed_step(run), 240, "the first checkpoint")
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.rename(fifo, run / layout.STATUS_FILE)  # as the neighbour would: atomic, mid-run
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert f"error: {run / layout.STATUS_FILE} is a FIFO, not a regular file" in err.splitlines(), err[-3000:]
    assert layout.latest_committed_step(run) is not None
    assert stat.S_ISFIFO(os.lstat(run / layout.STATUS_FILE).st_mode)
