"""The system tier of tests/unit/test_plan.py, whose docstring says what both halves test."""

from __future__ import annotations

import pytest

from tests.helpers.outputs import assert_same_losses, assert_same_weights, losses, rows, weights
from tests.helpers.run import TINY, train


@pytest.mark.slow
def test_two_ranks_through_the_plan_train_as_one_process(tmp_path):
    """FSDP on 2 gloo ranks, each accumulating 2 micro-batches of 3 (the plan's no_sync), with two
    evaluations, gives the losses, evaluation losses and weights of plain one-process training on
    the same global batch, 2 micro-batches of 6 (test_parallel.py's equality, through the plan's dp
    rank and size; an evaluation batch is micro x dp size samples: 6 in both)."""
    run = [*TINY, "eval.interval=3", "eval.batches=2"]
    train(tmp_path / "one", 1, *run, "parallel.strategy=none", "train.micro_batch_size=6")  # the same eval samples
    train(tmp_path / "two", 2, *run, "train.micro_batch_size=3")
    assert_same_losses(losses(tmp_path / "two"), losses(tmp_path / "one"))
    assert_same_weights(weights(tmp_path / "two"), weights(tmp_path / "one"))
    assert {r["world_size"] for r in rows(tmp_path / "two")} == {2}
    evals = [_evals(tmp_path / name) for name in ("one", "two")]
    assert evals[0].keys() == evals[1].keys() == {3, 6}
    assert all(abs(evals[0][s] - evals[1][s]) <= 1e-5 * evals[0][s] for s in evals[0]), evals


def _evals(run_dir) -> dict[int, float]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["eval_loss"] for r in map(json.loads, lines) if "eval_loss" in r}
