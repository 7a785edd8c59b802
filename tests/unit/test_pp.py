"""Pipeline parallelism (parallel.pp, issue #45): what it cannot run with is refused in one line before
anything starts (a family without a split, pp not dividing the blocks, a schedule the micro-batches do
not fill, a batch that does not split into them, what it does not compose with); the transformer's
stages keep the whole model's parameter names and, run one after the other, give the whole model's
output to the bit; the batch arithmetic (global / dp ranks = pipeline micro-batches x micro-batch x
accumulation) is the loop's and the check's plan line. The system tier (tests/system/test_pp.py)
trains pp=2 against pp=1 and moves checkpoints between them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.bad_input import refused
from trainer import train
from trainer.config import ParallelArgs, load, resolve
from trainer.models import ModelArgs, build
from trainer.models.transformer.family import resolve as resolve_transformer
from trainer.parallel.dims import ParallelDims
from trainer.parallel.plan import Plan
from trainer.preflight.check import plan_lines


def model(**keys) -> ModelArgs:
    return dataclasses.replace(resolve_transformer(ModelArgs(seq_len=32)), **keys)  # tiny: 2 layers


@pytest.mark.parametrize(
    "parallel, world, model_args, line",
    [
        (
            {},
            4,
            ModelArgs(name="mnist_cnn"),
            "parallel.pp: is 2 but model 'mnist_cnn' has no pipeline split; set pp=1",
        ),
        (
            {},
            4,
            model(n_layers=3),
            "parallel.pp: 2 stages do not split the model's 3 blocks (model.n_layers) evenly; choose a divisor of 3",
        ),
        (
            dict(pp_microbatches=1),
            4,
            model(),
            "parallel.pp_microbatches: 1 micro-batches do not fill the 1f1b schedule of parallel.pp=2 stages: it "
            "needs at least 2 (or parallel.pp_schedule=gpipe)",
        ),
        ({}, 3, model(), "parallel.pp: 2 stages do not divide the 3 processes; choose a divisor"),
        (dict(strategy="ddp"), 4, model(), "parallel.pp: is 2 but needs parallel.strategy=fsdp (it is ddp); set pp=1"),
        (
            dict(pp_schedule="interleaved_1f1b", pp_microbatches=5),
            4,
            model(n_layers=4),
            "parallel.pp_microbatches: 5 micro-batches do not fit the interleaved_1f1b schedule of parallel.pp=2 "
            "stages: it runs them in 2 rounds of 2; use a multiple of 2 (or fewer than 2)",
        ),
        (
            dict(pp_schedule="interleaved_1f1b"),
            4,
            model(n_layers=6),
            "parallel.pp_stages_per_rank: parallel.pp=2 x 2 stages a rank do not split the model's 6 blocks "
            "(model.n_layers) evenly; choose them so that pp x stages a rank divides 6",
        ),
        (
            dict(pp_stages_per_rank=2),
            4,
            model(n_layers=4),
            "parallel.pp_stages_per_rank: is 2 but parallel.pp_schedule=1f1b runs one stage a rank; use "
            "interleaved_1f1b, interleaved_zb or zbv, or 1",
        ),
        (
            dict(pp_schedule="zbv", pp_stages_per_rank=3),
            4,
            model(n_layers=12),
            "parallel.pp_stages_per_rank: is 3 but parallel.pp_schedule=zbv runs 2 stages a rank (its V); set 2",
        ),
        (
            dict(tp=2),
            6,
            model(),
            "parallel.pp: 2 stages x parallel.tp=2 do not divide the 6 processes; choose a divisor",
        ),
        (
            dict(pp_schedule="zbv", activation_checkpointing="selective"),
            4,
            model(n_layers=4),
            "parallel.selective_ac: op does not compose with parallel.pp_schedule=zbv: its weight pass goes back "
            "through a block a second time, which checkpointing by operator refuses; use an N, "
            "parallel.activation_checkpointing=full, or another schedule",
        ),
        (
            dict(compile=True),
            4,
            model(),
            "parallel.compile: does not compose with parallel.pp=2 (not built); use one of them",
        ),
        (
            dict(param_dtype="float16"),
            4,
            model(),
            "parallel.param_dtype: does not compose with parallel.pp=2 (not built); use one of them",
        ),
        (
            {},
            4,
            model(tie_embeddings=True),
            "model.tie_embeddings: does not compose with parallel.pp=2 (not built); use one of them",
        ),
    ],
    ids=[
        "no-split",
        "layers",
        "1f1b-fill",
        "world",
        "ddp",
        "interleaved-rounds",
        "stages-x-layers",
        "one-stage-schedule",
        "zbv-v",
        "tp-world",
        "zero-bubble-selective-op",
        "compile",
        "fp16",
        "tied",
    ],
)
def test_plan_refuses_what_pp_cannot_run_with(parallel, world, model_args, line):
    found = Plan(ParallelArgs(pp=2, **parallel), world).problems(model_args)
    assert found and f"{found[0][0]}: {found[0][1]}" == line, found
    assert Plan(ParallelArgs(pp=2), 4).problems(model()) == []
    assert Plan(ParallelArgs(pp=2, pp_schedule="gpipe", pp_microbatches=1), 4).problems(model()) == []


@pytest.mark.parametrize(
    "parallel, world",
    [
        (dict(tp=2), 8),  # pp x dp x tp
        (dict(pp_schedule="interleaved_1f1b", pp_microbatches=3), 2),  # one round of 3: torch's flexible rounds
        (dict(pp_schedule="interleaved_1f1b", pp_microbatches=4), 2),
        (dict(pp_schedule="interleaved_zb"), 2),
        (dict(pp_schedule="zbv", pp_microbatches=1), 2),
        (dict(pp_schedule="interleaved_1f1b", pp_stages_per_rank=4, tp=2), 4),
        (dict(pp_schedule="interleaved_zb", activation_checkpointing="selective", selective_ac=2), 2),
        (dict(pp_schedule="interleaved_1f1b", activation_checkpointing="selective"), 2),
    ],
)
def test_plan_runs_what_pp_composes_with(parallel, world):
    assert Plan(ParallelArgs(pp=2, **parallel), world).problems(model(n_layers=8)) == []


@pytest.mark.parametrize(
    "schedule, stages_per_rank, ranks",
    [
        ("1f1b", None, [(0,), (1,), (2,), (3,)]),
        ("gpipe", 1, [(0,), (1,), (2,), (3,)]),
        ("interleaved_1f1b", None, [(0, 4), (1, 5), (2, 6), (3, 7)]),  # the loop: r, r + pp, ...
        ("interleaved_zb", 3, [(0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)]),
        ("zbv", None, [(0, 7), (1, 6), (2, 5), (3, 4)]),  # the V: the first rank holds the first and last stage
    ],
)
def test_each_rank_holds_its_schedule_s_stages(schedule, stages_per_rank, ranks):
    """Every stage on one rank, each rank its schedule's: torch's stage-to-rank maps (loop, V)."""
    from trainer.parallel import pp

    args = ParallelArgs(pp=4, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank)
    assert [pp.local_stages(args, r) for r in range(4)] == ranks
    assert sorted(s for held in ranks for s in held) == list(range(4 * pp.stages_per_rank(args)))
    # a stage of the V's other leg sits on the rank torch's "v" map names
    if schedule == "zbv":
        from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

        v = generate_stage_to_rank_mapping(4, 8, style="v")
        assert all(v[s] == r for r, held in enumerate(ranks) for s in held)


def test_several_stages_of_a_rank_are_views_whose_blocks_the_model_keeps_under_its_names():
    """parallel_pp.cut and merge: rank 0 of pp=2 under interleaved_1f1b holds stages 0 and 2 of 4 of an
    8-block model: each stage a view holding its blocks (the embedding on stage 0), whose chained outputs
    with rank 1's stages give the whole model's to the bit; merged, the model holds the four blocks and
    the embedding under the whole model's names, the same parameters as the views."""
    from trainer.models.transformer.family import pp_split
    from trainer.parallel import pp

    args = resolve_transformer(ModelArgs(seq_len=16, n_layers=8))
    whole = build(args)
    whole.init_weights(0)
    ranks = []
    for rank in range(2):
        held = build(args)
        held.init_weights(0)
        views = pp.cut(held, pp_split, pp.local_stages(ParallelArgs(pp=2, pp_schedule="interleaved_1f1b"), rank), 4)
        ranks.append((held, views))
    held, views = ranks[0]
    assert [sorted(v.layers) for v in views] == [["0", "1"], ["4", "5"]]
    assert views[0].tok_embeddings is held.tok_embeddings and views[1].tok_embeddings is None
    assert views[0].norm is None and ranks[1][1][1].output is not None  # stage 3, on rank 1, ends the model
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        h = tokens
        for stage in range(4):
            h = ranks[stage % 2][1][stage // 2](h)
        assert torch.equal(h, whole(tokens))
    pp.merge(held, views)
    names = set(dict(held.named_parameters()))
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "1", "4", "5"}
    assert "tok_embeddings.weight" in names and held.norm is None and held.output is None
    assert {id(p) for p in held.parameters()} == {id(p) for v in views for p in v.parameters()}
    assert held.rope_cos is views[0].rope_cos is views[1].rope_cos


