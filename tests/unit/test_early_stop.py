"""Early stopping on the eval loss (train.early_stop_patience): the stop, its record in the
checkpoint, a resume that stops at the same step, a restart with nothing to do (trainer/early_stop.py)."""

from __future__ import annotations

import pytest

from tests.helpers.bad_input import refused
from trainer import early_stop


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
