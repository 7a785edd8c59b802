"""The system tier of tests/unit/test_pp.py, whose docstring says what both halves test.

Five runs of the tiny transformer (2 blocks: one a stage), shared by the tests: pp=1 on one rank
(`ref`), pp=2 x dp=1 with GPipe, pp=2 x dp=2 with 1F1B and gradient accumulation (3 pipeline
micro-batches of 1 sample x 2 accumulation steps per rank), and two resumed at another layout."""

import pytest

from tests.helpers.outputs import assert_same_losses, assert_same_weights, losses, metrics, rows, weights
from tests.helpers.run import TINY, train

# 4 steps at a constant learning rate, a checkpoint and an evaluation every 2 (all kept); gradients
# clipped to a norm of 0.5, below every step's (0.74 to 0.84): the norm must be every stage's.
RUN = [*TINY, "train.steps=4", "optim.schedule=constant", "checkpoint.interval=2", "checkpoint.keep=0"]
RUN += ["eval.interval=2", "train.grad_clip=0.5"]
# Resuming at another layout with this learning rate leaves every weight as loaded (an update of
# 1e-30 is below a float32 weight's last bit): the step's checkpoint holds the loaded weights.
FROZEN = "optim.lr=1e-30"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ref, gpipe, onef1b = (tmp_path_factory.mktemp(name) for name in ("pp1", "pp2_gpipe", "pp2x2_1f1b"))
    train(ref, 1, *RUN)
    out = train(gpipe, 2, *RUN, "parallel.pp=2", "parallel.pp_schedule=gpipe").stdout
    assert "on 2 x cpu, strategy fsdp, pipeline schedule gpipe, 6 samples x 2 pipeline micro-batches x 1 " in out
    accumulated = ["train.micro_batch_size=1", "parallel.pp_microbatches=3"]
    out = train(onef1b, 4, *RUN, "parallel.pp=2", "parallel.pp_schedule=1f1b", *accumulated).stdout
    assert "pipeline schedule 1f1b, 1 samples x 3 pipeline micro-batches x 2 micro-batches per rank" in out
    return ref, gpipe, onef1b


def _grad_norms(run_dir) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in rows(run_dir)}


@pytest.mark.slow
def test_pp2_gives_pp1_s_losses_gradient_norms_evaluations_and_weights(runs):
    """pp=2 x dp=1 (GPipe) and pp=2 x dp=2 (1F1B, accumulated) against pp=1 on the same global batch:
    each step's loss and gradient norm (over both stages) within float tolerance (relative 1e-5), the
    final weights within 1e-4; GPipe's evaluations too (the same evaluation samples: 12 a batch)."""
    ref, gpipe, onef1b = runs
    for run in (gpipe, onef1b):
        assert_same_losses(losses(run), losses(ref), rtol=1e-5)
        assert_same_losses(_grad_norms(run), _grad_norms(ref), rtol=1e-5)
        assert_same_weights(weights(run), weights(ref))
        assert {r["world_size"] for r in rows(run)} == ({2} if run == gpipe else {4})
    evals = [{r["step"]: r["eval_loss"] for r in metrics(d) if "eval_loss" in r} for d in (gpipe, ref)]
    assert sorted(evals[0]) == [2, 4]
    assert_same_losses(*evals, rtol=1e-5)


@pytest.mark.slow
def test_checkpoints_load_between_pp2_and_pp1_with_equal_weights(tmp_path, runs):
    """pp=2 x dp=2's step-2 checkpoint resumed with pp=1 on 3 ranks, and pp=1's with pp=2 x dp=1 (1F1B,
    bfloat16 compute, full activation checkpointing): each takes one step that changes nothing
    (FROZEN) and saves: its weights are exactly the source's (FSDP keeps them float32), and its step-3
    loss and gradient norm are the source run's, computed on the same weights (within 1e-5;
    bfloat16's within 1e-2)."""
    ref, _, onef1b = runs
    pp2 = ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.param_dtype=bfloat16"]
    for source, name, nproc, layout, rtol in (
        (onef1b, "to_pp1", 3, [], 1e-5),
        (ref, "to_pp2", 2, [*pp2, "parallel.activation_checkpointing=full"], 1e-2),
    ):
        run = tmp_path / name
        at = f"checkpoint.resume_from={source}/checkpoints/step_00000002"
        out = train(run, nproc, *RUN, *layout, FROZEN, "train.steps=3", "eval.interval=0", at).stdout
        assert "resumed from" in out and "at step 2" in out
        assert_same_weights(weights(run), weights(source, 2), exact=True)
        assert_same_losses(losses(run), {3: losses(source)[3]}, rtol=rtol)
        assert_same_losses(_grad_norms(run), {3: _grad_norms(source)[3]}, rtol=rtol)
