"""Tensor parallelism (parallel.tp, issue #37): the plan's refusals; on the CPU with gloo, tp=2 x dp=2
trains as dp=4 does, its ranks of one tp group read the same samples, a kill -9 and resume at the
same layout is bitwise, and its checkpoints load on other layouts (and export) with equal weights.

One 4-rank tp=2 run (`tp_run`) is shared: its losses, its sample trace and its checkpoints."""

import dataclasses

import pytest

from tests.helpers.bad_input import refused
from trainer.config import ParallelArgs
from trainer.models import ModelArgs
from trainer.models.transformer.family import resolve
from trainer.parallel.plan import Plan


def model(**keys) -> ModelArgs:
    return dataclasses.replace(resolve(ModelArgs(seq_len=32)), **keys)  # tiny: 4 heads, ffn 192


@pytest.mark.parametrize(
    "parallel, world, per_node, model_args, key, words",
    [
        (dict(strategy="ddp"), 4, None, model(), "parallel.tp", "needs parallel.strategy=fsdp (it is ddp)"),
        ({}, 6, None, model(), "parallel.tp", "4 does not divide the 6 processes"),
        ({}, 8, 6, model(), "parallel.tp", "4 does not divide the 6 processes (GPUs) of a node"),
        (
            dict(sharding="hybrid", shard_size=4),
            8,
            None,
            model(),
            "parallel.shard_size",
            "4 does not divide the 2 data-parallel ranks (the 8 processes over tp=4)",
        ),
        (dict(cpu_offload=True), 8, None, model(), "parallel.cpu_offload", "does not compose"),
        (dict(float8="tensorwise"), 8, None, model(), "parallel.float8", "does not compose"),
        ({}, 8, None, ModelArgs(name="mnist_cnn"), "parallel.tp", "model 'mnist_cnn' has no tensor-parallel plan"),
        ({}, 8, None, model(n_heads=2, n_kv_heads=2), "model.n_heads", "2 attention heads do not split"),
        ({}, 8, None, model(n_kv_heads=2), "model.n_kv_heads", "2 key/value heads do not split"),
        ({}, 8, None, model(ffn_dim=190), "model.ffn_dim", "190 feed-forward units do not split"),
        ({}, 8, None, model(seq_len=30), "model.seq_len", "30 positions (sequence parallelism) do not split"),
        ({}, 8, None, model(tie_embeddings=True), "model.tie_embeddings", "does not compose"),
        ({}, 8, None, model(qk_norm=True), "model.qk_norm", "does not compose"),
    ],
)
def test_plan_refuses_what_tp_cannot_split(parallel, world, per_node, model_args, key, words):
    plan = Plan(ParallelArgs(tp=4, **parallel), world, ranks_per_node=per_node)
    found = plan.problems(model_args)
    assert found and found[0][0] == key and words in found[0][1], found
    assert Plan(ParallelArgs(tp=4), 8, ranks_per_node=8).problems(model()) == []


def test_config_check_refuses_tp_in_one_line(capsys, tmp_path):
    line = refused(capsys, tmp_path / "run", "--nproc", "2", "parallel.tp=2", "model.n_kv_heads=1")
    assert "model.n_kv_heads: 1 key/value heads do not split over parallel.tp=2" in line
    line = refused(capsys, tmp_path / "run", "--nproc", "2", "parallel.tp=3")
    assert "parallel.tp: 3 does not divide the 2 processes (GPUs) of a node" in line


def test_ranks_of_a_tp_group_share_their_data_rank():
    plans = [Plan(ParallelArgs(tp=2), 8, rank) for rank in range(8)]
    assert [p.dp_rank for p in plans] == [0, 0, 1, 1, 2, 2, 3, 3] and {p.dp_size for p in plans} == {4}
