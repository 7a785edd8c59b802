"""Save plans without a gather: every rank computes the same global plan from the layout alone.

DCP's DefaultSavePlanner gathers every rank's SavePlan on the coordinator, deduplicates the items
that several ranks hold, builds the metadata's chunk lists and scatters a plan back to each rank:
at 16,384 ranks for the Llama-3.1-8B state (bench/scale.py) 4.5 GB of plans sent to rank 0 and about
17 minutes before the first byte is written. With FSDP2 and TP the layout is a function of the world
size, the shapes and the placements: each rank knows every rank's chunk of every DTensor from its
mesh and placements (DTensor's own rule, `chunk_table`), a plain tensor or a non-tensor value is held
by every rank. So each rank plans here by itself, as DCP's coordinator would:

  `describe`    the state's items in plan order: fqn, kind, properties, global size and, for a
                DTensor, the key of its layout (shape, mesh, placements), the same on every rank
  `GlobalPlan`  DCP's dedup (dedup_save_plans: each item held by several ranks kept by the one whose
                plan is smallest so far, in the order DCP meets them), simulated on arrays: per item
                the ranks that write its chunks, in rank order, as create_default_global_save_plan
                lists them in the metadata
  `Planner`     a DefaultSavePlanner that sends the coordinator an empty plan (DCP's "unchanged
                plan" of its plan cache) and finishes with its own deduplicated plan

Ranks agree on the layout before they plan this way, by one all-reduce of `Layout.digest` (the
checkpointer's `_planner`); a state this module cannot describe (a ShardedTensor, a DTensor on a
mesh that is not the whole group, a rank whose state has other keys) is planned by DCP's own
planner. tests/{unit,system}/test_save_plan.py compares the plans and the metadata with DCP's on random layouts:
FSDP's uneven Shard(0), 2D (dp x tp, FSDP2's _StridedShard), hybrid sharding (replicated shards).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import zipfile
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from trainer import torch_compat
from trainer.checkpoint.checksums import ChecksumWriter
from trainer.rundir.files import open_regular, write_bytes


@dataclass(frozen=True)
class Item:
    """One value of the flattened state, as every rank plans it."""

    fqn: str
    kind: WriteItemType
    size: torch.Size | None  # the global size (None: a non-tensor value, written as bytes)
    properties: TensorProperties | None
    layout: tuple | None  # a DTensor's (global shape, mesh shape, placements): `chunk_table`'s key
    ranks: tuple[int, ...] | None  # the group rank at each mesh coordinate, row-major (None: the same)


@functools.lru_cache(maxsize=256)
def chunk_table(layout: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes), each [mesh coordinates, ndim] in row-major mesh order: every coordinate's
    chunk of a DTensor of `layout` (global shape, mesh shape, placements), by DTensor's own rule
    (compute_local_shape_and_global_offset). One mesh dimension of Shard(d) is done on arrays, as
    Shard's rule (torch.chunk's split); anything else by DTensor's function per coordinate."""
    shape, mesh_shape, placements = layout
    count = math.prod(mesh_shape)
    ndim = len(shape)
    offsets = np.zeros((count, ndim), dtype=np.int64)
    sizes = np.tile(np.asarray(shape, dtype=np.int64), (count, 1))
    if len(mesh_shape) == 1 and type(placements[0]).__name__ == "Shard":
        d, n = placements[0].dim, mesh_shape[0]
        full = -(-shape[d] // n)  # ceil
        starts = np.arange(n, dtype=np.int64) * full
        offsets[:, d] = np.minimum(starts, shape[d])
        sizes[:, d] = np.clip(shape[d] - starts, 0, full)
        return offsets, sizes
    if all(type(p).__name__ == "Replicate" for p in placements):
        return offsets, sizes
    for i, coordinate in enumerate(np.ndindex(*mesh_shape)):
        size, offset = torch_compat.chunk_at(shape, mesh_shape, list(coordinate), placements)
        sizes[i], offsets[i] = size, offset
    return offsets, sizes


@functools.lru_cache(maxsize=256)
def _layout_problem(layout: tuple) -> str | None:
    shape, _, _ = layout
    offsets, sizes = chunk_table(layout)
    offsets, first = np.unique(offsets, axis=0, return_index=True)
    sizes = sizes[first]
    full = np.asarray(shape, dtype=np.int64)
    if len(shape) and ((offsets < 0).any() or (offsets + sizes > full).any()):
        return f"a chunk lies outside the tensor of size {tuple(shape)}"
    if len(shape) == 0:
        return None
    filled = np.prod(sizes, axis=1) > 0
    offsets, sizes = offsets[filled], sizes[filled]
    ends = offsets + sizes
    varying = [d for d in range(len(shape)) if len(np.unique(offsets[:, d])) > 1 or len(np.unique(sizes[:, d])) > 1]
    if len(varying) <= 1:  # chunks along one dimension: sorted, each ends where the next may start
        d = varying[0] if varying else 0
        order = np.argsort(offsets[:, d], kind="stable")
        overlap = (ends[order[:-1], d] > offsets[order[1:], d]).any()
    else:  # pairwise, in blocks
        overlap = False
        for i in range(0, len(offsets), 1024):
            a0, a1 = offsets[i : i + 1024, None, :], ends[i : i + 1024, None, :]
            hit = ((a0 < ends[None]) & (offsets[None] < a1)).all(axis=2)
            hit[np.arange(len(a0)), np.arange(i, i + len(a0))] = False
            if hit.any():
                overlap = True
                break
    if overlap:
        return "its chunks overlap (DTensor's chunk of each rank cannot describe this sharding)"
    if int(np.prod(sizes, axis=1).sum()) != math.prod(shape):
        return f"its chunks hold {int(np.prod(sizes, axis=1).sum())} elements, the tensor {math.prod(shape)}"
    return None


@functools.lru_cache(maxsize=256)
def _distinct(layout: tuple | None, ranks: tuple | None, world: int, size) -> tuple:
    """(each rank's chunk, the distinct chunks' offsets and sizes, how many ranks hold each, the
    first rank holding each) of an item of `layout` on the mesh `ranks` (None: mesh order is rank
    order), the chunks numbered by the first rank holding them. DCP tells chunks apart by their
    offsets (MetadataIndex): the empty chunks of an uneven split, all at the end, are one item."""
    if layout is None:  # held by every rank, one chunk: the whole value
        ndim = len(size) if size is not None else 0
        sizes = np.asarray(list(size) if size is not None else [], dtype=np.int64).reshape(1, ndim)
        return (
            np.zeros(world, dtype=np.int64),
            np.zeros((1, ndim), dtype=np.int64),
            sizes,
            np.asarray([world]),
            np.zeros(1, np.int64),
        )
    offsets, sizes = chunk_table(layout)
    if ranks is not None:
        by_rank_off, by_rank_size = np.empty_like(offsets), np.empty_like(sizes)
        by_rank_off[list(ranks)], by_rank_size[list(ranks)] = offsets, sizes
        offsets, sizes = by_rank_off, by_rank_size
    distinct, first, chunk_of = np.unique(offsets, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first)  # chunks numbered by the first rank holding them
    renumber = np.empty_like(order)
    renumber[order] = np.arange(len(order))
    chunk_of = renumber[chunk_of.reshape(-1)]
    return chunk_of, distinct[order], sizes[first[order]], np.bincount(chunk_of, minlength=len(order)), first[order]


def describe(state_dict: dict, world: int) -> list[Item] | None:
    """The items of a flattened state dict in DCP's plan order, or None where this module cannot
    plan it (DCP's planner then does): a value that is neither a DTensor (on a mesh of all `world`
    ranks of the group, every rank once), a plain tensor, nor a non-tensor value."""
    items = []
    for fqn, obj in state_dict.items():
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
            if len(ranks) != world or sorted(ranks) != list(range(world)) or mesh.get_coordinate() is None:
                return None
            ranks = None if ranks == tuple(range(world)) else ranks
            if any(p.is_partial() for p in obj.placements) or hasattr(
                torch_compat.local_tensor(obj), "__create_write_items__"
            ):
                return None
            layout = (tuple(obj.shape), tuple(mesh.mesh.shape), tuple(obj.placements))
            props = TensorProperties.create_from_tensor(obj.to_local())
            items.append(Item(fqn, WriteItemType.SHARD, obj.size(), props, layout, ranks))
        elif type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
            props = TensorProperties.create_from_tensor(obj)
            items.append(Item(fqn, WriteItemType.TENSOR, obj.size(), props, None, None))
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            return None  # a ShardedTensor or another checkpointable tensor: DCP's own planning
        else:
            items.append(Item(fqn, WriteItemType.BYTE_IO, None, None, None, None))
    return items


def digest(items: list[Item] | None) -> int:
    """A 63-bit digest of the layout every rank must share to plan alike (0: none to plan by)."""
    if items is None:
        return 0
    h = hashlib.blake2b(digest_size=8)
    for item in items:
        h.update(repr((item.fqn, item.kind.value, item.size, item.properties, item.layout, item.ranks)).encode())
    return int.from_bytes(h.digest(), "little") >> 1 or 1


class GlobalPlan:
    """DCP's global save plan of `items` over `world` ranks, as arrays: per item, each rank's chunk
    (an index into the item's distinct chunks), and which rank writes each chunk.

    DCP meets the items rank by rank, each rank's in plan order, and an item the first time it
    meets it (the first rank that holds it); one that several ranks hold goes to the one whose
    plan is smallest so far (the bytes of its items' whole tensors, 1 for a non-tensor value), the first
    in the iteration order of a Python set of those ranks where several are as small. A rank's
    plan grows when DCP meets an item it alone holds, so the sizes that decide are known only in
    that order: the ranks are walked in order, each rank's items only where it meets an item it
    shares (rank 0 for the plain tensors, the first rank of an empty chunk's or a replicated
    shard's holders), otherwise its own items' bytes added at once."""

    def __init__(self, items: list[Item], world: int):
        self.items, self.world = items, world
        self.chunk_of: list[np.ndarray] = []  # per item: each rank's chunk (index into `offsets`)
        self.offsets: list[np.ndarray] = []  # per item: its distinct chunks' offsets, [chunks, ndim]
        self.sizes: list[np.ndarray] = []  # per item: their sizes
        self.writer: list[np.ndarray] = []  # per item: the rank writing each chunk
        self._plan()

    def _plan(self) -> None:
        world, n_items = self.world, len(self.items)
        holders, first_holder, stored = [], [], []  # per item: ranks holding each chunk, the first; its bytes
        for item in self.items:
            if item.layout is not None:
                self._check(item)
            chunk_of, offsets, sizes, counts, first = _distinct(item.layout, item.ranks, world, item.size)
            self.chunk_of.append(chunk_of)
            self.offsets.append(offsets)
            self.sizes.append(sizes)
            holders.append(counts)
            first_holder.append(first)
            # DCP counts an item by its whole tensor's bytes (WriteItem.tensor_storage_size: the global
            # size's), not its chunk's; 1 for a non-tensor value or an empty tensor
            elsize = torch.empty((), dtype=item.properties.dtype).element_size() if item.properties else 0
            stored.append((math.prod(item.size) * elsize if item.properties is not None else 0) or 1)
        shared_first = np.zeros(world, dtype=bool)  # ranks that meet first an item they share
        own_bytes = np.zeros(world, dtype=np.int64)  # bytes of the items a rank alone holds
        alone_by_layout: dict[int, np.ndarray] = {}
        for t in range(n_items):
            key = id(self.chunk_of[t])  # items of one layout share their arrays
            alone = alone_by_layout.get(key)
            if alone is None:
                alone = alone_by_layout[key] = holders[t][self.chunk_of[t]] == 1
                shared_first[first_holder[t][holders[t] > 1]] = True
            own_bytes += alone * stored[t]
        writer = []
        for t in range(n_items):
            w = np.where(holders[t] == 1, first_holder[t], -1)
            writer.append(w)
        plan_size = [0] * world
        for r in range(world):
            if not shared_first[r]:
                plan_size[r] += int(own_bytes[r])
                continue
            for t in range(n_items):
                c = int(self.chunk_of[t][r])
                if holders[t][c] == 1:
                    plan_size[r] += stored[t]
                elif first_holder[t][c] == r:
                    if holders[t][c] == world:  # {0..N-1}: a set iterates it in order, min takes the first least
                        chosen = int(np.argmin(plan_size))
                    else:
                        chosen = min(set(np.flatnonzero(self.chunk_of[t] == c).tolist()), key=plan_size.__getitem__)
                    writer[t][c] = chosen
                    plan_size[chosen] += stored[t]
        self.writer = writer
        self.plan_size = plan_size

    @staticmethod
    def _check(item: Item) -> None:
        """DCP's validation of the global plan (_validate_global_plan) on arrays: every chunk inside
        the tensor, no two overlapping (an uneven _StridedShard's, which DTensor's one chunk per rank
        cannot describe), and as many elements as the tensor's. Once per layout (cached)."""
        why = _layout_problem(item.layout)
        if why:
            raise ValueError(f"{item.fqn}: {why}; DCP's planner refuses this layout too")

    def writes(self, t: int, rank: int) -> bool:
        """Whether `rank` writes its chunk of item `t`."""
        return int(self.writer[t][self.chunk_of[t][rank]]) == rank

    def hint(self, t: int, rank: int) -> int:
        """The position of `rank`'s chunk of item `t` in the metadata's chunk list (DCP's index hint):
        the chunks are listed by their writer's rank."""
        return int(np.count_nonzero(self.writer[t] < rank))

    def final_plan(self, plan: SavePlan, rank: int) -> SavePlan:
        """`rank`'s own plan (DCP's create_local_plan, one item per value in plan order) as DCP's
        global plan hands it back: the items another rank writes dropped, index hints rewritten."""
        if len(plan.items) != len(self.items):
            raise ValueError(f"rank {rank}'s plan has {len(plan.items)} items, the layout {len(self.items)}")
        kept = []
        for t, item in enumerate(plan.items):
            if self.writes(t, rank):
                if item.type != WriteItemType.BYTE_IO:
                    item = dataclasses.replace(item, index=dataclasses.replace(item.index, index=self.hint(t, rank)))
                kept.append(item)
        return dataclasses.replace(plan, items=kept)

    def chunk_sizes(self, t: int) -> tuple[list, list]:
        """Item `t`'s chunks' offsets and sizes as torch.Size, one object per chunk shared by every
        item of its layout (and by .metadata's chunk lists and storage keys: pickled once each)."""
        cache = self.__dict__.setdefault("_sizes", {})
        key = id(self.offsets[t])
        if key not in cache:
            cache[key] = (
                [torch.Size(o) for o in self.offsets[t].tolist()],
                [torch.Size(z) for z in self.sizes[t].tolist()],
            )
        return cache[key]

    def chunk_count(self) -> int:
        """The records of the plan's metadata: every item's distinct chunks (a value: one)."""
        return sum(len(o) for o in self.offsets)

    def chunk_order(self, t: int) -> np.ndarray:
        """Item `t`'s chunks in the metadata's order (by their writer's rank)."""
        return np.argsort(self.writer[t], kind="stable")

    def metadata(self, planner_data=None) -> Metadata:
        """DCP's Metadata of the global plan (state_dict_metadata and planner_data; storage_data is
        the writers'), every chunk a ChunkStorageMetadata: for .metadata, which stock DCP reads."""
        md = {}
        # in the order DCP meets them: by the first rank writing one of their chunks, then plan order
        first_writer = [int(self.writer[t].min()) for t in range(len(self.items))]
        for t in sorted(range(len(self.items)), key=lambda t: (first_writer[t], t)):
            item = self.items[t]
            if item.kind == WriteItemType.BYTE_IO:
                md[item.fqn] = BytesStorageMetadata()
                continue
            offsets, sizes = self.chunk_sizes(t)
            chunks = [ChunkStorageMetadata(offsets=offsets[c], sizes=sizes[c]) for c in self.chunk_order(t).tolist()]
            md[item.fqn] = TensorStorageMetadata(properties=item.properties, size=item.size, chunks=chunks)
        return Metadata(state_dict_metadata=md, planner_data=planner_data)


class Planner(DefaultSavePlanner):
    """DCP's DefaultSavePlanner planning by `GlobalPlan`: each rank sends the coordinator an empty
    plan (no gather of plans), the coordinator answers with empty plans and a small Metadata whose
    planner_data carries the layout (what the storage writer's finish needs to write the metadata
    files), and each rank finishes with its own share of the global plan. Every rank must have
    agreed on `items` (its `digest`) before: the checkpointer's one all-reduce."""

    def __init__(self, items: list[Item], rank: int, world: int, **kwargs):
        super().__init__(**kwargs)
        self.items, self.rank, self.world = items, rank, world
        self.global_plan_arrays: GlobalPlan | None = None

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # this rank's items (its DTensors' chunks), DCP's own
        self.global_plan_arrays = _plan_of(self.items, self.world)
        self.own_plan = self.global_plan_arrays.final_plan(plan, self.rank)
        return SavePlan([], usable=False)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if len(all_plans) != self.world:
            raise ValueError(f"{len(all_plans)} plans for a layout of {self.world} ranks")
        carrier = Metadata(state_dict_metadata={}, planner_data=Layout(self.global_plan_arrays, self.mappings))
        self.metadata = carrier
        return [SavePlan([], usable=False) for _ in all_plans], carrier

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = dataclasses.replace(self.own_plan, storage_data=new_plan.storage_data)
        return self.plan


_LAST_PLAN: dict[tuple[int, int], GlobalPlan] = {}  # the last layout's plan in this process: the next save's


def _plan_of(items: list[Item], world: int) -> GlobalPlan:
    """GlobalPlan(items, world), kept for the next save of the same layout (its digest) in this
    process (the trainer's, or DCP's async save process), as DCP's plan cache keeps its plans."""
    key = (digest(items), world)
    if key not in _LAST_PLAN:
        _LAST_PLAN.clear()
        _LAST_PLAN[key] = GlobalPlan(items, world)
    return _LAST_PLAN[key]


@dataclass
class Layout:
    """What the coordinator hands the storage writer's finish in place of the metadata: the global
    plan's arrays and the flattening's mappings (DCP's planner_data)."""

    plan: GlobalPlan
    mappings: dict

    def metadata(self) -> Metadata:
        return self.plan.metadata(planner_data=self.mappings)

    def write_results(self, rank: int, written) -> list:
        return _write_results(self.plan, rank, written)


@dataclass
class Written:
    """One rank's write results, compact: for each item it wrote, its position in the layout, its
    file (an index into `files`), offset and length. What the coordinator gathers in place of DCP's
    WriteResults (a WriteResult, MetadataIndex and _StorageInfo per item, pickled one by one)."""

    files: list[str]
    item: np.ndarray  # int32
    file: np.ndarray  # int32
    offset: np.ndarray  # int64
    length: np.ndarray  # int64
    size_in_bytes: np.ndarray  # int64


class IndexWriter(ChecksumWriter):
    """The trainer's ChecksumWriter for a save planned by `Planner`: each rank returns its write
    results compact (`Written`), and the coordinator's finish writes DCP's `.metadata`, built from
    the global plan's arrays and those results, for stock DCP and the trainer's reader alike."""

    # .metadata before the commit whatever the save's size: an s3:// run dir's saves (trainer/checkpoint/
    # stock.py says why); else a save past METADATA_BEFORE_COMMIT chunk records commits without it.
    metadata_first = False

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        position = {item.fqn: t for t, item in enumerate(planner.items)}
        infos = [r.storage_data for r in results]
        if any(getattr(i, "transform_descriptors", None) for i in infos):
            return future  # a storage transform this module does not record: DCP's own results
        files = sorted({i.relative_path for i in infos})
        file_of = {name: n for n, name in enumerate(files)}
        written = Written(
            files=files,
            item=np.asarray([position[r.index.fqn] for r in results], dtype=np.int32),
            file=np.asarray([file_of[i.relative_path] for i in infos], dtype=np.int32),
            offset=np.asarray([i.offset for i in infos], dtype=np.int64),
            length=np.asarray([i.length for i in infos], dtype=np.int64),
            size_in_bytes=np.asarray([r.size_in_bytes for r in results], dtype=np.int64),
        )
        done = torch.futures.Future()
        done.set_result(written)
        return done

    def finish(self, metadata: Metadata, results: list) -> None:
        layout = metadata.planner_data
        if not isinstance(layout, Layout):  # planned by DCP's own planner
            return super().finish(metadata, results)
        plan = layout.plan
        if all(isinstance(r, Written) for r in results):
            files, rows = storage_rows(plan, results)
            write_index(self.path, plan, layout.mappings, files, rows)
            if plan.chunk_count() > METADATA_BEFORE_COMMIT and not self.metadata_first:  # after the commit: stock.py
                metadata.planner_data = None
                return
        full = layout.metadata()
        super().finish(full, [layout.write_results(rank, r) for rank, r in enumerate(results)])
        metadata.planner_data = None  # DCP hands what finish had to every rank: not the plan's arrays


def _write_results(plan: GlobalPlan, rank: int, written) -> list:
    """DCP's WriteResults of `rank` from its compact `Written` (or its WriteResults as they are)."""
    if not isinstance(written, Written):
        return written
    info = torch_compat.storage_info_class()
    out = []
    for t, f, offset, length, size in zip(
        written.item.tolist(),
        written.file.tolist(),
        written.offset.tolist(),
        written.length.tolist(),
        written.size_in_bytes.tolist(),
    ):
        item = plan.items[t]
        if item.kind == WriteItemType.BYTE_IO:
            index = MetadataIndex(item.fqn)
        else:
            index = MetadataIndex(item.fqn, plan.chunk_sizes(t)[0][plan.chunk_of[t][rank]])
        out.append(WriteResult(index=index, size_in_bytes=size, storage_data=info(written.files[f], offset, length)))
    return out


# ---------------------------------------------------------------------------------------------------
# The chunk index: DCP's metadata as arrays, beside .metadata

INDEX = "chunks.npz"  # in the checkpoint folder, listed in its manifest like every file
# The most chunk records (GlobalPlan.chunk_count) whose .metadata a save writes before its commit, as
# DCP does: about 1.5 s of building and pickling DCP's objects on the project's 2-core VM (15 us a
# record; the Llama-3.1-8B state has 1164 records a rank: up to 85 ranks). A larger save commits
# with chunks.npz alone, which the trainer's loads read, and .metadata, which stock DCP reads, is
# written after the commit from chunks.npz by a background process (trainer/checkpoint/stock.py):
# at 16,384 ranks its 19M records took about 291 s, which delayed every commit by as much.
METADATA_BEFORE_COMMIT = 100_000
INDEX_VERSION = 1
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}  # fmt: skip


