"""Early stopping on the eval loss (train.early_stop_patience): the stop, its record in the
checkpoint, a resume that stops at the same step, a restart with nothing to do (trainer/early_stop.py)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import TINY, assert_same_weights, launch_command, metrics, refused, rerecord, run_command, train, weights
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


def test_a_larger_patience_or_none_undoes_the_stop():
    record = {"best": 1.0, "best_step": 2, "since": 2, "stopped": 6}
    assert early_stop.stops_again(record, 2) and early_stop.stops_again(record, 1)
    assert not early_stop.stops_again(record, 3) and not early_stop.stops_again(record, 0)
    assert not early_stop.stops_again(record, None)
    state = early_stop.EarlyStop(3, 0.0)
    state.load_state_dict(record)
    assert state.stopped is None and state.reason is None  # trains on: one more evaluation without an improvement
    assert state.update(8, 1.5) == (
        "early stop at step 8: eval loss 1.5000 is not below the best, 1.0000 at step 2; 3 evaluations in a row "
        "without an improvement (train.early_stop_patience=3)"
    )
    assert state.state_dict() == {"best": 1.0, "best_step": 2, "since": 3, "stopped": 8, "reason": "patience"}


@pytest.mark.parametrize("bad", [None, {"best": "x", "best_step": 2, "since": 2, "stopped": 6}, {"since": -1}])
def test_a_saved_state_not_of_its_kind_is_refused(bad):
    assert early_stop.EarlyStop(2, 0.0).problem(bad) == early_stop.state_problem(bad) is not None
    assert not early_stop.stops_again(bad, 2)


def test_a_saved_state_is_checked_once_at_a_load(monkeypatch):
    """The checkpoint's load asks the part's problem() and then restores it (trainer/checkpoint/manager.py):
    one check of the state, not a second one inside load_state_dict."""
    checks = []
    real = early_stop.state_problem
    monkeypatch.setattr(early_stop, "state_problem", lambda state: checks.append(state) or real(state))
    record = {"best": 1.0, "best_step": 2, "since": 2, "stopped": 6, "reason": "patience"}
    part = early_stop.EarlyStop(2, 0.0)
    assert part.problem(record) is None
    part.load_state_dict(record)
    assert part.stopped == 6 and part.reason == "patience"
    assert len(checks) == 1


def test_early_stopping_without_evaluation_is_refused(capsys, tmp_path):
    line = refused(capsys, tmp_path / "run", "train.early_stop_patience=3")
    assert line == (
        "error: override 'train.early_stop_patience=3': train.early_stop_patience: is 3, but eval.interval is 0: "
        "no evaluation gives a loss to stop on; set eval.interval (steps between evaluations) or "
        "train.early_stop_patience=0"
    )


def test_patience_counts_evaluations_without_an_improvement_by_min_delta():
    state = early_stop.EarlyStop(2, 0.1)
    assert state.update(2, 3.0) is None  # the first is the best
    assert state.update(4, 2.95) is None and state.since == 1  # lower, but not by more than 0.1
    assert state.update(6, 2.8) is None and state.since == 0 and state.best_step == 6
    assert state.update(8, 2.9) is None
    line = state.update(10, 2.75)
    assert line == (
        "early stop at step 10: eval loss 2.7500 improved on the best, 2.8000 at step 6, by 0.05 only; 2 evaluations "
        "in a row without an improvement by more than train.early_stop_min_delta=0.1 (train.early_stop_patience=2)"
    )
    assert state.stopped == 10


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_loss_that_is_not_finite_stops_at_once(loss):
    """Lightning's check_finite: a NaN (or infinite) eval loss stopped nothing, counted as one more
    evaluation without an improvement; the run trained on until patience ran out, or to its end."""
    state = early_stop.EarlyStop(3, 0.0)
    assert state.update(2, 3.0) is None
    assert state.update(4, loss) == (
        f"early stop at step 4: eval loss {loss} is not finite; the run stops at once (the best was 3.0000 at step "
        f"2); lower optim.lr or look at the evaluation data, then restart with train.early_stop_patience=0 to train on"
    )
    record = state.state_dict()
    assert record == {"best": 3.0, "best_step": 2, "since": 0, "stopped": 4, "reason": "not_finite"}
    # a restart stays stopped whatever the patience (no later evaluation mends it) unless it is off
    assert early_stop.stops_again(record, 3) and early_stop.stops_again(record, 100)
    assert not early_stop.stops_again(record, 0)
    assert early_stop.nothing_to_do(4, 100, early_stop.reason_of(record)) == (  # the launcher's line, the trainer's
        "nothing to do: the run stopped early at step 4, whose eval loss was not finite "
        "(train.early_stop_patience=100); to train on, restart with train.early_stop_patience=0"
    )
    again = early_stop.EarlyStop(100, 0.0)
    again.load_state_dict(record)
    assert again.stopped == 4 and again.reason == "not_finite"
    off = early_stop.EarlyStop(0, 0.0)
    off.load_state_dict(record)
    assert off.stopped is None and off.update(6, loss) is None  # early stopping off: no check either


def test_a_record_saved_before_reasons_is_a_stop_by_patience():
    old = {"best": 1.0, "best_step": 2, "since": 2, "stopped": 6}
    assert early_stop.state_problem(old) is None and early_stop.reason_of(old) == "patience"
    assert early_stop.stops_again(old, 2) and not early_stop.stops_again(old, 3)
    for bad in ({**old, "reason": "bored"}, {**old, "reason": None}, {**old, "stopped": None, "reason": "patience"}):
        assert early_stop.state_problem(bad).startswith("reason is"), bad
