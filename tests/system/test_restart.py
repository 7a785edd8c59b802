"""Restarts inside the allocation (python -m trainer.launch, launch.max_restarts) and metrics.jsonl
after any stop: each step's row once, the restart and the resume marked."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.helpers.outputs import assert_same_weights, rows, weights
from tests.helpers.run import TINY, launch, train, wait_for
from trainer.dist import node_name
from trainer.observe.metrics import LogArgs, Reporter
from trainer.rundir import layout

pytestmark = pytest.mark.slow  # kills and restarts trainer runs


def test_a_killed_rank_restarts_every_rank_from_the_newest_checkpoint(tmp_path):
    """kill -9 of rank 0 mid-run: the launcher restarts both ranks from the newest checkpoint, says
    so in one line and a restart row; the run finishes with every step's row once, a resume row,
    and the weights of a run that was never interrupted, bit for bit."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    overrides = ["train.steps=40", "checkpoint.interval=5"]
    proc = launch(run_dir, *overrides)
    wait_for(lambda: layout.latest_committed_step(run_dir) and len(rows(run_dir)) >= 8, 120, "a checkpoint and step 8")
    os.kill(json.loads((run_dir / "lease.json").read_text())["pid"], signal.SIGKILL)  # rank 0 holds the lease
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    found = re.findall(
        r"^launch: rank 0 on (\S+) failed with exit code -9 \(SIGKILL\); restart 1 of 3: every rank "
        r"starts again from step (\d+), the newest checkpoint$",
        err,
        re.M,
    )
    assert len(found) == 1 and found[0][0] == node_name(), err[-3000:]
    resumed = int(found[0][1])
    assert resumed % 5 == 0 and resumed >= 5

    assert [r["step"] for r in rows(run_dir)] == list(range(1, 41))
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r["time"], float) for r in logged)
    events = [r for r in logged if "event" in r]
    assert [(r["event"], r["step"]) for r in events] == [("restart", resumed), ("resume", resumed)], events
    assert events[0]["rank"] == 0 and events[0]["exit_code"] == -9 and events[0]["node"] == node_name()
    assert events[1]["world_size"] == 2 and events[1]["checkpoint"].endswith(f"step_{resumed:08d}")
    assert logged.index(events[0]) == resumed  # after the rows of steps 1..resumed, before the next

    train(reference, 2, *TINY, *overrides)
    assert_same_weights(weights(run_dir), weights(reference), exact=True)


def test_divergence_is_not_restarted(tmp_path):
    """A diverged run would diverge again: one error line, exit 1, no restart. (Bad input is not
    restarted either: tests/system/test_bad_input_launch.py's tests see one line.)"""
    proc = launch(tmp_path / "run", "optim.lr=1e30", "optim.warmup_steps=0", "train.grad_clip=null")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training diverged" in errors[0], err[-3000:]
    assert "restart" not in err, err[-3000:]


def test_a_start_keeps_each_steps_row_once(tmp_path):
    """Resuming at step 5: the rows after it (an earlier start's, never saved) move to
    metrics.superseded.jsonl, a line cut short by a kill is dropped (no row: issue 32, never copied);
    a resume row follows; every row has its time."""
    path = tmp_path / "metrics.jsonl"
    earlier = [{"step": s, "loss": 1.0} for s in range(1, 9)] + [{"step": 6, "eval_loss": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"step": 9, "lo')
    reporter = Reporter(str(tmp_path), LogArgs(progress=False), 20, is_main=True)
    reporter.start(5, {"world_size": 2, "path": "run/checkpoints/step_00000005"})
    reporter.row({"step": 6, "loss": 0.5, "samples_per_s": 1.0})
    logged = [json.loads(line) for line in path.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in logged] == [
        *earlier[:5],
        {"event": "resume", "step": 5, "world_size": 2, "checkpoint": "run/checkpoints/step_00000005"},
        {"step": 6, "loss": 0.5, "samples_per_s": 1.0},
    ]
    assert all(isinstance(r["time"], float) for r in logged[5:])
    superseded = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in superseded] == earlier[5:]
    # A new run (step 0, nothing loaded) over a crashed one's rows: none kept, no resume row.
    reporter.start(0, None)
    assert path.read_text() == ""