def test_config_check_refuses_pp_in_one_line(capsys, tmp_path):
    run = tmp_path / "run"
    line = refused(capsys, run, "--nproc", "3", "parallel.pp=3", "train.global_batch_size=12")
    assert line.endswith(
        "parallel.pp: 3 stages do not split the model's 2 blocks (model.n_layers) evenly; choose a divisor of 2"
    ), line
    line = refused(capsys, run, "--nproc", "2", "parallel.pp=2", "parallel.pp_microbatches=1")
    assert line.endswith(
        "parallel.pp_microbatches: 1 micro-batches do not fill the 1f1b schedule of parallel.pp=2 "
        "stages: it needs at least 2 (or parallel.pp_schedule=gpipe)"
    ), line
    line = refused(capsys, run, "--nproc", "2", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b")
    assert line.endswith(
        "parallel.pp_stages_per_rank: parallel.pp=2 x 2 stages a rank do not split the model's 2 blocks "
        "(model.n_layers) evenly; choose them so that pp x stages a rank divides 2"
    ), line
    line = refused(
        capsys, run, "--nproc", "2", "parallel.pp=2", "model.family=tests.toy_lm_family", "model.vocab_size=64"
    )
    assert line.endswith("parallel.pp: is 2 but model.family 'tests.toy_lm_family' has no pipeline split; set pp=1"), (
        line
    )
    line = refused(
        capsys, run, "--nproc", "4", "parallel.pp=2", "train.global_batch_size=12", "parallel.pp_microbatches=4"
    )
    assert line.endswith(
        "train.global_batch_size: the 6 samples per rank (2 data-parallel ranks (dp_size: 4 / pp 2)) do not split "
        "into parallel.pp_microbatches=4 micro-batches; use a multiple of 4 per rank"
    ), line
    line = refused(
        capsys, run, "--nproc", "2", "parallel.pp=2", "train.global_batch_size=12", "train.micro_batch_size=4"
    )
    assert line.endswith(
        "train.micro_batch_size: the 12 samples per rank (1 data-parallel ranks (dp_size: 2 / pp 2)) are not a "
        "multiple of parallel.pp_microbatches=2 x train.micro_batch_size=4; choose them so that 8 divides 12"
    ), line


def test_pp_is_the_mesh_s_outermost_degree():
    dims = ParallelDims.of(ParallelArgs(pp=2), 4)
    assert (dims.pp, dims.dp_shard, dims.dp_size) == (2, 2, 2)
    assert dims.mesh_dims() == ((2, 2), ("pp", "dp_shard"))
    assert [dims.pp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [dims.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]  # each stage holds every data-parallel rank once


@pytest.mark.parametrize(
    "parallel, world, per_node, degrees, shape, names",
    [
        # shard_size: groups of it inside each stage, replicated over the rest of the stage's dp ranks
        (dict(shard_size=1, tp=2), 8, None, (2, 1, 2), (2, 2, 1, 2), ("pp", "dp_replicate", "dp_shard", "tp")),
        (dict(shard_size=2), 8, None, (2, 2, 1), (2, 2, 2), ("pp", "dp_replicate", "dp_shard")),
        # by default a node's share of a stage, over tp: a node of 8 ranks under pp=2 (4 nodes)
        (dict(tp=2), 32, 8, (2, 4, 2), (2, 2, 4, 2), ("pp", "dp_replicate", "dp_shard", "tp")),
        # one node holding both stages: the stage's dp ranks (not the node's 8, which leave 0 replicas)
        ({}, 8, 8, (1, 4, 1), (2, 1, 4), ("pp", "dp_replicate", "dp_shard")),
        (dict(tp=2), 8, 8, (1, 2, 2), (2, 1, 2, 2), ("pp", "dp_replicate", "dp_shard", "tp")),
    ],
    ids=["shard1-tp2", "shard2", "node-of-4-nodes", "one-node", "one-node-tp2"],
)
def test_hybrid_sharding_is_2d_inside_each_stage(parallel, world, per_node, degrees, shape, names):
    """pp x dp_replicate x dp_shard x tp, torchtitan's order: hybrid's groups inside each stage."""
    args = ParallelArgs(pp=2, sharding="hybrid", **parallel)
    plan = Plan(args, world, ranks_per_node=per_node)
    assert (plan.dp_replicate, plan.dp_shard, plan.tp) == degrees
    assert plan.dims.mesh_dims() == (shape, names)
    assert plan.dims.dp_dims() == ("dp_replicate", "dp_shard")
    assert plan.dp_size == plan.dp_replicate * plan.dp_shard and plan.problems(model()) == []


@pytest.mark.parametrize(
    "parallel, world, line",
    [
        (
            dict(shard_size=3),
            8,
            "parallel.shard_size: 3 does not divide the 4 data-parallel ranks (the 8 processes over pp=2); "
            "choose a divisor",
        ),
        (
            dict(shard_size=4, tp=2),
            8,
            "parallel.shard_size: 4 does not divide the 2 data-parallel ranks (the 8 processes over pp=2 x tp=2); "
            "choose a divisor",
        ),
    ],
)
def test_a_shard_size_that_does_not_divide_a_stage_s_dp_ranks_is_refused_in_one_line(parallel, world, line):
    found = Plan(ParallelArgs(pp=2, sharding="hybrid", **parallel), world).problems(model())
    assert [f"{key}: {message}" for key, message in found] == [line]


@pytest.mark.parametrize(
    "overrides, world, micro, accum, line",
    [
        # 12 / 2 data-parallel ranks = 2 pipeline micro-batches x 3 samples x 1 accumulation step
        (
            [],
            4,
            6,
            1,
            "batch: global 12 / 2 data-parallel ranks (NPROC=4 x NODES=1 / parallel.pp=2) = 2 pipeline "
            "micro-batches (parallel.pp_microbatches) x micro-batch 3 x 1 accumulation step(s)",
        ),
        (
            ["train.micro_batch_size=1", "parallel.pp_microbatches=3"],
            4,
            3,
            2,
            "batch: global 12 / 2 data-parallel "
            "ranks (NPROC=4 x NODES=1 / parallel.pp=2) = 3 pipeline micro-batches (parallel.pp_microbatches) x "
            "micro-batch 1 x 2 accumulation step(s)",
        ),
        (
            ["train.micro_batch_size=2"],
            2,
            4,
            3,
            "batch: global 12 / 1 data-parallel ranks (NPROC=2 x NODES=1 / "
            "parallel.pp=2) = 2 pipeline micro-batches (parallel.pp_microbatches) x micro-batch 2 x 3 accumulation "
            "step(s)",
        ),
    ],
)
def test_the_batch_arithmetic_is_the_loop_s_and_the_plan_line_s(overrides, world, micro, accum, line):
    """batch_plan's (samples per forward/backward, accumulation steps): the pipeline's micro-batches
    together, run by one schedule step."""
    cfg = resolve(load(None, ["model.seq_len=32", "train.global_batch_size=12", "parallel.pp=2", *overrides]))
    assert train.batch_plan(cfg, Plan(cfg.parallel, world).dp_size) == (micro, accum)
    assert plan_lines(cfg, world, 1)[0] == f"{line}; 12 tokens per step (32 per sample)".replace(
        "12 tokens", f"{12 * 32:,} tokens"
    )


def test_stages_keep_the_whole_model_s_names_and_chain_to_its_output_to_the_bit():
    args = resolve_transformer(ModelArgs(seq_len=16, n_layers=4))
    torch.manual_seed(0)
    whole = build(args)
    whole.init_weights(0)
    stages = []
    for stage in range(2):
        part = build(args)
        part.pipeline_stage(stage, 2)
        part.init_weights(0)  # seeded by name: the whole model's weights
        stages.append(part)
    names = [set(dict(s.named_parameters())) for s in stages]
    assert not names[0] & names[1] and names[0] | names[1] == set(dict(whole.named_parameters()))
    assert {n for n in names[0] if n.startswith("layers.")} == {n for n in names[0] if n[7] in "01"}
    assert "tok_embeddings.weight" in names[0] and {"norm.weight", "output.weight"} <= names[1]
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](tokens)), whole(tokens))
    assert stages[0].flops_per_token() == whole.flops_per_token()  # the whole model's, on any stage


