"""trainer/checkpoint/save_plan.py plans every rank's save without a gather: each rank's final plan (items,
their order and index hints) and the metadata (chunk lists in order, properties, planner_data)
must be DCP's own global plan's, on random layouts: FSDP2's uneven Shard(0) with empty chunks, 2D
(dp x tp, tp on dim 0 under FSDP2's _StridedShard and on dim 1), hybrid sharding (shards
replicated over a replicate dimension), plain tensors and non-tensor values every rank holds.
No processes: each rank's state is made of real DTensors on the meta device in a fake process
group of that rank, and DCP's own local plans are made from them."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer import torch_compat
from trainer.checkpoint import save_plan

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
    with pytest.raises(ValueError, match="validate global plan"):
        dcp_plans(states)
    with pytest.raises(ValueError, match="w.*overlap"):
        save_plan.GlobalPlan(save_plan.describe(states[0], world), world)


def _indexed(seed: int, tmp_path):
    """A random layout's global plan, the storage records a save would give it, its chunk index
    written to `tmp_path` and read back; with DCP's full metadata of the same save."""
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4, 6])
    recipe = random_state(rng, world)
    states = [rank_state(recipe, rank, world) for rank in range(world)]
    items = save_plan.describe(states[0], world)
    plan = save_plan.GlobalPlan(items, world)
    _, _, want_md = dcp_plans(states)
    info = torch_compat.storage_info_class()
    storage, at = {}, {}
    for fqn, md in want_md.state_dict_metadata.items():
        keys = [MetadataIndex(fqn)] if isinstance(md, BytesStorageMetadata) else [
            MetadataIndex(fqn, c.offsets) for c in md.chunks
        ]  # fmt: skip
        for k in keys:
            name = f"__{rng.randrange(world)}_0.distcp"
            storage[k] = info(name, at.get(name, 0), rng.randint(1, 999))
            at[name] = storage[k].offset + storage[k].length
    full = dataclasses.replace(want_md, storage_data=storage)
    save_plan.write_index(str(tmp_path), plan, want_md.planner_data, *save_plan.rows_of_storage(plan, storage))
    data = (tmp_path / save_plan.INDEX).read_bytes()
    return world, states, plan, full, data


@pytest.mark.parametrize("seed", range(6))
def test_each_ranks_slice_of_the_index_plans_dcps_reads(seed, tmp_path):
    """Each rank's part of the chunk index (save_plan.slices, the layout unchanged) made into DCP's
    metadata plans the reads DCP plans from the whole .metadata: the same ReadItems (index hints
    aside), and the records they name are the whole metadata's. Without the current layout, each
    rank gets every record, and its metadata is the whole one."""
    world, states, plan, full, data = _indexed(seed, tmp_path)
    header, arrays = save_plan.read_index(data)
    for now in (save_plan.Chunks(plan.items, world), None):
        shared, own_items, parts = save_plan.slices(header, arrays, now, world)
        for rank in range(world):
            mine = save_plan.metadata_of(header, shared, own_items, parts[rank], now, rank)
            assert len(parts[rank][1].item) == 0, "the layout unchanged: no tensor's saved chunks sent whole"
            if now is None:
                assert mine.state_dict_metadata == full.state_dict_metadata or _same_chunk_sets(mine, full)
                assert mine.storage_data == full.storage_data
            assert mine.planner_data == full.planner_data
            ours, theirs = (_load_plan(states[rank], md) for md in (mine, full))
            assert _without_hints(ours) == _without_hints(theirs), rank
            for item in ours:
                assert mine.storage_data[item.storage_index] == full.storage_data[item.storage_index]