def storage_rows(plan: GlobalPlan, results: list) -> tuple[list[str], list[tuple]]:
    """(files, per item (file, offset, length) arrays over its chunks in the plan's numbering) of
    every rank's compact write results (`Written`, in rank order), without an object per chunk."""
    files: dict[str, int] = {}
    item, rank, file, offset, length = [], [], [], [], []
    for r, w in enumerate(results):
        remap = np.asarray([files.setdefault(name, len(files)) for name in w.files], dtype=np.int32)
        item.append(w.item)
        rank.append(np.full(len(w.item), r, dtype=np.int64))
        file.append(remap[w.file] if len(w.file) else w.file)
        offset.append(w.offset)
        length.append(w.length)
    item, rank, file, offset, length = (np.concatenate(x) for x in (item, rank, file, offset, length))
    order = np.argsort(item, kind="stable")
    bounds = np.searchsorted(item[order], np.arange(len(plan.items) + 1))
    rows = []
    for t in range(len(plan.items)):
        at = order[bounds[t] : bounds[t + 1]]
        chunks = plan.chunk_of[t][rank[at]]
        n = len(plan.offsets[t])
        f, p, ln = np.full(n, -1, np.int32), np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        f[chunks], p[chunks], ln[chunks] = file[at], offset[at], length[at]
        if (f < 0).any():
            raise ValueError(f"{plan.items[t].fqn}: a chunk no rank wrote")
        rows.append((f, p, ln))
    return list(files), rows


