"""trainer/checkpoint/load_plan.py's planner looks a rank's saved chunks up in an index: its ReadItems must be
DCP's own, item for item and in DCP's order, on every layout (uneven, empty and 2D shardings,
resharding, chunks saved out of order). No processes: layouts are built as DTensor splits them."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.checkpoint import load_plan


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """(offset, size) of part `i` of `n` split as torch.chunk / DTensor's Shard do: ceil(n/parts)
    each, the last short, the rest empty and placed at the end."""
    step = -(-n // parts) if parts else n
    start = min(i * step, n)
    return start, min(step, n - start)


def grid(shape: tuple[int, ...], cuts: dict[int, int], rng: random.Random, uneven: bool) -> list[ChunkStorageMetadata]:
    """The chunks of `shape` cut into cuts[d] parts along each dimension d (DTensor's split, or
    random cut points where `uneven`), row-major."""
    spans = []
    for d, n in enumerate(shape):
        parts = cuts.get(d, 1)
        if uneven and n > 1 and parts > 1:
            points = sorted(rng.randint(0, n) for _ in range(parts - 1))
            edges = [0, *points, n]
            spans.append([(a, b - a) for a, b in zip(edges, edges[1:])])
        else:
            spans.append([split(n, parts, i) for i in range(parts)])
    out = [((), ())]
    for d_spans in spans:
        out = [(o + (s[0],), z + (s[1],)) for o, z in out for s in d_spans]
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z)) for o, z in out]


class Local:
    """A rank's chunks of one tensor, as the planner asks a DTensor (its global size, its chunk list)."""

    def __init__(self, shape, chunks):
        self.shape, self.chunks = torch.Size(shape), chunks

    def size(self):
        return self.shape

    def __create_chunk_list__(self):
        return list(self.chunks)


def set_up(planner, state: dict, metadata: Metadata) -> None:
    """set_up_planner for a flat `state`, less its _init_state_dict (which materialises meta
    tensors and takes the stand-ins for something else; bench/scale.py does the same)."""
    planner.set_up_planner({}, metadata, is_coordinator=False)
    planner.original_state_dict = planner.state_dict = dict(state)
    planner.mappings = {k: (k,) for k in state}


def plans(metadata: Metadata, state: dict, chunk_index) -> tuple[list, list]:
    """(DCP's ReadItems, ours) for `state` against `metadata`."""
    out = []
    for planner in (DefaultLoadPlanner(), load_plan.Planner(chunk_index)):
        set_up(planner, state, metadata)
        out.append(planner.create_local_plan().items)
    return out[0], out[1]


def random_case(rng: random.Random):
    """(metadata, [each loading rank's state]) of a few tensors saved over one layout and loaded over
    another: 1-3 dimensions, 1-40 ranks each way, 1D or 2D cuts, even or random cut points, chunks
    saved in order or shuffled, a rank holding one chunk or several."""
    md, states = {}, None
    loading = rng.randint(1, 6)
    states = [{} for _ in range(loading)]
    for t in range(rng.randint(1, 4)):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 16, 33]) for _ in range(ndim))
        saved_cuts = {rng.randrange(ndim): rng.randint(1, 40)}
        if ndim > 1 and rng.random() < 0.5:
            saved_cuts[rng.randrange(ndim)] = rng.randint(1, 6)
        saved = grid(shape, saved_cuts, rng, uneven=rng.random() < 0.3)
        if rng.random() < 0.3:
            rng.shuffle(saved)
        fqn = f"t{t}"
        md[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), saved)
        local_cuts = {rng.randrange(ndim): rng.randint(1, 40)}
        if ndim > 1 and rng.random() < 0.5:
            local_cuts[rng.randrange(ndim)] = rng.randint(1, 6)
        pieces = grid(shape, local_cuts, rng, uneven=rng.random() < 0.3)
        for r, state in enumerate(states):
            mine = pieces[r::loading] if rng.random() < 0.5 else pieces[r : r + 1]
            if rng.random() < 0.2:
                rng.shuffle(mine)
            state[fqn] = Local(shape, mine)
    md["extra"] = BytesStorageMetadata()
    for state in states:
        state["extra"] = b"bytes"
    return Metadata(state_dict_metadata=md), states


@pytest.mark.parametrize("seed", range(4))
def test_the_same_read_items_as_dcps_planner_on_random_layouts(seed):
    """4 x 60 random checkpoints, every loading rank of each; the index made once and sent as the
    trainer sends it (pickled), and made by the planner itself where none is given."""
    rng = random.Random(seed)
    for trial in range(60):
        metadata, states = random_case(rng)
        chunk_index = pickle.loads(pickle.dumps(load_plan.index(metadata)))
        for rank, state in enumerate(states):
            theirs, ours = plans(metadata, state, chunk_index)
            assert ours == theirs, f"seed {seed} trial {trial} rank {rank}"
            assert plans(metadata, state, None)[1] == theirs