def resharded(rng: random.Random, recipe: list[tuple], world: int) -> list[tuple]:
    """`recipe`'s state (the same keys, shapes and dtypes) laid out over `world` ranks anew: each
    DTensor on a random layout of that world (FSDP2 x TP's _StridedShard only where it splits evenly)."""
    out = []
    for key, kind, shape, dtype, mesh_shape, placements in recipe:
        if kind == "dtensor":
            even = shape[0] % world == 0
            kinds = [k for k in layouts(rng, world) if even or not any(isinstance(p, _StridedShard) for p in k[1])]
            mesh_shape, placements, _ = rng.choice(kinds)
        out.append((key, kind, shape, dtype, mesh_shape, placements))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_each_ranks_slice_at_another_world_size_holds_the_saved_chunks_its_reads_need(seed, tmp_path):
    """A resume on another number of ranks, or another layout (FSDP's 4 -> 3, 6 -> 4, into 2D or
    hybrid sharding and back): each rank's part of the chunk index (save_plan.slices with the new
    layout) holds exactly the saved chunks its reads overlap, no other, and plans DCP's reads
    from the whole .metadata (the same ReadItems, index hints aside, naming the same records)."""
    world, _, plan, full, data = _indexed(seed, tmp_path)
    rng = random.Random(1000 + seed)
    again = random.Random(seed)  # the recipe `_indexed` saved
    assert again.choice([2, 3, 4, 6]) == world
    recipe = random_state(again, world)
    header, arrays = save_plan.read_index(data)
    new_world = rng.choice([w for w in (1, 2, 3, 4, 6, 8) if w != world])
    new = resharded(rng, recipe, new_world)
    states = [rank_state(new, rank, new_world) for rank in range(new_world)]
    now = save_plan.Chunks(save_plan.describe(states[0], new_world), new_world)
    shared, own_items, parts = save_plan.slices(header, arrays, now, new_world)
    assert len(shared.item) == sum(i["kind"] == "bytes" for i in header["items"]), "only values go to every rank"
    for rank in range(new_world):
        mine = save_plan.metadata_of(header, shared, own_items, parts[rank], now, rank)
        ours, theirs = (_load_plan(states[rank], md) for md in (mine, full))
        assert _without_hints(ours) == _without_hints(theirs), rank
        for item in ours:
            assert mine.storage_data[item.storage_index] == full.storage_data[item.storage_index]
        read = {
            (i.storage_index.fqn, tuple(i.storage_index.offset)) for i in theirs if i.storage_index.offset is not None
        }
        held = {
            (fqn, tuple(c.offsets)) for fqn, md in mine.state_dict_metadata.items() for c in getattr(md, "chunks", [])
        }
        empty = {(fqn, tuple(c.offsets)) for fqn, md in mine.state_dict_metadata.items()
                 for c in getattr(md, "chunks", []) if 0 in c.sizes}  # fmt: skip
        assert read <= held and held - read <= empty, f"rank {rank} holds the chunks it reads and no other"


def test_overlaps_are_dcps_pairs_on_random_chunks():
    """save_plan.overlaps finds every pair of chunks DCP's overlap test passes, and only those, on
    random chunk tables of 1 to 3 dimensions, empty chunks and duplicates included."""
    import numpy as np
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.resharding import _check_shard_metadata_pair_overlap

    rng = np.random.default_rng(0)
    for _ in range(200):
        ndim = int(rng.integers(0, 4))
        saved_o, saved_s, o, s = (rng.integers(0, 6, (int(rng.integers(0, 8)), ndim)) for _ in range(4))
        saved_s = saved_s[: len(saved_o)] if len(saved_s) >= len(saved_o) else rng.integers(0, 6, saved_o.shape)
        s = s[: len(o)] if len(s) >= len(o) else rng.integers(0, 6, o.shape)
        chunk, saved = save_plan.overlaps(saved_o, saved_s, o, s)
        want = [
            (i, j)
            for i in range(len(o))
            for j in range(len(saved_o))
            if _check_shard_metadata_pair_overlap(
                ChunkStorageMetadata(torch.Size(o[i]), torch.Size(s[i])),
                ChunkStorageMetadata(torch.Size(saved_o[j]), torch.Size(saved_s[j])),
            )
        ]
        assert list(zip(chunk.tolist(), saved.tolist())) == want


def _same_chunk_sets(a, b) -> bool:
    return all(
        sorted(map(repr, getattr(a.state_dict_metadata[k], "chunks", [])))
        == sorted(map(repr, getattr(b.state_dict_metadata[k], "chunks", [])))
        for k in b.state_dict_metadata
    )


def _load_plan(state: dict, metadata) -> list:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(dict(state), metadata, is_coordinator=False)
    return planner.create_local_plan().items


def _without_hints(items) -> list:
    return sorted(
        (i.dest_index.fqn, tuple(i.dest_index.offset or ()), tuple(i.storage_index.offset or ()), tuple(i.dest_offsets),
         tuple(i.storage_offsets), tuple(i.lengths))
        for i in items
    )  # fmt: skip


