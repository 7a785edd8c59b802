"""A run dir remembers its run: its config.yaml is the base of every later start."""

from __future__ import annotations

import pytest

from tests.helpers.run import ROOT, TINY, python, train

pytestmark = pytest.mark.slow  # trains and restarts a run


def test_a_restart_keeps_the_runs_overrides_and_says_what_differs(tmp_path):
    """The report: a run started with model.dim=32, continued with only train.steps=10, was refused
    with a shape mismatch: the second start took the file's model.dim, not the run's."""
    run = tmp_path / "r"
    train(run, 1, *TINY, "model.dim=32", "optim.lr=0.002")
    out = train(run, 1, *TINY, "train.steps=10").stdout
    assert (
        f"{run}: continuing the run saved in {run / 'config.yaml'}, changed on the command line: train.steps 6 -> 10"
        in out
    )
    saved = (run / "config.yaml").read_text()
    assert "dim: 32" in saved and "lr: 0.002" in saved and "steps: 10" in saved

    # A config file that sets another value does not silently win or lose: one line names it.
    other = tmp_path / "other.yaml"
    other.write_text((ROOT / "configs" / "default.yaml").read_text().replace("lr: 3.0e-3", "lr: 0.01"))
    assert "lr: 0.01" in other.read_text()
    check = python(
        "-m", "trainer.check", "--config", str(other), f"run_dir={run}", *TINY, "train.steps=10", timeout=120
    )
    assert check.returncode == 0, check.stderr
    assert (
        f"{other} differs from the run saved in {run / 'config.yaml'} in optim.lr (0.01; the run has 0.002): the "
        f"run's values are used; to change one, give key=value on the command line"
    ) in check.stdout

    # A change the checkpoint cannot take is still refused, naming both shapes.
    proc = train(run, 1, *TINY, "train.steps=12", "model.dim=48", expect=2)
    assert "has shape [32, 32] but the model has [48, 48]" in proc.stderr