@pytest.mark.parametrize("saved, loading", [(2, 3), (3, 2), (16, 5), (5, 16)])
def test_resharding_reads_the_same_spans_as_dcp(saved, loading):
    """FSDP's Shard(0) over `saved` ranks, loaded over `loading`: (128256, 64), (7, 3) and (2,)."""
    rng = random.Random(0)
    for shape in [(128256, 64), (7, 3), (2,)]:
        md = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size(shape), grid(shape, {0: saved}, rng, False)
        )
        metadata = Metadata(state_dict_metadata={"w": md})
        pieces = grid(shape, {0: loading}, rng, False)
        for rank in range(loading):
            theirs, ours = plans(metadata, {"w": Local(shape, pieces[rank : rank + 1])}, load_plan.index(metadata))
            assert ours == theirs and sum(i.lengths[0] for i in ours) == pieces[rank].sizes[0]


def test_dtensors_of_a_2d_mesh_plan_as_dcp_plans_them():
    """Real DTensors, Shard(0) x Shard(1) on a 6 x 8 mesh of a fake 48-rank group (this process is
    rank 40, as in tests/unit/test_bench_scale.py), against checkpoints saved over 2, 3 and 48 ranks."""
    world, rank = 48, 40
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (6, 8))
        placements = [Shard(0), Shard(1)]
        rng = random.Random(1)
        for shape in [(40, 24), (5, 100), (128, 9)]:
            local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
            state = {
                "w": DTensor.from_local(
                    torch.empty(local_shape), mesh, placements, shape=torch.Size(shape), stride=(shape[1], 1)
                )
            }
            for saved_cuts in [{0: 2}, {1: 3}, {0: 6, 1: 8}]:
                md = TensorStorageMetadata(
                    TensorProperties(dtype=torch.float32), torch.Size(shape), grid(shape, saved_cuts, rng, False)
                )
                metadata = Metadata(state_dict_metadata={"w": md})
                theirs, ours = plans(metadata, state, load_plan.index(metadata))
                assert ours == theirs, (shape, saved_cuts)
    finally:
        dist.destroy_process_group()


def test_a_size_mismatch_is_dcps_error():
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size((4, 4)), grid((4, 4), {0: 2}, random.Random(0), False)
    )
    metadata = Metadata(state_dict_metadata={"w": md})
    planner = load_plan.Planner(load_plan.index(metadata))
    set_up(planner, {"w": Local((4, 5), grid((4, 5), {}, random.Random(0), False))}, metadata)
    with pytest.raises(ValueError, match=r"Size mismatch between saved torch.Size\(\[4, 4\]\) and current"):
        planner.create_local_plan()


def test_chunks_that_dcp_did_not_write_are_left_to_dcps_own_plan():
    """Rank 0 indexes what it read before sending it: a tensor whose chunks disagree on their number
    of dimensions, or hold no numbers, gets no index (no exception on rank 0 alone, where the other
    ranks would wait for the broadcast); DCP's own code plans it."""
    bad_dims = [
        ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((2, 4))),
        ChunkStorageMetadata(torch.Size((2,)), torch.Size((2,))),
    ]
    no_numbers = [ChunkStorageMetadata(torch.Size((0,)), ("two",))]
    props = TensorProperties(dtype=torch.float32)
    metadata = Metadata(
        state_dict_metadata={
            "a": TensorStorageMetadata(props, torch.Size((4, 4)), bad_dims),
            "b": TensorStorageMetadata(props, torch.Size((2,)), no_numbers),
        }
    )
    assert load_plan.index(metadata) == {}


def test_a_rank_given_rank_0s_index_does_not_index_again(monkeypatch):
    """The trainer's ranks plan with the index rank 0 sent (checkpoint.py `choose`): no pass over
    the saved chunks of their own; without one the planner makes it."""
    rng = random.Random(2)
    metadata, states = random_case(rng)
    chunk_index = load_plan.index(metadata)
    made = []
    index_tensor = load_plan.index_tensor
    monkeypatch.setattr(load_plan, "index_tensor", lambda md: made.append(md) or index_tensor(md))
    theirs, ours = plans(metadata, states[0], chunk_index)
    assert ours == theirs and made == []
    assert plans(metadata, states[0], None)[1] == theirs and made
