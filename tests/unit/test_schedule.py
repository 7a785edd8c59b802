"""The lr schedule across a resume that raises train.steps: said in one line, and keepable."""

from __future__ import annotations

import pytest

from trainer.optim import OptimArgs, lr_factor, schedule_change, schedule_warning


def test_decay_steps_ends_the_cosine_there_and_holds_the_floor():
    args = OptimArgs(warmup_steps=2, decay_steps=6, min_lr_ratio=0.1)
    assert lr_factor(args, 100, 5) > 0.1
    assert [lr_factor(args, 100, s) for s in (6, 7, 50)] == pytest.approx([0.1, 0.1, 0.1])
    # without it the horizon is train.steps, as before
    assert lr_factor(OptimArgs(warmup_steps=2), 10, 6) == lr_factor(OptimArgs(warmup_steps=2, decay_steps=10), 80, 6)


def test_a_schedule_that_is_unchanged_says_nothing():
    saved = {"train": {"steps": 50}, "optim": {"schedule": "warmup_cosine", "warmup_steps": 2, "decay_steps": None}}
    assert schedule_change(saved, OptimArgs(warmup_steps=2), 50, 50) is None


def test_a_run_that_ends_inside_the_warmup_warns():
    assert "ends inside the warm-up" in schedule_warning(OptimArgs(warmup_steps=20), 6)
    assert schedule_warning(OptimArgs(warmup_steps=2), 6) is None
    assert schedule_warning(OptimArgs(schedule="constant", warmup_steps=20), 6) is None
