"""Each rank's load plan by lookup: which saved chunks its own chunks overlap, found by binary search
in an index of the checkpoint's chunks made once per load, not by a pass over every saved chunk.

DCP's DefaultLoadPlanner, for each tensor of the state, sorts all of its saved chunks and sweeps
them (create_read_items_for_chunk_list): at N ranks each tensor has N chunks, so each rank's plan
walks all N x tensors chunks of the checkpoint in Python (12-24 s per rank at 16,384 ranks for the
Llama-3.1-8B state in bench/scale.py). Here rank 0 indexes the metadata it read (`index`: per tensor
the dimension its chunks are sorted by, the order, the longest chunk along it, the chunks' extent in
every dimension; a few numbers per tensor where the chunks are in order already, as DCP saves
them) and sends the index with the metadata; each rank's `Planner` then finds a local chunk's saved
chunks by two binary searches. Its ReadItems are DCP's, in DCP's order (tests/unit/test_load_plan.py
compares them on random layouts): for each local chunk, by its start in DCP's sweep dimension, the
saved chunks it overlaps, by their end in that dimension and their index. Everything else (bytes,
plain tensors, keys the checkpoint lacks, checkpoints older than torch 2.4's keys) is DCP's own.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import islice
from operator import add, attrgetter, itemgetter, le

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Chunks:
    """One tensor's saved chunks, indexed."""

    dim: int  # the dimension the lookup searches: the one with the most distinct chunk starts
    order: tuple[int, ...] | None  # chunk indices by their start in `dim` (None: the saved order is that)
    longest: int  # the longest chunk along `dim`: a chunk overlapping [a, b) starts in (a - longest, b)
    extents: tuple[int, ...]  # per dimension, the largest offset + size of a chunk (DCP's sweep picks by it)


def index_tensor(md: TensorStorageMetadata) -> Chunks | None:
    """The index of one tensor's saved chunks; None where there is nothing to search (no chunk, a
    0-d tensor) or the chunks are not what DCP writes (another number of dimensions, offsets that
    are no numbers): DCP's own path takes those, and says what is wrong where it cannot load them.
    Never raises: rank 0 makes it between reading the metadata and sending it to every rank."""
    try:
        return _index_tensor(md)
    except (TypeError, ValueError, AttributeError):
        return None


def _index_tensor(md: TensorStorageMetadata) -> Chunks | None:
    chunks, ndim = md.chunks, len(md.size)
    if not chunks or ndim == 0:
        return None
    offsets = list(map(attrgetter("offsets"), chunks))
    sizes = list(map(attrgetter("sizes"), chunks))
    if set(map(len, offsets)) | set(map(len, sizes)) != {ndim}:
        return None
    starts = [list(map(itemgetter(d), offsets)) for d in range(ndim)]
    lengths = [list(map(itemgetter(d), sizes)) for d in range(ndim)]
    extents = tuple(max(map(add, starts[d], lengths[d])) for d in range(ndim))
    distinct = [len(set(s)) for s in starts]
    dim = distinct.index(max(distinct))
    key = starts[dim]
    in_order = all(map(le, key, islice(key, 1, None)))
    order = None if in_order else tuple(sorted(range(len(chunks)), key=key.__getitem__))
    return Chunks(dim=dim, order=order, longest=max(lengths[dim]), extents=extents)


def index(metadata) -> dict[str, Chunks]:
    """fqn -> the index of its saved chunks, for every tensor of a checkpoint's DCP metadata that has
    one. Made once per load, by the rank that read the metadata, and sent with it."""
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            entry = index_tensor(md)
            if entry is not None:
                out[fqn] = entry
    return out


def _overlap(local, saved) -> bool:
    """DCP's overlap test of two chunks (resharding._check_shard_metadata_pair_overlap)."""
    for lo, ls, so, ss in zip(local.offsets, local.sizes, saved.offsets, saved.sizes):
        if lo >= so + ss or so >= lo + ls:
            return False
    return True


