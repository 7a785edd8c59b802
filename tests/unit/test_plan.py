"""The parallel plan (trainer.parallel.plan.Plan, issue #34 item 1): one object knows the strategy, the
data-parallel rank and size, and what one rank holds. Its arithmetic is checked for a world of 4 in
this one process (no process group: the mesh is made on first use only); one 2-process gloo run
shows training through the plan equal to plain one-process training."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers.run import ROOT, env
from trainer import models
from trainer.config import ConfigError, load
from trainer.parallel import plan as parallel
from trainer.parallel.plan import Plan
from trainer.preflight import check, memory
from trainer.train import batch_plan


def plan(*overrides: str, world: int = 4, rank: int = 0, ranks_per_node: int | None = None) -> Plan:
    return Plan(load(None, list(overrides)).parallel, world, rank, ranks_per_node)


# -- checks: each refusal is one line, the same from the config check and from the plan ------------


@pytest.mark.parametrize(
    "overrides, world, line",
    [
        (
            ["parallel.strategy=ddp", "parallel.cpu_offload=true"],
            2,
            "config: parallel.cpu_offload: needs parallel.strategy=fsdp (it is ddp)",
        ),
        (
            ["parallel.sharding=hybrid", "parallel.shard_size=3"],
            4,
            "config: parallel.shard_size: 3 does not divide the 4 processes; choose a divisor",
        ),
        (
            ["parallel.strategy=none"],
            2,
            "config: parallel.strategy: is 'none' but 2 processes run; use fsdp or ddp",
        ),
    ],
    ids=["offload-without-fsdp", "shard-size-not-a-divisor", "none-on-two"],
)
def test_each_refusal_is_one_line_from_the_plan_and_from_the_config_check(tmp_path, overrides, world, line):
    cfg = load(None, [*overrides, f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as from_plan:
        Plan(cfg.parallel, world).check()
    with pytest.raises(ConfigError) as from_check:
        check.validate(cfg, world)
    assert str(from_plan.value) == str(from_check.value) == line


def test_a_good_plan_has_no_problems_and_an_override_is_blamed(tmp_path):
    assert plan(world=4).problems() == []
    assert plan("parallel.sharding=hybrid", "parallel.shard_size=2").problems() == []
    assert plan("parallel.strategy=none", world=1).problems() == []
    override = "parallel.shard_size=3"
    cfg = load(None, ["parallel.sharding=hybrid", override, f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=rf"^override '{override}': parallel.shard_size: 3 does not divide"):
        check.validate(cfg, 4, overrides=[override])


def test_hybrids_default_group_is_a_node(monkeypatch):
    """Without parallel.shard_size a shard group is one node's ranks: the trainer's (ranks_per_node),
    else LOCAL_WORLD_SIZE (the config check under torchrun), else the whole world."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert plan("parallel.sharding=hybrid", world=6).dp_shard == 6
    assert plan("parallel.sharding=hybrid", world=6, ranks_per_node=3).dp_shard == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert plan("parallel.sharding=hybrid", world=6).problems() == [
        ("parallel.shard_size", "4 does not divide the 6 processes; choose a divisor")
    ]


# -- dimensions of a world of 4 --------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, replicate, shard",
    [
        ([], 1, 4),
        (["parallel.sharding=grad_op"], 1, 4),
        (["parallel.sharding=hybrid", "parallel.shard_size=2"], 2, 2),
        (["parallel.strategy=ddp"], 4, 1),
    ],
    ids=["fsdp", "grad_op", "hybrid2x2", "ddp"],
)
def test_every_rank_of_four_is_a_data_parallel_rank(overrides, replicate, shard):
    """tp is 1: the data-parallel size is the world, each rank its own data-parallel rank, and the
    world is dp_replicate x dp_shard."""
    for rank in range(4):
        p = plan(*overrides, rank=rank)
        assert (p.dp_replicate, p.dp_shard, p.dp_size, p.dp_rank, p.tp) == (replicate, shard, 4, rank, 1)
    assert "mesh" not in vars(plan(*overrides))  # nothing made yet: the mesh needs a process group


def test_the_global_batch_divides_over_the_plans_data_parallel_ranks():
    cfg = load(None, ["train.global_batch_size=24", "train.micro_batch_size=2"])
    assert batch_plan(cfg, Plan(cfg.parallel, 4).dp_size) == (2, 3)
    assert batch_plan(cfg, Plan(cfg.parallel, 1).dp_size) == (2, 12)