def test_the_memory_estimate_is_one_stage_s_with_the_schedule_s_micro_batches_in_flight():
    """A stage holds 1/pp of the blocks' parameters and the root's whole (embedding, norm, head: counted
    on every stage), the state sharded over its data-parallel ranks; its activations are 1/pp of a
    sample's, for the micro-batches its first stage holds at once: pp under 1F1B, all under GPipe."""
    from trainer.preflight import memory

    base = ["model.seq_len=16", "train.global_batch_size=16"]
    cfg = resolve(load(None, base))
    profile = memory.measure(cfg)
    whole = memory.estimate(cfg, 2, 4, profile=profile)  # 2 data-parallel ranks, micro-batches of 4
    stage = (profile.params - profile.root_params) // 2 + profile.root_params
    for schedule, m, held in (("1f1b", 4, 2), ("gpipe", 4, 4), ("1f1b", 2, 2)):
        staged = resolve(load(None, [*base, "parallel.pp=2", f"parallel.pp_schedule={schedule}"]))
        staged = dataclasses.replace(staged, parallel=dataclasses.replace(staged.parallel, pp_microbatches=m))
        e = memory.estimate(staged, 4, 2, profile=profile)  # 2 stages x 2 data-parallel ranks, micro-batches of 2
        assert e.parameters == memory.WEIGHT_BYTES * stage // 2
        assert e.optimizer == memory.OPTIMIZER_BYTES["adamw"] * stage // 2
        assert e.activations == profile.activations // 2 * 2 * held
        assert f"{held} micro-batches in flight x 2 sample(s)" in e.notes["activations"]
        assert e.parameters < whole.parameters
    line = plan_lines(resolve(load(None, [*base, "parallel.pp=2", "parallel.pp_microbatches=6"])), 4, 1)[1]
    assert line == (
        "pipeline: 2 stages, schedule 1f1b: bubble (pp-1)/(m+pp-1) = 1/7 = 14% of each forward/backward idle; the "
        "first stage holds 2 micro-batch(es) of activations at once"
    )


def test_a_refusal_offers_no_change_that_pp_does_not_compose_with():
    """Where one node's GPUs are too small, more nodes are offered (each stage sharded finer), not CPU
    offload or tensor parallelism, which pp refuses."""
    from trainer.preflight import memory

    cfg = resolve(load(None, ["model.size=small", "model.seq_len=16", "train.global_batch_size=16", "parallel.pp=2"]))
    profile = memory.measure(cfg, gpu=True)
    two_nodes = memory.estimate(cfg, 8, 2, 4, gpu=True, profile=profile).total
    assert memory.estimate(cfg, 4, 4, 4, gpu=True, profile=profile).total > two_nodes
    offloaded = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cpu_offload=True))
    assert memory.estimate(offloaded, 4, 4, 4, gpu=True, profile=profile).total <= two_nodes  # would fit: not offered
    fixes = memory.changes_that_fit(cfg, 4, 4, two_nodes, profile=profile)
    assert fixes and fixes[0].startswith("--nnodes 2 ("), fixes
    assert not [f for f in fixes if f.startswith(("parallel.cpu_offload", "parallel.tp"))]
