"""trainer/save_plan.py plans every rank's save without a gather: each rank's final plan (items,
their order and index hints) and the metadata (chunk lists in order, properties, planner_data)
must be DCP's own global plan's, on random layouts: FSDP2's uneven Shard(0) with empty chunks, 2D
(dp x tp, tp on dim 0 under FSDP2's _StridedShard and on dim 1), hybrid sharding (shards
replicated over a replicate dimension), plain tensors and non-tensor values every rank holds.
No processes: each rank's state is made of real DTensors on the meta device in a fake process
group of that rank, and DCP's own local plans are made from them."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer import save_plan

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def layouts(rng: random.Random, world: int) -> list[tuple[tuple[int, ...], tuple, str]]:
    """(mesh shape, placements, name) of the kinds of sharding the trainer makes over `world` ranks."""
    out = [((world,), (Shard(0),), "fsdp")]
    for a in (2, 3, 4):
        if world % a == 0 and world > a:
            b = world // a
            out += [
                ((b, a), (_StridedShard(0, split_factor=a), Shard(0)), "fsdp x tp colwise"),
                ((b, a), (Shard(0), Shard(1)), "fsdp x tp rowwise"),
                ((a, b), (Replicate(), Shard(0)), "hsdp"),
                ((a, b), (Replicate(), Replicate()), "replicated"),
            ]
    return out


def random_state(rng: random.Random, world: int) -> list[tuple]:
    """A state's recipe, the same for every rank: (key, kind, shape, dtype, mesh shape, placements)."""
    recipe = []
    kinds = layouts(rng, world)
    for i in range(rng.randint(4, 10)):
        mesh_shape, placements, _ = rng.choice(kinds)
        shape = (rng.choice([1, 2, 3, 5, 7, world, 2 * world + 1]), rng.randint(1, 6))
        if any(isinstance(p, _StridedShard) for p in placements):  # FSDP2 x TP: even (DCP rejects uneven ones)
            shape = (world * rng.randint(1, 3), shape[1])
        recipe.append((f"model.layer{i}.weight", "dtensor", shape, rng.choice(DTYPES[:2]), mesh_shape, placements))
        if rng.random() < 0.5:
            recipe.append((f"optim.state.layer{i}.step", "tensor", (), torch.float32, None, None))
        if rng.random() < 0.2:
            recipe.append((f"extra.note{i}", "bytes", None, None, None, None))
    return recipe


def rank_state(recipe, rank: int, world: int) -> dict:
    """Rank `rank`'s flattened state (real DTensors on the meta device) in a fake group of `world`."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    meshes, state = {}, {}
    for key, kind, shape, dtype, mesh_shape, placements in recipe:
        if kind == "dtensor":
            mesh = meshes.get(mesh_shape) or meshes.setdefault(mesh_shape, init_device_mesh("cpu", mesh_shape))
            state[key] = dtensor(torch.empty(shape, dtype=dtype, device="meta"), mesh, placements)
        elif kind == "tensor":
            state[key] = torch.zeros(shape, dtype=dtype)
        else:
            state[key] = {"note": key}
    flat, _ = flatten_state_dict(state)
    return flat


def dtensor(full, mesh, placements):
    """A DTensor of `full`'s shape with `placements`, its local tensor the size DTensor's rule gives
    this rank (FSDP2 makes its parameters so, _StridedShard included)."""
    local_shape, _ = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = torch.empty(local_shape, dtype=full.dtype, device="meta")
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def dcp_plans(states: list[dict]):
    """DCP's own: every rank's local plan, then the coordinator's global plan and metadata."""
    plans = []
    for rank, state in enumerate(states):
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    coordinator = DefaultSavePlanner()
    coordinator.set_up_planner(states[0], is_coordinator=True)
    return plans, *coordinator.create_global_plan(plans)


@pytest.fixture(autouse=True)
def _no_group_left():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("seed", range(12))
def test_plans_and_metadata_are_dcps_on_random_layouts(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 6, 8])
    recipe = random_state(rng, world)
    states, described = [], []
    for rank in range(world):
        states.append(rank_state(recipe, rank, world))
        described.append(save_plan.describe(states[-1], world))
    assert all(d == described[0] for d in described), "every rank describes the same layout"
    assert len({save_plan.digest(d) for d in described}) == 1
    local, want_plans, want_md = dcp_plans(states)
    for rank in range(world):
        ours = save_plan.GlobalPlan(described[rank], world)  # each rank's own, from the layout alone
        got = ours.final_plan(local[rank], rank)
        assert got.items == want_plans[rank].items, f"rank {rank}'s plan"
        assert [i.index.index for i in got.items] == [i.index.index for i in want_plans[rank].items]
    md = ours.metadata(planner_data=want_md.planner_data)
    assert list(md.state_dict_metadata) == list(want_md.state_dict_metadata)
    assert md.state_dict_metadata == want_md.state_dict_metadata
    assert md.planner_data == want_md.planner_data


def test_every_kind_of_layout_is_met():
    """The random layouts above include each kind at least once (else the test proves less)."""
    seen = set()
    for seed in range(12):
        rng = random.Random(seed)
        world = rng.choice([1, 2, 3, 4, 6, 8])
        recipe = random_state(rng, world)
        kinds = {tuple(p) for *_, p in recipe if p}
        names = {name for m, p, name in layouts(random.Random(0), world) if tuple(p) in kinds}
        seen |= names
    assert {"fsdp", "fsdp x tp colwise", "fsdp x tp rowwise", "hsdp"} <= seen


def test_a_state_it_cannot_plan_is_left_to_dcp():
    """A DTensor on a mesh of part of the group: describe says None (DCP's own planner then)."""
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (4,))
    sub = mesh.mesh[:2]
    from torch.distributed.device_mesh import DeviceMesh

    part = DeviceMesh("cpu", sub)
    t = DTensor.from_local(torch.empty(2, 3, device="meta"), part, [Shard(0)], run_check=False)
    assert save_plan.describe({"w": t}, 4) is None
    assert save_plan.digest(None) == 0


def test_a_layout_whose_chunks_overlap_is_refused_as_dcp_refuses_it():
    """An uneven _StridedShard gives chunks that overlap (DTensor's one chunk per rank cannot say
    it): DCP's global plan refuses it, and so does this one, before anything is written."""
    world, recipe = 6, [("w", "dtensor", (13, 4), torch.float32, (3, 2), (_StridedShard(0, split_factor=2), Shard(0)))]
    states = [rank_state(recipe, rank, world) for rank in range(world)]
    with pytest.raises(ValueError, match="overlapping chunks"):
        dcp_plans(states)
    with pytest.raises(ValueError, match="w.*overlap"):
        save_plan.GlobalPlan(save_plan.describe(states[0], world), world)