def _read_item(fqn: str, local, local_index: int, saved, saved_index: int) -> ReadItem:
    """The ReadItem of the overlap of a local chunk and a saved one, as DCP makes it."""
    dest, storage, lengths = [], [], []
    for lo, ls, so, ss in zip(local.offsets, local.sizes, saved.offsets, saved.sizes):
        lengths.append(min(so + ss, lo + ls) - max(lo, so))
        storage.append(0 if so > lo else lo - so)
        dest.append(so - lo if so > lo else 0)
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, local.offsets, local_index),
        dest_offsets=torch.Size(dest),
        storage_index=MetadataIndex(fqn, saved.offsets, saved_index),
        storage_offsets=torch.Size(storage),
        lengths=torch.Size(lengths),
    )


def read_items(fqn: str, md: TensorStorageMetadata, entry: Chunks | None, local_chunks: list) -> list[ReadItem]:
    """DCP's create_read_items_for_chunk_list(fqn, md, local_chunks), found through `entry`."""
    saved = md.chunks
    if not local_chunks or not saved:
        return []
    ndim = len(local_chunks[0].offsets)
    if entry is None or ndim == 0 or ndim != len(entry.extents):
        return create_read_items_for_chunk_list(fqn, md, local_chunks)
    sweep, widest = 0, 0  # DCP's sweep dimension: the first of the largest extent, local chunks' too
    if ndim > 1:
        for d in range(ndim):
            extent = max(entry.extents[d], max(c.offsets[d] + c.sizes[d] for c in local_chunks))
            if extent > widest:
                sweep, widest = d, extent
    dim = entry.dim
    if entry.order is None:
        ranked, start = saved, (lambda c: c.offsets[dim])
    else:
        ranked, start = entry.order, (lambda i: saved[i].offsets[dim])
    out = []
    for li in sorted(range(len(local_chunks)), key=lambda i: local_chunks[i].offsets[sweep]):
        local = local_chunks[li]
        first = bisect_right(ranked, local.offsets[dim] - entry.longest, key=start)
        last = bisect_left(ranked, local.offsets[dim] + local.sizes[dim], key=start)
        found = range(first, last) if entry.order is None else entry.order[first:last]
        hits = [si for si in found if _overlap(local, saved[si])]
        hits.sort(key=lambda si: (saved[si].offsets[sweep] + saved[si].sizes[sweep], si))
        out += [_read_item(fqn, local, li, saved[si], si) for si in hits]
    return out


class Planner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner whose local plan looks the saved chunks up in `chunk_index` (`index`
    of the same metadata; made here, tensor by tensor, where none is given)."""

    def __init__(self, chunk_index: dict[str, Chunks] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.chunk_index = chunk_index

    def create_local_plan(self) -> LoadPlan:
        metadata = self.metadata
        if metadata is None or (
            self.flatten_state_dict and set(metadata.state_dict_metadata) - set(self.state_dict)
        ):  # keys the state lacks: a partial load or an old checkpoint's keys, which DCP's own plan sorts out
            return super().create_local_plan()
        strict = not self.allow_partial_load
        requests = []
        for fqn, obj in self.state_dict.items():
            md = metadata.state_dict_metadata.get(fqn)
            chunked = hasattr(obj, "__create_chunk_list__") and hasattr(obj, "size")
            if not (isinstance(md, TensorStorageMetadata) and chunked and _looked_up(obj)):
                requests += create_default_local_load_plan({fqn: obj}, metadata, strict).items
                continue
            if md.size != obj.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # not on this rank's part of the mesh
            entry = self.chunk_index.get(fqn) if self.chunk_index is not None else index_tensor(md)
            requests += read_items(fqn, md, entry, obj.__create_chunk_list__())
        return LoadPlan(requests)


def _looked_up(obj) -> bool:
    """Whether `Planner` looks up `obj`'s chunks: a DTensor, or a stand-in that is no tensor (the
    bench's); any other tensor (plain, sharded, checkpointable) is planned by DCP's own code."""
    return isinstance(obj, DTensor) or not isinstance(obj, torch.Tensor)