def rows_of_storage(plan: GlobalPlan, storage: dict) -> tuple[list[str], list[tuple]]:
    """storage_rows' answer from DCP's storage records (MetadataIndex -> _StorageInfo)."""
    files: dict[str, int] = {}
    rows = []
    for t, item in enumerate(plan.items):
        if item.kind == WriteItemType.BYTE_IO:
            keys = [MetadataIndex(item.fqn)]
        else:
            keys = [MetadataIndex(item.fqn, torch.Size(o)) for o in plan.offsets[t].tolist()]
        infos = [storage[k] for k in keys]
        rows.append(
            (
                np.asarray([files.setdefault(i.relative_path, len(files)) for i in infos], np.int32),
                np.asarray([i.offset for i in infos], dtype=np.int64),
                np.asarray([i.length for i in infos], dtype=np.int64),
            )
        )
    return list(files), rows


def write_index(folder: str, plan: GlobalPlan, mappings: dict, files: list[str], rows: list[tuple]) -> None:
    """`folder`/chunks.npz: the global plan's chunks and where each lies (`rows`: per item its
    chunks' file (an index into `files`), offset and length), as numeric arrays and one JSON header
    in NumPy's npz (a zip of .npy files, read with allow_pickle=False: nothing in it can carry
    code). The chunk tables (o<k>, s<k>: offsets and sizes) once per layout, each tensor naming
    its own ("chunks"); per item f<t>, p<t>, l<t>. What a load reads in place of .metadata
    (`read_index`, `slices`)."""
    tables: dict[int, int] = {}
    arrays: dict[str, np.ndarray] = {}
    items = []
    for t, item in enumerate(plan.items):
        if item.kind == WriteItemType.BYTE_IO:
            items.append({"fqn": item.fqn, "kind": "bytes"})
        else:
            p = item.properties
            dtype = str(p.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise ValueError(f"{item.fqn}: dtype {p.dtype} is not one the chunk index records")
            table = tables.setdefault(id(plan.offsets[t]), len(tables))  # items of one layout share it
            arrays[f"o{table}"], arrays[f"s{table}"] = plan.offsets[t], plan.sizes[t]
            items.append({"fqn": item.fqn, "kind": "tensor", "size": list(item.size), "dtype": dtype,
                          "requires_grad": bool(p.requires_grad), "chunks": table})  # fmt: skip
        arrays[f"f{t}"], arrays[f"p{t}"], arrays[f"l{t}"] = rows[t]
    header = {
        "version": INDEX_VERSION,
        "items": items,
        "files": files,
        "mappings": {k: list(v) for k, v in mappings.items()},
    }
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    data = io.BytesIO()
    np.savez(data, **arrays)
    write_bytes(os.path.join(folder, INDEX), data.getbuffer())  # trainer/rundir/files.py: no link followed, atomic


class BadIndex(ValueError):
    """A chunk index that is not what write_index writes."""


def read_index(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of a chunk index's bytes (already checked against the manifest by the
    caller), every array's type and shape checked against the header: a damaged or forged index
    raises BadIndex naming what is wrong, never runs code (allow_pickle=False)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
        header = json.loads(arrays.pop("header").tobytes())
    except (OSError, ValueError, KeyError, UnicodeDecodeError, zipfile.BadZipFile) as e:
        raise BadIndex(f"{INDEX} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict) or header.get("version") != INDEX_VERSION:
        raise BadIndex(f"{INDEX} is not version {INDEX_VERSION} of the chunk index")
    files = header.get("files")
    if not isinstance(files, list) or not all(
        isinstance(n, str) and os.path.basename(n) == n and n not in ("", ".", "..") for n in files
    ):
        raise BadIndex(f"{INDEX} names a shard file outside its folder")
    items = header.get("items")
    if not isinstance(items, list) or not isinstance(header.get("mappings"), dict):
        raise BadIndex(f"{INDEX} has no item list")
    for t, item in enumerate(items):
        where = f"{INDEX} item {t}"
        if not isinstance(item, dict) or not isinstance(item.get("fqn"), str):
            raise BadIndex(f"{where} is not an item")
        storage = [arrays.get(f"{k}{t}") for k in "fpl"]
        if any(a is None or a.ndim != 1 or a.dtype.kind != "i" for a in storage) or len({len(a) for a in storage}) != 1:
            raise BadIndex(f"{where} ({item['fqn']}) has no storage records")
        n = len(storage[0])
        if n and (
            storage[0].min() < 0 or storage[0].max() >= len(files) or min(storage[1].min(), storage[2].min()) < 0
        ):
            raise BadIndex(f"{where} ({item['fqn']}) names a file or range that is not there")
        if item.get("kind") == "bytes":
            if n != 1:
                raise BadIndex(f"{where} ({item['fqn']}) is a value with {n} records")
            continue
        size = item.get("size")
        if item.get("kind") != "tensor" or item.get("dtype") not in _DTYPES or not isinstance(size, list):
            raise BadIndex(f"{where} ({item['fqn']}) is neither a tensor nor a value")
        if not all(isinstance(d, int) and d >= 0 for d in size):
            raise BadIndex(f"{where} ({item['fqn']}) has size {size}")
        table = item.get("chunks")
        if not isinstance(table, int) or isinstance(table, bool):
            raise BadIndex(f"{where} ({item['fqn']}) names no chunk table")
        offsets, sizes = arrays.get(f"o{table}"), arrays.get(f"s{table}")
        want = (n, len(size))
        if offsets is None or sizes is None or offsets.shape != want or sizes.shape != want:
            raise BadIndex(f"{where} ({item['fqn']}) has no chunk table of {n} chunks")
        if n and ((offsets < 0).any() or (sizes < 0).any() or (offsets + sizes > np.asarray(size, np.int64)).any()):
            raise BadIndex(f"{where} ({item['fqn']}) has a chunk outside the tensor")
    return header, arrays


@dataclass
class Slice:
    """Records of a chunk index: per row the item, the chunk's offsets and sizes (padded to the
    widest tensor's dimensions), its file, offset and length; `rows` [n, 2 x ndim + 3] int64."""

    item: np.ndarray  # int64 [n]
    rows: np.ndarray  # int64 [n, 2 * ndim + 3]: offsets, sizes, file, offset, length


class Chunks:
    """Every rank's chunk of each item of a layout, without the dedup (what `slices` compares the
    saved chunks with): GlobalPlan's chunk_of, offsets and sizes."""

    def __init__(self, items: list[Item], world: int):
        self.items = items
        found = [_distinct(i.layout, i.ranks, world, i.size) for i in items]
        self.chunk_of = [f[0] for f in found]
        self.offsets = [f[1] for f in found]
        self.sizes = [f[2] for f in found]


def overlaps(saved_offsets, saved_sizes, offsets, sizes) -> tuple[np.ndarray, np.ndarray]:
    """(chunk, saved chunk) of every pair of a chunk of (`offsets`, `sizes`) [k, ndim] and a saved
    chunk of (`saved_offsets`, `saved_sizes`) [m, ndim] that overlap by DCP's test (resharding's
    _check_shard_metadata_pair_overlap: in every dimension each starts before the other ends), by
    chunk, then saved chunk. Found as load_plan.py finds them: by binary search along the dimension
    of the most distinct saved starts, a saved chunk overlapping [a, b) starting in (a - longest, b);
    then the test in every dimension. A 0-d tensor's chunks all overlap, as DCP's sweep has it."""
    m, ndim = saved_offsets.shape
    k = len(offsets)
    if ndim == 0 or m == 0 or k == 0:
        return np.repeat(np.arange(k), m), np.tile(np.arange(m), k)
    dim = int(np.argmax([len(np.unique(saved_offsets[:, d])) for d in range(ndim)]))
    order = np.argsort(saved_offsets[:, dim], kind="stable")
    starts = saved_offsets[order, dim]
    longest = int(saved_sizes[:, dim].max())
    first = np.searchsorted(starts, offsets[:, dim] - longest, side="right")
    count = np.maximum(np.searchsorted(starts, offsets[:, dim] + sizes[:, dim], side="left") - first, 0)
    chunk = np.repeat(np.arange(k), count)
    saved = order[np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count - first, count)]
    hit = (
        (offsets[chunk] < saved_offsets[saved] + saved_sizes[saved])
        & (saved_offsets[saved] < offsets[chunk] + sizes[chunk])
    ).all(axis=1)
    chunk, saved = chunk[hit], saved[hit]
    by = np.lexsort((saved, chunk))
    return chunk[by], saved[by]


def slices(header: dict, arrays: dict, now: GlobalPlan | Chunks | None, world: int) -> tuple[Slice, np.ndarray, list]:
    """(what every rank gets, the items each rank gets one record of, each rank's own part) of a
    chunk index, each rank getting the records it plans its reads from and no others:

      - an item whose saved chunks are `now`'s (the current layout's, every rank's the same: the
        same world, shapes and placements): the record of the rank's own chunk, as file, offset
        and length (its offsets and sizes it knows: `metadata_of` takes them from `now`);
      - a tensor of `now` (by its name, of the same size) whose saved chunks differ (another world
        size, a layout that changed): the records of the saved chunks that overlap the rank's own
        chunk (`overlaps`), what DCP's load plan reads for it from the whole .metadata;
      - anything else (a value; a state `now` does not describe, or no `now`): every record, to
        every rank, as DCP's metadata would give them.

    Each rank's part is (an int64 array [own items, 3]: file, offset and length of its chunk of
    each; a Slice of its overlapping saved chunks)."""
    items = header["items"]
    ndim = max([len(i.get("size", ())) for i in items] + [1])
    columns = 2 * ndim + 3
    position = {item.fqn: t for t, item in enumerate(now.items)} if now is not None else {}
    own, overlapping, everyone = [], [], []
    for t, item in enumerate(items):
        current = position.get(item["fqn"])
        if current is not None and current == t and _same_chunks(item, arrays, now, t):
            own.append(t)
        elif current is not None and _same_tensor(item, now.items[current]):
            overlapping.append((t, current))
        else:
            everyone.append(t)

    def records(t: int, chunks) -> np.ndarray:
        """Item t's records of `chunks` (indices into its chunk table), [len, columns]."""
        out = np.zeros((len(chunks), columns), dtype=np.int64)
        item = items[t]
        if item["kind"] == "tensor" and len(item["size"]):
            d = len(item["size"])
            out[:, :d] = arrays[f"o{item['chunks']}"][chunks]
            out[:, ndim : ndim + d] = arrays[f"s{item['chunks']}"][chunks]
        out[:, 2 * ndim] = arrays[f"f{t}"][chunks]
        out[:, 2 * ndim + 1] = arrays[f"p{t}"][chunks]
        out[:, 2 * ndim + 2] = arrays[f"l{t}"][chunks]
        return out

    shared_items = [np.full(len(arrays[f"f{t}"]), t, dtype=np.int64) for t in everyone]
    shared_rows = [records(t, np.arange(len(arrays[f"f{t}"]))) for t in everyone]
    shared = Slice(
        np.concatenate(shared_items) if everyone else np.zeros(0, np.int64),
        np.concatenate(shared_rows) if everyone else np.zeros((0, columns), np.int64),
    )
    # of its own chunks a rank knows the offsets and sizes (`now`): only file, offset and length
    by_rank = np.empty((world, len(own), 3), dtype=np.int64)
    for j, t in enumerate(own):
        chunks = now.chunk_of[t]
        by_rank[:, j, 0] = arrays[f"f{t}"][chunks]
        by_rank[:, j, 1] = arrays[f"p{t}"][chunks]
        by_rank[:, j, 2] = arrays[f"l{t}"][chunks]
    overlapped = _overlapping(items, arrays, now, overlapping, world, columns)
    return shared, np.asarray(own, dtype=np.int64), list(zip(by_rank, overlapped))


def _overlapping(items: list, arrays: dict, now, pairs: list, world: int, columns: int) -> list[Slice]:
    """Each rank's Slice of the saved chunks of items `pairs` ((saved item, `now`'s item)) that
    overlap its own chunk of each, items in order; one array of every rank's rows, rank by rank
    (each rank's Slice a view of its part): nothing sorted or copied but the rows. The overlaps are
    found once per (saved chunk table, current layout): the items of one shape share them."""
    ndim = (columns - 3) // 2
    known: dict = {}  # key -> (every rank's saved chunks, rank by rank; how many a rank; its position; offsets, sizes)
    keys, counts = [], np.zeros((len(pairs), world), dtype=np.int64)
    for i, (t, c) in enumerate(pairs):
        table = items[t]["chunks"]
        key = (table, id(now.offsets[c]), id(now.chunk_of[c]))  # `now` holds them: their ids stay theirs
        if key not in known:
            saved_o, saved_s = arrays[f"o{table}"], arrays[f"s{table}"]
            chunk, saved = overlaps(saved_o, saved_s, now.offsets[c], now.sizes[c])
            bounds = np.searchsorted(chunk, np.arange(len(now.offsets[c]) + 1))  # each current chunk's pairs
            n = np.diff(bounds)[now.chunk_of[c]]
            within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            take = saved[within + np.repeat(bounds[now.chunk_of[c]], n)]
            shape = np.zeros((len(take), 2 * ndim), dtype=np.int64)
            d = saved_o.shape[1]
            shape[:, :d], shape[:, ndim : ndim + d] = saved_o[take], saved_s[take]
            known[key] = (take, n, within, shape)
        keys.append(key)
        counts[i] = known[key][1]
    ends = np.cumsum(counts.T.reshape(-1)).reshape(world, len(pairs))  # rank-major: rank r's items in order
    starts = ends - counts.T
    rows = np.empty((int(ends[-1, -1]) if len(pairs) and world else 0, columns), dtype=np.int64)
    item = np.empty(len(rows), dtype=np.int64)
    for i, (t, _) in enumerate(pairs):
        take, n, within, shape = known[keys[i]]
        where = np.repeat(starts[:, i], n) + within
        rows[where, : 2 * ndim] = shape
        for column, name in enumerate("fpl"):
            rows[where, 2 * ndim + column] = arrays[f"{name}{t}"][take]
        item[where] = t
    first = starts[:, 0] if len(pairs) else np.zeros(world, np.int64)
    last = ends[:, -1] if len(pairs) else np.zeros(world, np.int64)
    return [Slice(item[a:b], rows[a:b]) for a, b in zip(first.tolist(), last.tolist())]


def _same_tensor(item: dict, current: Item) -> bool:
    """Whether saved item `item` is the tensor `current` (a size the same, a value neither)."""
    return item["kind"] == "tensor" and current.kind != WriteItemType.BYTE_IO and list(current.size) == item["size"]


def _same_chunks(item: dict, arrays: dict, now: GlobalPlan | Chunks, t: int) -> bool:
    """Whether saved item `t` is `now`'s item `t` with the same chunks in the same numbering."""
    current = now.items[t]
    if current.fqn != item["fqn"] or (item["kind"] == "bytes") != (current.kind == WriteItemType.BYTE_IO):
        return False
    if item["kind"] == "bytes":
        return False  # one row: every rank gets it anyway
    if list(current.size) != item["size"]:
        return False
    saved_o, saved_s = arrays[f"o{item['chunks']}"], arrays[f"s{item['chunks']}"]
    return (
        saved_o.shape == now.offsets[t].shape and (saved_o == now.offsets[t]).all() and (saved_s == now.sizes[t]).all()
    )


def metadata_of(
    header: dict, shared: Slice, own_items: np.ndarray, own: tuple, now: Chunks | None, rank: int
) -> Metadata:
    """DCP's Metadata holding a rank's records of a chunk index (`slices`: those every rank gets;
    `own`, the rank's part: the records of its own chunks, whose offsets and sizes are `now`'s of
    `rank`, and those of the saved chunks overlapping its chunks) and where each chunk lies: what
    the rank's load plans its reads from, as from the whole .metadata."""
    info = torch_compat.storage_info_class()
    files, items = header["files"], header["items"]
    own_rows, overlapping = own
    md: dict = {}
    for it in items:
        if it["kind"] == "bytes":
            md[it["fqn"]] = BytesStorageMetadata()
        else:
            p = TensorProperties(dtype=_DTYPES[it["dtype"]], requires_grad=it["requires_grad"])
            md[it["fqn"]] = TensorStorageMetadata(properties=p, size=torch.Size(it["size"]), chunks=[])
    ndim = (shared.rows.shape[1] - 3) // 2
    storage: dict = {}

    chunks: dict = {}  # (offsets, sizes) -> its one ChunkStorageMetadata: the items of a shape share them

    def record(t: int, offsets: list, sizes: list, where: list) -> None:
        it = items[t]
        if it["kind"] == "bytes":
            key = MetadataIndex(it["fqn"])
        else:
            d = len(it["size"])
            shape = (tuple(offsets[:d]), tuple(sizes[:d]))
            chunk = chunks.get(shape)
            if chunk is None:
                chunk = chunks[shape] = ChunkStorageMetadata(offsets=torch.Size(shape[0]), sizes=torch.Size(shape[1]))
            md[it["fqn"]].chunks.append(chunk)
            key = MetadataIndex(it["fqn"], chunk.offsets)
        storage[key] = info(files[where[0]], where[1], where[2])

    for part in (shared, overlapping):
        for t, row in zip(part.item.tolist(), part.rows.tolist()):
            record(t, row[:ndim], row[ndim : 2 * ndim], row[2 * ndim :])
    for t, where in zip(own_items.tolist(), own_rows.tolist()):
        c = int(now.chunk_of[t][rank])
        record(t, now.offsets[t][c].tolist(), now.sizes[t][c].tolist(), where)
    mappings = {k: tuple(v) for k, v in header["mappings"].items()}
    return Metadata(state_dict_metadata=md, planner_data=mappings, storage_data=storage)


def full_metadata(header: dict, arrays: dict) -> Metadata:
    """DCP's whole Metadata of a chunk index (every record, chunks in the index's numbering): what
    `.metadata` holds for stock DCP (trainer/checkpoint/stock.py), and what a one-process reader
    (trainer.export) plans from where the checkpoint has an index."""
    shared, own_items, parts = slices(header, arrays, None, 1)
    return metadata_of(header, shared, own_items, parts[0], None, 0)


def read_checked_index(path: str, record: dict | None) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of the chunk index of the checkpoint folder `path` (a path that leads to it
    without following a link we did not make), its bytes read once and checked against the
    manifest's `record` ({"size", "xxh3_64"}) before anything is made of them: BadIndex otherwise."""
    if not isinstance(record, dict):
        raise BadIndex(f"{INDEX} is not listed in the checkpoint's manifest")
    with open_regular(os.path.join(path, INDEX)) as f:  # never a link, never blocking on a FIFO
        data = f.read()
    if (len(data), xxhash.xxh3_64_intdigest(data)) != (record.get("size"), record.get("xxh3_64")):
        raise BadIndex(f"{INDEX} is damaged: it is not what the commit wrote")
    return read_index(data)
