"""The system tier of tests/unit/test_schedule.py, whose docstring says what both halves test."""

from __future__ import annotations

import pytest

from tests.helpers.outputs import rows
from tests.helpers.run import TINY, train


@pytest.mark.slow
def test_raising_train_steps_says_what_happens_to_the_lr_and_decay_steps_keeps_the_horizon(tmp_path):
    """The report: a cosine run that ended at step 6 at its minimum lr jumped back up when continued
    to 10, without a word. Now a resume says so, and optim.decay_steps=6 keeps the floor."""
    first = [*TINY, "optim.schedule=warmup_cosine"]
    train(tmp_path / "a", 1, *first)
    ended = rows(tmp_path / "a")[-1]["lr"]
    out = train(tmp_path / "a", 1, *first, "train.steps=10").stdout
    line = next((line for line in out.splitlines() if "the lr schedule changed" in line), None)
    assert line is not None, out
    assert "train.steps 6 -> 10" in line and "set optim.decay_steps=6" in line
    continued = [r["lr"] for r in rows(tmp_path / "a") if r["step"] > 6]
    assert max(continued) > ended * 1.5  # what the line warns of: the decay was stretched

    train(tmp_path / "b", 1, *first)
    out = train(tmp_path / "b", 1, *first, "train.steps=10", "optim.decay_steps=6").stdout
    assert "the lr schedule changed (the decay's end 6 -> 6" not in out
    floor = 3e-3 * 0.1
    assert [r["lr"] for r in rows(tmp_path / "b") if r["step"] > 6] == pytest.approx([floor] * 4)