def test_the_memory_estimate_reads_the_plans_factors():
    """What one rank holds comes from the plan: sharded over all 4 (fsdp), over a group of 2
    (hybrid), or not at all with a second copy of the gradients (ddp)."""
    fsdp, hybrid = plan().memory_factors(), plan("parallel.sharding=hybrid", "parallel.shard_size=2").memory_factors()
    ddp, one = plan("parallel.strategy=ddp").memory_factors(), plan("parallel.strategy=ddp", world=1).memory_factors()
    assert (fsdp.shards, fsdp.gathers, fsdp.bucket_copy, fsdp.finer_with_nodes) == (4, True, False, True)
    assert (hybrid.shards, hybrid.node_shards, hybrid.finer_with_nodes) == (2, True, False)
    assert not fsdp.node_shards and not hybrid.finer_per_node  # shard_size fixes the group
    assert (ddp.shards, ddp.gathers, ddp.bucket_copy, ddp.can_offload) == (1, False, True, False)
    assert one.bucket_copy is False
    assert plan("parallel.sharding=grad_op").memory_factors().keeps_gathered
    cfg = load(None, ["model.seq_len=32", "parallel.sharding=hybrid", "parallel.shard_size=2"])
    pr = memory.measure(cfg)
    assert memory.estimate(cfg, 4, 2, profile=pr).optimizer == 8 * pr.params // 2  # AdamW, sharded over 2


# -- what differs between the strategies in the loop ------------------------------------------------


def test_the_scaler_and_autocast_follow_the_strategy():
    fp16, bf16 = ["parallel.param_dtype=float16"], ["parallel.param_dtype=bfloat16"]
    assert plan().scaler() is None
    assert type(plan(*fp16).scaler()).__name__ == "ShardedGradScaler"
    assert type(plan(*fp16, "parallel.strategy=ddp").scaler()) is torch.amp.GradScaler
    with torch.device("meta"):
        transformer = models.build(load(None, ["model.seq_len=32"]).model)
        with_batchnorm = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    assert plan(*bf16).autocast_dtype(transformer) is None  # FSDP casts its parameters itself
    # BatchNorm: FSDP keeps float32 parameters and autocast computes in bfloat16
    assert plan(*bf16).autocast_dtype(with_batchnorm) == torch.bfloat16
    assert plan(*bf16, "parallel.strategy=ddp").autocast_dtype(transformer) == torch.bfloat16
    assert plan().autocast_dtype(transformer) is None


def test_the_plans_checks_need_no_torch():
    """A login node's config check asks the plan: trainer.parallel.plan imports without torch, and the
    arithmetic and checks run there."""
    code = (
        'import sys; sys.modules["torch"] = None  # any import of torch now raises ImportError\n'
        "from trainer.config import load\n"
        "from trainer.parallel.plan import Plan\n"
        "p = Plan(load(None, ['parallel.sharding=hybrid', 'parallel.shard_size=3']).parallel, 4, 1)\n"
        "print(p.dp_rank, p.dp_size, p.problems(), p.memory_factors().shards)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "1 4 [('parallel.shard_size', '3 does not divide the 4 processes; choose a divisor')] 3\n"
    ), proc.stdout


def test_nothing_outside_the_plan_asks_which_strategy_runs():
    """The loop, the memory estimate, the config check and float8 ask the plan (issue #34 item 1; float8:
    #43 item 3, it takes the plan's fsdp_ranks)."""
    for name in (
        "train.py",
        "preflight/memory.py",
        "preflight/check.py",
        "commands/evaluate.py",
        "data.py",
        "parallel/float8.py",
    ):
        source = (ROOT / "trainer" / name).read_text()
        assert ".strategy" not in source.replace("plan.strategy", ""), name
    assert parallel.Plan  # the one place that does


def test_the_memory_factors_split_the_state_over_dp_shard_times_tp():
    """#37: tp=2 on 8 ranks: a parameter's state is split over the 4 data-parallel ranks x the 2
    tensor-parallel ones; with hybrid groups of 2 the dp ranks (4) shard finer, not the world (8)."""
    full, hybrid = (
        plan("parallel.tp=2", world=8),
        plan("parallel.tp=2", "parallel.sharding=hybrid", "parallel.shard_size=2", world=8),
    )
    assert (full.memory_factors().shards, full.memory_factors().tp, full.memory_factors().node_shards) == (8, 2, False)
    assert (hybrid.memory_factors().shards, hybrid.memory_factors().node_shards) == (4, True)
    assert (
        plan("parallel.tp=4", "parallel.sharding=hybrid", "parallel.shard_size=2", world=8).memory_factors().node_shards
        is False
    )
