"""The system tier of tests/unit/test_early_stop.py, whose docstring says what both halves test."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.checkpoints import rerecord
from tests.helpers.outputs import assert_same_weights, metrics, weights
from tests.helpers.run import TINY, launch_command, run_command, train
from trainer import early_stop
from trainer.launchers import requeue
from trainer.observe import metrics as metrics_cli
from trainer.rundir import layout

# Evaluations at steps 2, 4, 6, ...; no evaluation is lower than the first by 100, so with patience 2
# the run stops at step 6 whatever the losses are. Checkpoints at 5 and at the stop (all kept); the
# lr schedule's horizon fixed (optim.decay_steps), so train.steps may change between starts.
EARLY = [
    *TINY,
    "train.steps=20",
    "eval.interval=2",
    "eval.batches=1",
    "train.early_stop_patience=2",
    "train.early_stop_min_delta=100",
    "checkpoint.interval=5",
    "checkpoint.keep=0",
    "optim.decay_steps=20",
]
LINE = (
    "early stop at step 6: eval loss {:.4f} improved on the best, {:.4f} at step 2, by {:.4g} only; 2 evaluations "
    "in a row without an improvement by more than train.early_stop_min_delta=100 (train.early_stop_patience=2)"
)


def events(run_dir, name: str) -> list[dict]:
    rows = map(json.loads, (run_dir / layout.METRICS_FILE).read_text().splitlines())
    return [r for r in rows if r.get("event") == name]


def snapshot(run_dir) -> dict:
    """Every file of the run dir but status.json, by path: its bytes."""
    found = {}
    for folder, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(folder, name)
            if name != layout.STATUS_FILE:
                with open(path, "rb") as f:
                    found[os.path.relpath(path, run_dir)] = f.read()
    return found


@pytest.mark.slow
def test_a_run_stops_early_and_a_restart_has_nothing_to_do(tmp_path, capsys):
    run_dir = tmp_path / "run"
    out = train(run_dir, 1, *EARLY).stdout
    (row,) = events(run_dir, "early_stop")
    assert row["step"] == 6 and row["best_step"] == 2 and row["patience"] == 2
    (last,) = [r for r in metrics(run_dir) if r["step"] == 6 and "eval_loss" in r]  # the event row has none
    assert last["eval_loss"] < row["best_eval_loss"]  # the premise of LINE: lower, by less than 100
    best = row["best_eval_loss"]
    assert out.count("early stop at") == 1 and LINE.format(last["eval_loss"], best, best - last["eval_loss"]) in out
    assert row["reason"] == "patience"
    # the checkpoints at 5 and at the stop, and each evaluation's that had the lowest eval loss so far
    # (the best checkpoint, saved at its evaluation)
    evals = {r["step"]: r["eval_loss"] for r in metrics(run_dir) if "eval_loss" in r}
    bests = {s for s in evals if all(evals[s] < evals[t] for t in evals if t < s)}
    assert [s for s, _ in layout.step_folders(run_dir)] == sorted({5, 6} | bests)
    meta = layout.read_meta(layout.step_path(run_dir, 6))
    assert meta[early_stop.PART] == {"best": best, "best_step": 2, "since": 2, "stopped": 6, "reason": "patience"}
    assert layout.read_status(run_dir)["state"] == "finished"
    summary = metrics_cli.summary(str(run_dir))
    assert summary["early_stop"] == {"step": 6, "reason": "patience", "best_eval_loss": best, "best_step": 2}
    said = f"stopped early at step 6 (no improvement on eval_loss {best:.4f} of step 2)"
    assert said in metrics_cli._summary_line(summary)

    # A restart, even with more steps, trains nothing and writes nothing: the launcher says so before
    # any rank starts, the trainer itself too; the Slurm requeue check does not requeue it.
    before = snapshot(run_dir)
    said = "nothing to do: the run stopped early at step 6 (train.early_stop_patience=2)"
    proc = run_command(launch_command(run_dir, "train.steps=30"))
    assert proc.returncode == 0 and said in proc.stdout, proc.stdout + proc.stderr
    assert said in train(run_dir, 1, "train.steps=30").stdout
    assert snapshot(run_dir) == before
    assert requeue.requeue_check(str(run_dir), 0, 3, "7") == 0
    assert "stopped early at step 6" in capsys.readouterr().out
    assert not (run_dir / layout.REQUEUE_FILE).exists()  # returned before counting attempts or requeueing

    # A kill -9 during the final save leaves it uncommitted (its .tmp_ folder): the restart resumes
    # at step 5, one evaluation without improvement counted, and stops at step 6 again with the
    # same weights; the first start's early_stop row, after step 5, moves aside: one row.
    reference = weights(run_dir, 6)
    os.rename(layout.step_path(run_dir, 6), layout.checkpoints_dir(run_dir) + "/.tmp_step_00000006")
    out = train(run_dir, 1).stdout
    assert "resumed from" in out and "at step 5" in out and "early stop at step 6:" in out
    assert [r["step"] for r in events(run_dir, "early_stop")] == [6]
    assert_same_weights(weights(run_dir, 6), reference, exact=True)

    # Training on: early stopping off (a larger patience would do too, stops_again below).
    out = train(run_dir, 1, "train.early_stop_patience=0", "train.steps=8").stdout
    assert "finished at step 8" in out and layout.latest_committed_step(run_dir) == 8
    assert layout.early_stop_record(run_dir, layout.latest_committed_step(run_dir)) is None
    assert requeue.requeue_check(str(run_dir), 0, 3, "7") == 0  # finished: not requeued either
    assert "training finished at step 8" in capsys.readouterr().out

    # meta.json is untrusted: a state not of its kind (checksums recorded again) is one line, exit 2.
    meta_file = os.path.join(layout.step_path(run_dir, 8), "meta.json")
    meta = json.loads(open(meta_file).read())
    meta[early_stop.PART]["since"] = -1
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    rerecord(layout.step_path(run_dir, 8))
    proc = train(run_dir, 1, "train.steps=10", expect=2)
    assert "meta.json's early_stop state cannot be restored: since is -1, not a count" in proc.stderr
    assert "Traceback" not in proc.stderr and layout.latest_committed_step(run_dir) == 8