def _rewrite(data: bytes, **changes) -> bytes:
    """The index `data` with some of its arrays replaced (as a forged or damaged file would be)."""
    import io

    import numpy as np

    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    arrays.update(changes)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def test_an_index_that_could_carry_code_or_points_outside_is_refused(tmp_path):
    """Whatever a chunk index holds, reading it runs no code and names nothing outside its folder:
    an object array (a pickle inside the npz), a file name with a path, a chunk outside its
    tensor, a missing array, and bytes that are no npz: each one BadIndex, naming what is wrong."""
    import json

    import numpy as np

    *_, data = _indexed(0, tmp_path)
    header, arrays = save_plan.read_index(data)
    tensor = next(t for t, i in enumerate(header["items"]) if i["kind"] == "tensor")
    table = header["items"][tensor]["chunks"]
    forged_header = dict(header, files=["../../etc/passwd", *header["files"][1:]])
    cases = {
        "an object array": _rewrite(data, **{f"p{tensor}": np.array([object()] * len(arrays[f"p{tensor}"]))}),
        "a path": _rewrite(data, header=np.frombuffer(json.dumps(forged_header).encode(), dtype=np.uint8)),
        "a chunk outside": _rewrite(data, **{f"o{table}": arrays[f"o{table}"] + 10**6}),
        "no storage": _rewrite(data, **{f"l{tensor}": np.zeros(0, np.int64)}),
        "no npz": b"\x80\x04not an npz",
    }
    for what, forged in cases.items():
        with pytest.raises(save_plan.BadIndex):
            save_plan.read_index(forged)
        assert what


def test_a_chunk_index_changed_after_the_commit_makes_the_checkpoint_unreadable(tmp_path, capsys):
    """One rank saves (planned from the layout: chunks.npz written, and .metadata before the commit:
    `python -m trainer.checkpoint.stock` does not write it again where it is lost). A byte of
    chunks.npz changed, its size kept:
    the checkpoint is unusable with one line naming chunks.npz, the command refuses to write
    .metadata from it in one line, and a resume from it stops with that line before any rank reads
    a shard (it reads chunks.npz, not .metadata)."""
    from tests.helpers.checkpoints import small_parts, small_step
    from trainer.checkpoint import manager, stock

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, optimizer, scheduler = small_parts(0)
    small_step(model, optimizer, scheduler)
    ckpt = manager.Checkpointer(
        manager.CheckpointArgs(keep=0),
        str(tmp_path),
        0,
        1,
        dist.group.WORLD,
        model,
        optimizer,
        {"scheduler": scheduler},
    )
    ckpt.save(1, {"samples": 3}, blocking=True)
    ckpt.close()
    assert ckpt.planned_by == "layout"
    path = manager.step_path(str(tmp_path), 1)
    assert manager.unusable(path) is None
    # .metadata written before the commit (a small save), then lost: not written again (its manifest records it)
    metadata = os.path.join(path, ".metadata")
    kept = open(metadata, "rb").read()
    os.unlink(metadata)
    assert stock.main([path]) == 2
    assert capsys.readouterr().err == (
        f"trainer.checkpoint.stock: {path}: its .metadata was written at its commit (its manifest lists it) and is "
        "missing: restore it from a copy of the checkpoint\n"
    )
    with open(metadata, "wb") as f:
        f.write(kept)
    index = os.path.join(path, save_plan.INDEX)
    data = bytearray(open(index, "rb").read())
    data[len(data) // 2] ^= 0x01
    with open(index, "wb") as f:
        f.write(data)
    assert manager.unusable(path) == "chunks.npz is damaged: it is not what the commit wrote"
    os.unlink(metadata)
    assert stock.main([path]) == 2
    assert capsys.readouterr().err == (
        f"trainer.checkpoint.stock: {path}: chunks.npz is damaged: it is not what the commit wrote; its .metadata "
        "cannot be written from it\n"
    )
    assert not os.path.exists(metadata)
    with open(metadata, "wb") as f:
        f.write(kept)
    model2, optimizer2, scheduler2 = small_parts(1)
    reader = manager.Checkpointer(
        manager.CheckpointArgs(keep=0, resume_from=path),
        str(tmp_path / "other"),
        0,
        1,
        dist.group.WORLD,
        model2,
        optimizer2,
        {"scheduler": scheduler2},
    )
    with pytest.raises(manager.CheckpointError, match="chunks.npz is damaged"):
        reader.load()
