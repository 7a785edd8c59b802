"""The system tier of tests/unit/test_pp.py, whose docstring says what both halves test.

Runs of the tiny transformer with 4 blocks, shared by the tests: pp=1 on one rank (`ref`), pp=2 x dp=1
with GPipe (a stage of 2 blocks a rank), pp=2 x dp=2 with 1F1B and gradient accumulation (3 pipeline
micro-batches of 1 sample x 2 accumulation steps per rank), pp=2 x tp=2 x dp=2 with interleaved 1F1B
(8 processes, 2 stages of one block a rank), pp=2 with the two zero-bubble schedules (interleaved; ZBV at
pp=2 x tp=2: 2 stages a rank in a V, rank 0 holding the embedding and the head), and two resumed at
another layout."""

import pytest
import torch

from tests.helpers.outputs import (
    assert_same_hf_folders,
    assert_same_losses,
    assert_same_weights,
    losses,
    metrics,
    rows,
    weights,
)
from tests.helpers.run import TINY, export_hf, train
from trainer.parallel.pp import ZBV_TORCH, _torch_before

# 4 steps at a constant learning rate, a checkpoint and an evaluation every 2 (all kept); gradients
# clipped to a norm of 0.5, below every step's (0.86 to 1.28): the norm must be every stage's.
RUN = [*TINY, "model.n_layers=4", "train.steps=4", "optim.schedule=constant", "checkpoint.interval=2"]
RUN += ["checkpoint.keep=0", "eval.interval=2", "train.grad_clip=0.5"]
# Resuming at another layout with this learning rate leaves every weight as loaded (an update of
# 1e-30 is below a float32 weight's last bit): the step's checkpoint holds the loaded weights.
FROZEN = "optim.lr=1e-30"
# the runs against pp=1's: name -> (processes, the layout)
LAYOUTS = {
    "gpipe": (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    "1f1b": (
        4,
        ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batch_size=1", "parallel.pp_microbatches=3"],
    ),
    # hybrid sharding (HSDP) inside each stage: groups of 1 rank, dp_replicate=2
    "interleaved_1f1b": (
        8,
        ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=interleaved_1f1b"]
        + ["parallel.sharding=hybrid", "parallel.shard_size=1"],
    ),
    "interleaved_zb": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_zb"]),
}
ZBV = (4, ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=zbv"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done = {"ref": tmp_path_factory.mktemp("pp1")}
    train(done["ref"], 1, *RUN)
    for name, (nproc, layout) in LAYOUTS.items():
        done[name] = tmp_path_factory.mktemp(name)
        out = train(done[name], nproc, *RUN, *layout).stdout
        if name == "1f1b":
            assert "pipeline schedule 1f1b, 1 samples x 3 pipeline micro-batches x 2 micro-batches per rank" in out
        if name == "interleaved_1f1b":  # rank 0 holds stages 0 and 2 of pp x 2
            assert (
                "on stages 0, 2 of 4) on 8 x cpu, strategy fsdp (hybrid: 2 replicas of 1-rank shards), pipeline "
                "schedule interleaved_1f1b" in out
            )
    return done


@pytest.fixture(scope="module")
def zbv_run(tmp_path_factory):
    if _torch_before(2, 14):
        pytest.skip(ZBV_TORCH.format(torch.__version__))
    run_dir = tmp_path_factory.mktemp("zbv")
    out = train(run_dir, ZBV[0], *RUN, *ZBV[1]).stdout
    assert "on stages 0, 3 of 4) on 4 x cpu" in out  # the V: the first and the last stage
    return run_dir


def _grad_norms(run_dir) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in rows(run_dir)}


def _evals(run_dir) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in metrics(run_dir) if "eval_loss" in r}


def _assert_as_pp1(run, ref, world_size: int, same_evals: bool = True) -> None:
    """Each step's loss and gradient norm (over every stage) within float tolerance (relative 1e-5), the
    evaluations' too where they read the same samples (`same_evals`: 12 a batch), the final weights
    within 1e-4."""
    assert_same_losses(losses(run), losses(ref), rtol=1e-5)
    assert_same_losses(_grad_norms(run), _grad_norms(ref), rtol=1e-5)
    assert sorted(_evals(run)) == [2, 4]
    if same_evals:
        assert_same_losses(_evals(run), _evals(ref), rtol=1e-5)
    assert_same_weights(weights(run), weights(ref))
    assert {r["world_size"] for r in rows(run)} == {world_size}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(LAYOUTS))
def test_each_schedule_gives_pp1_s_losses_gradient_norms_evaluations_and_weights(runs, schedule):
    """pp=2 under each schedule against pp=1 on the same global batch: GPipe (dp=1), 1F1B (dp=2,
    accumulated), interleaved 1F1B (tp=2 x dp=2, 2 stages a rank), interleaved zero bubble (dp=1)."""
    # 1F1B's forward is 3 micro-batches of 1 sample: its evaluation batches are 2 x 3 samples, not 12
    _assert_as_pp1(runs[schedule], runs["ref"], LAYOUTS[schedule][0], same_evals=schedule != "1f1b")


@pytest.mark.slow
def test_zbv_gives_pp1_s_losses_gradient_norms_evaluations_and_weights(runs, zbv_run):
    """ZBV (pp=2 x tp=2, 2 stages a rank in a V: rank 0 computes the loss and the evaluation, which
    goes through the stages in order): as pp=1. Its split backward detaches a stage's output in place:
    under tp a copy of the local shard, not to_local's view, which torch refuses."""
    _assert_as_pp1(zbv_run, runs["ref"], ZBV[0])


@pytest.mark.slow
def test_checkpoints_load_between_pp2_and_pp1_with_equal_weights(tmp_path, runs):
    """pp=2 x tp=2 x dp=2's step-2 checkpoint (interleaved 1F1B: 2 stages a rank) resumed with pp=1 on 3
    ranks, and pp=1's with pp=2 x dp=1 (1F1B, bfloat16 compute, full activation checkpointing): each takes
    one step that changes nothing (FROZEN) and saves: its weights are exactly the source's (FSDP keeps
    them float32), and its step-3 loss and gradient norm are the source run's, computed on the same
    weights (within 1e-5; bfloat16's within 1e-2). The Hugging Face export of the 3D checkpoint is the
    folder the 1D one of the same weights gives (every tensor equal)."""
    pp2 = ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.param_dtype=bfloat16"]
    for source, name, nproc, layout, rtol in (
        (runs["interleaved_1f1b"], "to_pp1", 3, [], 1e-5),
        (runs["ref"], "to_pp2", 2, [*pp2, "parallel.activation_checkpointing=full"], 1e-2),
    ):
        run = tmp_path / name
        at = f"checkpoint.resume_from={source}/checkpoints/step_00000002"
        out = train(run, nproc, *RUN, *layout, FROZEN, "train.steps=3", "eval.interval=0", at).stdout
        assert "resumed from" in out and "at step 2" in out
        assert_same_weights(weights(run), weights(source, 2), exact=True)
        assert_same_losses(losses(run), {3: losses(source)[3]}, rtol=rtol)
        assert_same_losses(_grad_norms(run), {3: _grad_norms(source)[3]}, rtol=rtol)
    export_hf(runs["interleaved_1f1b"], tmp_path / "hf3d", "--step", "2")
    export_hf(tmp_path / "to_pp1", tmp_path / "hf1d")
    assert_same_hf_folders(tmp_path / "hf3d", tmp_path / "hf1d")
