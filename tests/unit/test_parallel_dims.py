"""Parallelism from named degrees (issue #43 item 3, torchtitan's ParallelDims): each config gives
its degrees dp_replicate, dp_shard, cp, tp, pp and the mesh they build (shape and dimension names,
the meshes the plan made before the degrees); what is not built is refused with one line; one
micro-batch's forward and backward go through one seam of the plan, to the bit what the loop did.
In one process, without a process group."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.helpers.run import ROOT
from trainer import models, train
from trainer.config import ConfigError, ParallelArgs, load, resolve
from trainer.parallel.dims import ParallelDims
from trainer.parallel.plan import Plan


@pytest.mark.parametrize(
    "args, world, per_node, degrees, shape, names",
    [
        # FSDP over every rank: one dimension, "dp_shard", even on one rank
        (ParallelArgs(), 4, None, (1, 4, 1, 1, 1), (4,), ("dp_shard",)),
        (ParallelArgs(), 1, None, (1, 1, 1, 1, 1), (1,), ("dp_shard",)),
        (ParallelArgs(sharding="grad_op"), 3, None, (1, 3, 1, 1, 1), (3,), ("dp_shard",)),
        # hybrid: groups of shard_size, replicated across them; 2-D even with one group (HSDP's mesh)
        (ParallelArgs(sharding="hybrid", shard_size=2), 4, None, (2, 2, 1, 1, 1), (2, 2), ("dp_replicate", "dp_shard")),
        (ParallelArgs(sharding="hybrid"), 8, 4, (2, 4, 1, 1, 1), (2, 4), ("dp_replicate", "dp_shard")),
        (ParallelArgs(sharding="hybrid"), 4, 4, (1, 4, 1, 1, 1), (1, 4), ("dp_replicate", "dp_shard")),
        # DDP and plain training replicate the whole model
        (ParallelArgs(strategy="ddp"), 2, None, (2, 1, 1, 1, 1), (2,), ("dp_replicate",)),
        (ParallelArgs(strategy="none"), 1, None, (1, 1, 1, 1, 1), (1,), ("dp_replicate",)),
        # tensor parallelism innermost: a tp group's ranks are consecutive
        (ParallelArgs(tp=2), 8, 8, (1, 4, 1, 2, 1), (4, 2), ("dp_shard", "tp")),
        (ParallelArgs(tp=4), 4, 4, (1, 1, 1, 4, 1), (1, 4), ("dp_shard", "tp")),
        # pipeline stages outermost: pp x dp_shard
        (ParallelArgs(pp=2), 4, None, (1, 2, 1, 1, 2), (2, 2), ("pp", "dp_shard")),
        (ParallelArgs(pp=2), 2, None, (1, 1, 1, 1, 2), (2, 1), ("pp", "dp_shard")),
    ],
    ids=[
        "fsdp4",
        "fsdp1",
        "grad_op3",
        "hybrid2x2",
        "hybrid-node",
        "hybrid-one-group",
        "ddp2",
        "none1",
        "tp2x4",
        "tp4",
        "pp2x2",
        "pp2",
    ],
)
def test_each_config_gives_its_degrees_and_mesh(args, world, per_node, degrees, shape, names):
    dims = ParallelDims.of(args, world, per_node)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp) == degrees
    assert dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp * dims.pp == world
    assert dims.mesh_dims() == (shape, names)
    assert dims.dp_dims() == tuple(n for n in names if n not in ("tp", "pp"))
    assert dims.dp_size == world // args.tp // args.pp
    plan = Plan(args, world, ranks_per_node=per_node)
    assert plan.dims == dims  # the plan's degrees are these, derived once
    assert (plan.dp_replicate, plan.dp_shard, plan.tp, plan.dp_size) == (*degrees[:2], degrees[3], dims.dp_size)


def test_the_degrees_come_from_the_config_and_the_world_once():
    cfg = load(None, ["parallel.sharding=hybrid", "parallel.shard_size=2"])
    plan = Plan(cfg.parallel, 8)
    assert plan.dims is plan.dims  # derived once, not per question
    assert plan.dims.mesh_dims() == ((4, 2), ("dp_replicate", "dp_shard"))


def test_a_data_parallel_rank_skips_the_tensor_parallel_ranks():
    """tp innermost: ranks 0-1 are data-parallel rank 0, 2-3 rank 1, ... (with context parallelism,
    its ranks too; a pipeline stage, outermost, holds every data-parallel rank once)."""
    dims = ParallelDims.of(ParallelArgs(tp=2), 8, 8)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.dp_rank(r) for r in range(8)] == [Plan(ParallelArgs(tp=2), 8, r).dp_rank for r in range(8)]
    staged = ParallelDims(8, dp_shard=2, cp=2, pp=2)
    assert [staged.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert staged.dp_size == 2 and staged.mesh_dims() == ((2, 2, 2), ("pp", "dp_shard", "cp"))


def test_a_context_degree_is_planned_with_its_layout_checks():
    """parallel.cp: cp x tp x pp divides the world, the sequence splits into 2 x cp chunks (the
    head-tail load balance), FSDP only; the data-parallel ranks are the world over cp x tp x pp."""
    dims = ParallelDims.of(ParallelArgs(cp=2, tp=2), 16, 8)
    assert (dims.dp_shard, dims.cp, dims.tp, dims.dp_size) == (4, 2, 2, 4)
    assert dims.mesh_dims() == ((4, 2, 2), ("dp_shard", "cp", "tp"))
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.problems(8192) == []
    lines = [f"{k}: {m}" for k, m in ParallelDims(12, dp_shard=1, cp=4, tp=2).problems(60, "ddp")]
    assert lines == [
        "parallel.cp: is 4 but needs parallel.strategy=fsdp (it is ddp); set cp=1",
        "parallel.cp: cp=4 x tp=2 does not divide the 12 processes; choose a divisor",
        "parallel.cp: is 4 but model.seq_len 60 does not split into 2 x cp = 8 equal chunks (each rank takes two, "
        "one from each end, so causal attention's work is even); use a seq_len that is a multiple of 8",
    ]
    assert ParallelDims.of(ParallelArgs(), 4).problems(7) == []
    assert ParallelDims(4, dp_shard=2, pp=2).problems() == []  # parallel.pp: tests/unit/test_pp.py


def test_a_start_refuses_a_context_degree_in_one_line_and_make_check_plans_it(capsys, tmp_path):
    """Every start (here the Python API's target, as the launcher's and a rank's) refuses cp > 1 before
    anything is written; trainer.check plans it: the batch over cp's ranks, the activations 1/cp."""
    from trainer.preflight import check, startup

    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        startup.preflight(startup.Target.api(4), None, [f"run_dir={run_dir}", "parallel.cp=2"])
    assert str(e.value) == (
        "override 'parallel.cp=2': parallel.cp: is 2 but context parallelism is planned, not built: make check "
        "estimates it, no start runs it (torch 2.14's context_parallel rings only the CUDA attention kernels, "
        "flash, efficient and cuDNN, so nothing of it runs or is tested on CPU ranks here); set parallel.cp=1"
    )
    assert not run_dir.exists()
    dry = startup.preflight(startup.Target.slurm(2, 2, planning=True), None, [f"run_dir={run_dir}", "parallel.cp=2"])
    assert dry.cfg.parallel.cp == 2  # a dry run plans it
    config = str(ROOT / "configs" / "default.yaml")
    assert check.main(["--config", config, "--nproc", "4", f"run_dir={run_dir}", "parallel.cp=2"]) == 0
    out = capsys.readouterr().out
    assert "batch: global 32 / 2 data-parallel ranks (NPROC=4 x NODES=1 / parallel.cp=2) / micro-batch 16" in out
    assert "(sharded over 2 x cp 2 ranks)" in out and "cp 2 (1/2 of the sequence, and " in out


def test_the_plans_refusals_are_unchanged_and_the_degrees_add_none_to_a_good_config():
    assert Plan(ParallelArgs(sharding="hybrid", shard_size=3), 4).problems() == [
        ("parallel.shard_size", "3 does not divide the 4 processes; choose a divisor")
    ]
    assert Plan(ParallelArgs(tp=2), 8, ranks_per_node=8).problems() == []


# -- the seam: one micro-batch's forward and backward -------------------------------------------------


def _step(cfg, through_plan: bool, accum: int, grad_scale: int):
    """The tiny transformer's loss and gradients after `accum` micro-batches, each run through
    Plan.forward_backward or as the loop wrote it before the seam."""
    family = models.spec(cfg.model)
    plan = Plan(cfg.parallel, 1)
    model = train.build_model(cfg, None, plan)
    compute_dtype = plan.autocast_dtype(model)
    data = torch.Generator().manual_seed(1)
    losses = []
    for i in range(accum):
        x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=data)
        if through_plan:
            loss = plan.forward_backward(
                model, x, x, family.loss, micro=i, accum=accum, compute_dtype=compute_dtype, grad_scale=grad_scale
            )
        else:
            with plan.grad_sync(model, i, accum), plan.loss_parallel():
                with plan.autocast(compute_dtype):
                    loss = family.loss(model(x), x) / accum
                (loss * grad_scale if grad_scale != 1 else loss).backward()
        losses.append(loss.detach())
    return losses, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "overrides, accum, grad_scale",
    [
        ([], 1, 1),
        ([], 2, 1),
        (["parallel.param_dtype=bfloat16"], 2, 1),  # under autocast
        ([], 2, 2 * 32 * 2),  # train.loss_reduction=sum: the gradient of the sum over the tokens
    ],
    ids=["one", "accumulated", "bf16-autocast", "sum"],
)
def test_forward_backward_gives_the_loop_s_loss_and_gradients_to_the_bit(overrides, accum, grad_scale):
    cfg = resolve(load(None, ["model.seq_len=32", "parallel.strategy=none", *overrides]))
    want_losses, want_grads = _step(cfg, False, accum, grad_scale)
    got_losses, got_grads = _step(cfg, True, accum, grad_scale)
    assert all(torch.equal(a, b) for a, b in zip(got_losses, want_losses))
    assert want_grads.keys() == got_grads.keys()
    for name, grad in got_grads.items():
        assert torch.equal(grad, want_grads[name]), name


def test_the_loop_runs_a_micro_batch_through_the_plan_s_one_seam():
    """_train calls neither the model nor backward itself: pipeline parallelism replaces one call."""
    source = inspect.getsource(train._train)
    assert source.count("plan.forward_backward(") == 1
    assert "model(x)" not in source and ".backward()" not in source
