"""bench/scale.py plans a checkpoint of thousands of ranks without their processes: its synthetic
plans must be the plans DCP makes for a model FSDP2 shards, rank for rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from bench import scale
from trainer import config, models


@pytest.mark.parametrize("shape", [(10, 3), (2, 5), (7,), (128256, 4096)])
@pytest.mark.parametrize("world", [1, 3, 4, 16])
def test_shard_is_dtensors_chunk_of_every_rank(shape, world):
    for rank in range(world):
        assert scale.shard(shape, world, rank) == _compute_local_shape_and_global_offset(
            shape, (world,), [rank], [Shard(0)]
        )


def test_synthetic_plan_is_dcps_plan_of_an_fsdp2_model():
    """The tiny transformer fully_shard'ed over 48 ranks (a fake process group: this one process is
    rank 40): DCP's own local SavePlan and bench.scale's, item for item. Rank 40 holds rows 240-245
    of the 256-row embedding and an empty chunk of every 64-row tensor. One rank per process: the
    device mesh keeps the first rank it saw."""
    world, rank = 48, 40
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        cfg = config.load("configs/default.yaml")
        model = models.spec(cfg.model).build(cfg.model)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        planner = DefaultSavePlanner()
        planner.set_up_planner({"model": get_model_state_dict(model)}, is_coordinator=False)
        real = planner.create_local_plan()
    finally:
        dist.destroy_process_group()
    items = [(f"model.{name}", tuple(p.shape), True) for name, p in model.state_dict().items()]
    ours = scale.save_plan(items, world, rank, scale.mappings_of(items))
    assert [i.index for i in ours.items] == [i.index for i in real.items]
    assert [i.type for i in ours.items] == [i.type for i in real.items]
    assert [i.tensor_data for i in ours.items] == [i.tensor_data for i in real.items]
    assert ours.planner_data == real.planner_data
    sizes = {i.index.fqn: i.tensor_data.chunk.sizes[0] for i in real.items}
    assert sizes["model.tok_embeddings.weight"] == 6 and sizes["model.layers.0.attention.wq.weight"] == 0


def test_a_planning_round_resumes_each_rank_from_its_own_chunks():
    """A round at 8 ranks of the Llama-8B slice: 48 items per rank, each read back whole by one read;
    trainer/checkpoint/save_plan.py's plans of the same state are DCP's (asserted inside the round)."""
    r = scale.plan_round(8, whole=False)
    assert r["items_per_rank"] == 48 == r["load_read_items"]
    assert r["metadata_bytes"] > 0 and r["manifest_bytes"] > 0


def test_a_second_save_plans_from_rank_0s_cache():
    """At 8 ranks: the second save's plans are empty and unusable (the cached global plan and
    metadata reused, asserted inside the round), what rank 0 scatters shrinks to a few bytes a rank."""
    r = scale.plan_round(8, whole=False)
    assert r["cached_scatter_bytes"] < r["scatter_bytes"] / 50
    assert r["metadata_broadcast_bytes"] > 0


def test_a_layout_round_plans_without_a_gather_and_resumes_from_the_index():
    """At 16 ranks, the whole 8B state planned from the layout: rank 0 receives 16 empty plans (a
    few bytes each) where DCP's gather receives every item; the chunk index is written and each
    rank's resume plans one read per item from its slice alone (its records, not every rank's)."""
    r = {**scale.layout_round(16), **scale.index_round(16)}
    assert r["items_per_rank"] == 1164
    assert r["layout_gather_bytes"] < 16 * 200
    assert 873 <= r["layout_own_items"] < 1164  # its 873 shards, and of the 291 steps (plain tensors) a few
    assert r["index_rank_read_items"] == 1164
    assert r["index_slice_bytes"] < r["index_bytes"] / 8
    assert r["layout_stock_bytes"] > 0  # .metadata built from the index, as stock.py writes it after the commit


def test_a_reshard_round_sends_each_rank_the_saved_chunks_its_own_overlap():
    """The whole 8B state saved by 16 ranks, resumed on 12: every sharded tensor's saved chunks
    differ from the new ones, and each rank's part of the index holds only the saved chunks its own
    overlap (2 of 16 for most, 1 or 2 for the smallest tensors), far from every record; the rank's
    load plan reads each of them once (its 0-d steps from its own record)."""
    r = scale.reshard_round(16, 12)
    assert 873 <= r["reshard_slice_records"] <= 2 * 873
    assert r["reshard_rank_read_items"] == r["reshard_slice_records"] + 291
    assert r["reshard_slice_records"] < 873 * 16 / 4  # every record: 16 a tensor
