"""How a checkpoint's planning, its metadata and the rendezvous grow with the number of ranks.

    .venv/bin/python -m bench.scale --out scale.json [--ranks 1024 ... 16384] [--rounds 3] [--dcp]
                                    [--rendezvous 2 4 8 16] [--reshard 16384:8192 16384:12000]

The trainer's planning (trainer/checkpoint/save_plan.py), without processes, the whole Llama-3.1-8B state below
at N ranks, each round in a fresh process (`layout_round`, `index_round`):

  first save    every rank: the layout's digest (agreed by one all-reduce), the global plan's arrays
                (DCP's dedup simulated), its own final plan; rank 0 also unpickles N empty plans and
                pickles N back (DCP's gather and scatter, carrying nothing); rank 0's peak memory
  finish        after the writes: the N ranks' compact write results unpickled, the chunk index
                (chunks.npz) assembled and written; DCP's .metadata built from the arrays and pickled
                (on the slice below, x 1164/48: what stock DCP reads)
  resume        rank 0: chunks.npz read, hashed, checked and parsed, every rank's slice, the common
                part and the N slices pickled (broadcast, scatter); one rank: its slice unpickled, DCP's
                metadata of it, its load plan (trainer/load_plan.Planner)
  commit delay  what the commit waits for after the last write: the chunk index, with or without
                .metadata built and pickled before it (past save_plan.METADATA_BEFORE_COMMIT, without);
                and the background process's .metadata from chunks.npz after the commit (stock.py, on
                the slice x 1164/48)
  reshard       (--reshard SAVED:NOW) a resume on NOW ranks of a checkpoint saved by SAVED: rank 0 as
                at a resume, each rank's slice the saved chunks overlapping its own; one rank as above

With --dcp, DCP's own planning too (minutes a round at 16k ranks; bench/results/2026-11-27-vm.md):
each rank's SavePlan is built as DCP builds it for the trainer's
state ({"model": ..., "optim": ...} from get_state_dict) of the Llama-3.1-8B shape (configs/llama-8b.yaml,
built on the meta device), every parameter and both AdamW moments a DTensor sharded Shard(0) over N
ranks as FSDP2 shards them (uneven: the last ranks' chunks short or empty), the optimizer's `step` a
plain tensor on every rank. The coordinator's work at a save is then done as on rank 0, in order:

  gather        unpickle the N ranks' plans (dist.gather_object: rank 0 unpickles every one)
  global_plan   DefaultSavePlanner.create_global_plan: dedup, the metadata's chunk lists, validation
  scatter       pickle the N global plans back (dist.scatter_object_list)
  finish        unpickle the N ranks' write results, build storage_data, pickle .metadata (its bytes)

with DCP's save-plan caching on, as the trainer saves (trainer/checkpoint/manager.py `_planner`); then rank
0's planning at a second save of the same layout: every rank's plan unchanged, so each sends an
empty unusable plan (gather), the cached global plan and metadata are reused (global_plan), and N
empty plans go back (scatter); one rank's side is comparing its new plan with its cached one. The
finish is a save's own (the write results differ from save to save) and is not repeated here.

And at a load: rank 0 unpickles .metadata with trainer.checkpoint.reader.load_metadata (the restricted
unpickler; pickle.loads beside it) and pickles it for the broadcast to every rank, each of which
unpickles that (pickle.loads: the trainer reads the file once per load, not once per rank); then
one rank's (the middle one's) local load plan of the same N against it: rank 0 indexes the
metadata's chunks once (trainer/checkpoint/load_plan.py `index`, sent with the metadata) and the rank plans
with trainer/load_plan.Planner (`load_local_plan_s`), DCP's DefaultLoadPlanner beside it
(`dcp_load_local_plan_s`; the two plans asserted equal). Also
the size of our manifest.json for N ranks (3 files each: the shard file, its .xxh3 record,
rng/rank_R.pt) and the seconds to read and check its digest.

The whole 8B state is 1164 items per rank (291 tensors x model, exp_avg, exp_avg_sq, step); at 16k ranks
that is 19M Python objects, more than this VM holds. So each round plans a slice of it, every item of
the slice at the real N: the embedding, the first block (9 tensors), the final norm and the output
(12 of the 291 parameters, 48 items per rank). Every phase above loops over items (or their chunks,
whose number per item is the same for every parameter): the whole state's figure is the slice's x
1164/48. `--whole N` plans the whole state once at N ranks to check that factor. Each round of each N
runs in a fresh process (rank 0's peak memory: its VmHWM above its RSS before the plans).

Rendezvous, with processes: torchrun --standalone --nproc-per-node=N for N in --rendezvous, each rank
timing trainer.dist.init (the TCPStore rendezvous and gloo's process group) and a barrier after it.
On this host all ranks share 2 cores, so from the last rank's arrival is the figure, not from launch.
And the writes per second one TCPStore serves (the trainer writes its step there once per rank per
step), from --store-clients processes writing as fast as they can.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import stats

SLICE = ("tok_embeddings.weight", "layers.0.", "norm.weight", "output.weight")  # parameters planned per round
MOMENTS = ("exp_avg", "exp_avg_sq")
FILES_PER_RANK = ("__{r}_0.distcp", "__{r}_0.distcp.xxh3", "rng/rank_{r:05d}.pt")  # a checkpoint's, per rank


# ---------------------------------------------------------------------------------------------------
# Synthetic plans


def llama_shapes(config: str = "configs/llama-8b.yaml") -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the config's model, built on the meta device (no memory)."""
    import torch

    from trainer import config as config_module
    from trainer import models

    cfg = config_module.load(str(ROOT / config))
    with torch.device("meta"):
        model = models.spec(cfg.model).build(cfg.model)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def state_items(shapes: dict[str, tuple[int, ...]], whole: bool) -> list[tuple[str, tuple[int, ...], bool]]:
    """(flattened key, global shape, sharded) of each tensor of the trainer's checkpoint state, as
    DCP flattens {"model": model_state, "optim": optim_state}; only the SLICE unless `whole`."""
    items = []
    for name, shape in shapes.items():
        if not whole and not name.startswith(SLICE):
            continue
        items.append((f"model.{name}", shape, True))
        items += [(f"optim.state.{name}.{m}", shape, True) for m in MOMENTS]
        items.append((f"optim.state.{name}.step", (), False))
    return items


def shard(shape: tuple[int, ...], world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local sizes, global offsets) of `rank`'s chunk of a tensor sharded Shard(0) over `world`
    ranks, as DTensor computes them for FSDP2: torch.chunk's split of dim 0 (ceil(d/world) rows per
    rank), an empty chunk placed at the end of the dimension."""
    from torch.distributed.tensor import Shard

    rows, start = Shard(0)._local_shard_size_and_offset(shape[0], world, rank)
    if rows == 0:
        start = shape[0]
    return (rows, *shape[1:]), (start, *(0,) * (len(shape) - 1))


def save_plan(items, world: int, rank: int, mappings: dict):
    """Rank `rank`'s SavePlan, as DefaultSavePlanner.create_local_plan makes it (planner_data: the
    flattening's mappings, which every rank sends)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    out = []
    for key, shape, sharded in items:
        props = TensorProperties(dtype=torch.float32)
        if sharded:
            sizes, offsets = shard(shape, world, rank)
            kind, global_size = WriteItemType.SHARD, torch.Size(shape)
        else:
            sizes, offsets, kind, global_size = (), (), WriteItemType.TENSOR, torch.Size(())
        out.append(
            WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=kind,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=props,
                    size=global_size,
                ),
            )
        )
    return SavePlan(out, planner_data=mappings)


def mappings_of(items) -> dict:
    """DCP's flatten_state_dict mappings: flattened key -> its path in the nested state dict."""
    out = {}
    for key, _, _ in items:
        top, rest = key.split(".", 1)
        if top == "model":
            out[key] = ("model", rest)
        else:
            name, moment = rest[len("state.") :].rsplit(".", 1)
            out[key] = ("optim", "state", name, moment)
    return out


def write_results(plan, rank: int) -> list:
    """What rank `rank`'s writer returns for its global plan: each item in its one shard file."""
    import math

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    out, offset = [], 0
    for item in plan.items:
        length = 4 * math.prod(item.tensor_data.chunk.sizes) + 1100  # float32 bytes + torch.save's zip headers
        out.append(WriteResult(item.index, length, _StorageInfo(f"__{rank}_0.distcp", offset, length)))
        offset += length
    return out


class LocalShard:
    """A rank's chunk of one tensor, as the load planner asks it (DTensor's __create_chunk_list__)."""

    def __init__(self, shape, sizes, offsets):
        import torch

        self.shape, self.sizes, self.offsets = torch.Size(shape), torch.Size(sizes), torch.Size(offsets)

    def size(self):
        return self.shape

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes)]


def load_state(items, world: int, rank: int) -> dict:
    """Rank `rank`'s state to load into, flattened as the load planner sees it."""
    out = {}
    for key, shape, sharded in items:
        sizes, offsets = shard(shape, world, rank) if sharded else ((), ())
        out[key] = LocalShard(shape, sizes, offsets)
    return out


def manifest(world: int) -> bytes:
    """manifest.json of a checkpoint of `world` ranks, as trainer/checksums.write_manifest writes it."""
    from trainer.checkpoint import checksums

    files = {".metadata": {"size": 1, "xxh3_64": 2**63}, "meta.json": {"size": 1, "xxh3_64": 2**63}}
    for r in range(world):
        for name in FILES_PER_RANK:
            files[name.format(r=r)] = {"size": 2**30 + r, "xxh3_64": 2**63 + r}  # full-width numbers
    return json.dumps({"files": files, "xxh3_64": checksums._digest(files)}, indent=1, sort_keys=True).encode()


def vm(field: str) -> int:
    """This process's /proc/self/status `field` (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def plan_round(world: int, whole: bool) -> dict:
    """One round at `world` ranks: seconds and bytes of each phase (the module's docstring)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

    from trainer.checkpoint import checksums, load_plan, reader

    items = state_items(llama_shapes(), whole)
    mappings = mappings_of(items)
    base = vm("VmRSS")
    r: dict = {"world": world, "items_per_rank": len(items), "whole": whole}

    began = time.perf_counter()
    blobs = [pickle.dumps(save_plan(items, world, rank, mappings)) for rank in range(world)]  # each rank's own
    r["build_and_pickle_one_plan_s"] = (time.perf_counter() - began) / world
    r["plans_bytes"] = sum(map(len, blobs))

    t = time.perf_counter()
    plans = [pickle.loads(b) for b in blobs]
    r["gather_s"] = time.perf_counter() - t
    del blobs
    t = time.perf_counter()
    coordinator = DefaultSavePlanner(enable_plan_caching=True)  # as trainer/checkpoint/manager.py saves
    coordinator._cached_plans_key = f"bench.scale/{world}/{os.urandom(8).hex()}"  # a cache of its own
    global_plans, metadata = coordinator.create_global_plan(plans)
    r["global_plan_s"] = time.perf_counter() - t
    one, again = (save_plan(items, world, world // 2, mappings) for _ in range(2))
    t = time.perf_counter()
    assert _compare_save_plans(one, again)
    r["cached_local_compare_s"] = time.perf_counter() - t  # one rank at the second save: plan unchanged?
    del plans, one, again
    # trainer/checkpoint/save_plan.py's global plan, from the layout alone, is DCP's: every rank's (a few at many ranks)
    from trainer.checkpoint import save_plan as sp

    ours = sp.GlobalPlan(layout_items(items, world), world)
    for rank in range(world) if world <= 64 else (0, world // 2, world - 1):
        assert ours.final_plan(save_plan(items, world, rank, mappings), rank).items == global_plans[rank].items
    assert ours.metadata(planner_data=mappings).state_dict_metadata == metadata.state_dict_metadata
    del ours
    t = time.perf_counter()
    scattered = [pickle.dumps(p) for p in global_plans]
    r["scatter_s"] = time.perf_counter() - t
    r["scatter_bytes"] = sum(map(len, scattered))
    del scattered

    # The second save of the same layout: rank 0's planning from its cache.
    unchanged = [pickle.dumps(SavePlan([], usable=False)) for _ in range(world)]
    t = time.perf_counter()
    plans = [pickle.loads(b) for b in unchanged]
    r["cached_gather_s"] = time.perf_counter() - t
    t = time.perf_counter()
    delta, cached_metadata = coordinator.create_global_plan(plans)
    r["cached_global_plan_s"] = time.perf_counter() - t
    assert cached_metadata is metadata and not any(p.usable for p in delta)
    t = time.perf_counter()
    r["cached_scatter_bytes"] = sum(len(pickle.dumps(p)) for p in delta)
    r["cached_scatter_s"] = time.perf_counter() - t
    r["planning_s"] = r["gather_s"] + r["global_plan_s"] + r["scatter_s"]
    r["cached_planning_s"] = r["cached_gather_s"] + r["cached_global_plan_s"] + r["cached_scatter_s"]
    del plans, delta, unchanged

    results = [pickle.dumps(write_results(p, rank)) for rank, p in enumerate(global_plans)]  # each rank's own
    del global_plans
    t = time.perf_counter()
    storage = {}
    for blob in results:
        storage.update({w.index: w.storage_data for w in pickle.loads(blob)})
    metadata = dataclasses.replace(metadata, storage_data=storage)
    data = pickle.dumps(metadata)
    r["finish_s"] = time.perf_counter() - t
    r["metadata_bytes"] = len(data)
    del results, storage
    r["coordinator_peak_bytes"] = vm("VmHWM") - base

    t = time.perf_counter()
    loaded = pickle.loads(data)
    r["metadata_unpickle_s"] = time.perf_counter() - t
    with tempfile.NamedTemporaryFile(suffix=".metadata") as f:
        f.write(data)
        f.flush()
        t = time.perf_counter()
        reader.load_metadata(f.name)
        r["metadata_restricted_unpickle_s"] = time.perf_counter() - t
    t = time.perf_counter()
    r["metadata_broadcast_bytes"] = len(pickle.dumps(loaded))  # rank 0 pickles it once for the broadcast
    r["metadata_broadcast_pickle_s"] = time.perf_counter() - t
    del data
    t = time.perf_counter()
    chunk_index = load_plan.index(loaded)  # rank 0, once per load: sent with the metadata
    r["load_index_s"] = time.perf_counter() - t
    r["load_index_bytes"] = len(pickle.dumps(chunk_index))
    state = load_state(items, world, world // 2)
    found = {}
    for name, planner in (("dcp_", DefaultLoadPlanner()), ("", load_plan.Planner(chunk_index))):
        planner.set_up_planner({}, loaded, is_coordinator=False)
        # What set_up_planner does with a state dict, less _init_state_dict, which materialises meta
        # tensors (there are none) and would take the stand-ins for something else.
        planner.original_state_dict = state
        planner.state_dict, planner.mappings = flatten_state_dict(state)
        t = time.perf_counter()
        found[name] = planner.create_local_plan()
        r[f"{name}load_local_plan_s"] = time.perf_counter() - t
    assert found[""].items == found["dcp_"].items  # trainer/checkpoint/load_plan.py's plan is DCP's
    planned = found[""]
    r["load_plan_bytes"] = len(pickle.dumps(planned))
    r["load_read_items"] = len(planned.items)

    text = manifest(world)
    r["manifest_bytes"] = len(text)
    t = time.perf_counter()
    m = json.load(io.BytesIO(text))
    assert m["xxh3_64"] == checksums._digest(m["files"])
    r["manifest_read_s"] = time.perf_counter() - t
    return r


# ---------------------------------------------------------------------------------------------------
# The first save planned from the layout (trainer/checkpoint/save_plan.py)


def layout_items(items, world: int) -> list:
    """trainer/save_plan.describe's items of the state `items` (state_items) sharded over `world` ranks."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.tensor import Shard

    from trainer.checkpoint import save_plan as sp

    props = TensorProperties(dtype=torch.float32)
    out = []
    for key, shape, sharded in items:
        if sharded:
            layout = (shape, (world,), (Shard(0),))
            out.append(sp.Item(key, WriteItemType.SHARD, torch.Size(shape), props, layout, None))
        else:
            out.append(sp.Item(key, WriteItemType.TENSOR, torch.Size(()), props, None, None))
    return out


def written(plan, rank: int):
    """Rank `rank`'s compact write results (save_plan.Written) of its final plan, as write_results lays them out."""
    import numpy as np

    from trainer.checkpoint import save_plan as sp

    results = write_results(plan, rank)
    return sp.Written(
        files=[f"__{rank}_0.distcp"],
        item=np.arange(len(results), dtype=np.int32),
        file=np.zeros(len(results), dtype=np.int32),
        offset=np.asarray([w.storage_data.offset for w in results], dtype=np.int64),
        length=np.asarray([w.storage_data.length for w in results], dtype=np.int64),
        size_in_bytes=np.asarray([w.size_in_bytes for w in results], dtype=np.int64),
    )


def layout_round(world: int) -> dict:
    """The first save of the whole 8B state at `world` ranks planned from the layout, as the trainer
    saves it (trainer/checkpoint/manager.py `_planner` with save_plan.Planner): every rank's own work
    (digest, the global plan's arrays, its final plan), rank 0's (N empty plans in, N out), rank 0's
    peak memory; then the finish on the slice (x slice_to_whole): the N ranks' compact write results
    unpickled, DCP's .metadata built from the arrays and pickled (what stock DCP reads)."""
    import dataclasses as dc

    from torch.distributed.checkpoint.planner import SavePlan

    from trainer.checkpoint import save_plan as sp

    storage_prefix = _storage_prefix()
    items = state_items(llama_shapes(), True)
    mappings = mappings_of(items)
    base = vm("VmRSS")
    r: dict = {"world": world, "items_per_rank": len(items)}
    layout = layout_items(items, world)
    t = time.perf_counter()
    sp.digest(layout)
    r["layout_digest_s"] = time.perf_counter() - t
    t = time.perf_counter()
    plan = sp.GlobalPlan(layout, world)
    r["layout_global_plan_s"] = time.perf_counter() - t
    rank = world // 2
    local = save_plan(items, world, rank, mappings)
    t = time.perf_counter()
    own = plan.final_plan(local, rank)
    r["layout_own_plan_s"] = time.perf_counter() - t
    r["layout_own_items"] = len(own.items)
    zero = save_plan(items, world, 0, mappings)
    t = time.perf_counter()
    zero = plan.final_plan(zero, 0)
    r["layout_rank0_own_plan_s"] = time.perf_counter() - t
    del local, zero
    empties = [pickle.dumps(SavePlan([], usable=False)) for _ in range(world)]  # each rank's own
    t = time.perf_counter()
    got = [pickle.loads(b) for b in empties]
    r["layout_gather_s"] = time.perf_counter() - t
    r["layout_gather_bytes"] = sum(map(len, empties))
    t = time.perf_counter()
    back = [pickle.dumps(dc.replace(p, storage_data=storage_prefix(f"__{i}_"))) for i, p in enumerate(got)]
    r["layout_scatter_s"] = time.perf_counter() - t
    r["layout_scatter_bytes"] = sum(map(len, back))
    del empties, got, back
    r["layout_rank_planning_s"] = r["layout_digest_s"] + r["layout_global_plan_s"] + r["layout_own_plan_s"]
    r["layout_planning_s"] = (
        r["layout_digest_s"]
        + r["layout_global_plan_s"]
        + r["layout_rank0_own_plan_s"]
        + r["layout_gather_s"]
        + r["layout_scatter_s"]
    )
    r["layout_peak_bytes"] = vm("VmHWM") - base
    del plan

    # The finish, on the slice: after every byte is written
    part = state_items(llama_shapes(), False)
    plan = sp.GlobalPlan(layout_items(part, world), world)
    part_mappings = mappings_of(part)
    blobs = []
    for rank in range(world):
        final = plan.final_plan(save_plan(part, world, rank, part_mappings), rank)
        results = written(final, rank)
        results.item = np.asarray([t for t in range(len(part)) if plan.writes(t, rank)], dtype=np.int32)
        blobs.append(pickle.dumps(results))
    r["layout_results_bytes"] = sum(map(len, blobs))
    t = time.perf_counter()
    results = [pickle.loads(b) for b in blobs]
    r["layout_results_gather_s"] = time.perf_counter() - t
    del blobs
    t = time.perf_counter()
    metadata = sp.Layout(plan, part_mappings).metadata()
    storage = {}
    for rank, w in enumerate(results):
        storage.update({x.index: x.storage_data for x in sp._write_results(plan, rank, w)})
    metadata = dataclasses.replace(metadata, storage_data=storage)
    data = pickle.dumps(metadata)
    r["layout_finish_s"] = r["layout_results_gather_s"] + time.perf_counter() - t
    r["layout_metadata_bytes"] = len(data)
    del metadata, storage, data

    # .metadata after the commit (trainer/checkpoint/stock.py's background process), on the slice:
    # the chunk index read and parsed, DCP's Metadata built from it and pickled to a file
    files, rows = sp.storage_rows(plan, results)
    with tempfile.TemporaryDirectory() as folder:
        sp.write_index(folder, plan, part_mappings, files, rows)
        del rows, results
        before = vm("VmRSS")
        t = time.perf_counter()
        with open(os.path.join(folder, sp.INDEX), "rb") as f:
            header, arrays = sp.read_index(f.read())
        metadata = sp.full_metadata(header, arrays)
        with open(os.path.join(folder, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
        r["layout_stock_s"] = time.perf_counter() - t
        r["layout_stock_held_bytes"] = vm("VmRSS") - before  # what the process holds for it, once built
        r["layout_stock_bytes"] = os.path.getsize(os.path.join(folder, ".metadata"))
    return r


def synthetic_written(plan, world: int) -> list:
    """Every rank's compact write results (save_plan.Written) of the whole state: each item a rank
    writes in its one file, in plan order, 4 bytes an element and 1100 of torch.save's zip headers."""
    from trainer.checkpoint import save_plan as sp

    n_items = len(plan.items)
    writes = np.zeros((n_items, world), dtype=bool)
    length = np.zeros((n_items, world), dtype=np.int64)
    for t in range(n_items):
        chunk = plan.chunk_of[t]
        writes[t] = plan.writer[t][chunk] == np.arange(world)
        numel = np.prod(plan.sizes[t], axis=1) if plan.sizes[t].shape[1] else np.ones(len(plan.sizes[t]), np.int64)
        length[t] = 4 * numel[chunk] + 1100
    length *= writes
    offset = np.cumsum(length, axis=0) - length
    out = []
    for r in range(world):
        mine = np.flatnonzero(writes[:, r])
        out.append(
            sp.Written(
                files=[f"__{r}_0.distcp"],
                item=mine.astype(np.int32),
                file=np.zeros(len(mine), dtype=np.int32),
                offset=offset[mine, r],
                length=length[mine, r],
                size_in_bytes=length[mine, r],
            )
        )
    return out


def index_round(world: int) -> dict:
    """A save's chunk index and a resume from it, the whole 8B state at `world` ranks, as the trainer
    does them (trainer/checkpoint/save_plan.py, trainer/checkpoint/manager.py `_checked_metadata`, `_index_slices`):
    rank 0 at the save's finish (the N ranks' compact write results unpickled, the index's arrays,
    the file written); at the resume, rank 0 (the file read, hashed, checked and parsed, the
    current layout's plan, every rank's slice, the header and slices pickled for the broadcast and
    the scatter), and one rank (its slice unpickled, DCP's metadata of it, its load plan)."""
    import xxhash

    from trainer.checkpoint import save_plan as sp

    items = state_items(llama_shapes(), True)
    mappings = mappings_of(items)
    r: dict = {"world": world}
    plan = sp.GlobalPlan(layout_items(items, world), world)
    blobs = [pickle.dumps(w) for w in synthetic_written(plan, world)]
    r["index_results_bytes"] = sum(map(len, blobs))
    base = vm("VmRSS")
    t = time.perf_counter()
    results = [pickle.loads(b) for b in blobs]
    del blobs
    files, rows = sp.storage_rows(plan, results)
    del results
    with tempfile.TemporaryDirectory() as folder:
        sp.write_index(folder, plan, mappings, files, rows)
        r["index_finish_s"] = time.perf_counter() - t
        del rows, plan
        path = os.path.join(folder, sp.INDEX)
        r["index_bytes"] = os.path.getsize(path)
        digest = xxhash.xxh3_64_intdigest(Path(path).read_bytes())  # the manifest's record, at the commit
        r["index_save_peak_bytes"] = vm("VmHWM") - base

        # The resume: rank 0
        t = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        assert xxhash.xxh3_64_intdigest(data) == digest
        header, arrays = sp.read_index(data)
        del data
        r["index_read_s"] = time.perf_counter() - t
    t = time.perf_counter()
    now = sp.Chunks(layout_items(items, world), world)  # the current layout, as rank 0 describes it
    shared, own_items, parts = sp.slices(header, arrays, now, world)
    r["index_slices_s"] = time.perf_counter() - t
    del arrays, now
    t = time.perf_counter()
    header_blob = pickle.dumps((header, shared, own_items))
    sent = [pickle.dumps(p) for p in parts]
    r["index_send_s"] = time.perf_counter() - t
    r["index_header_bytes"] = len(header_blob)
    r["index_slice_bytes"] = len(sent[world // 2])
    r["index_rank0_s"] = r["index_read_s"] + r["index_slices_s"] + r["index_send_s"]
    r["index_resume_peak_bytes"] = vm("VmHWM") - base
    del parts

    # The resume: one rank
    rank = world // 2
    r["index_rank_s"], r["index_rank_read_items"] = _rank_load_plan(items, world, rank, header_blob, sent[rank])
    # each item read from its one saved chunk (none where the chunk is empty)
    assert r["index_rank_read_items"] <= len(items)
    return r


def reshard_round(saved: int, world: int) -> dict:
    """A resume on `world` ranks from a checkpoint of the whole 8B state saved by `saved` ranks, as
    the trainer does it (trainer/checkpoint/manager.py `_checked_metadata`, `_index_slices`): rank 0
    reads, hashes, checks and parses chunks.npz, describes the current layout (save_plan.Chunks),
    makes every rank's part of the index (save_plan.slices: of each tensor the saved chunks that
    overlap the rank's own chunk) and pickles the common part and the N parts (the broadcast and
    the scatter); one rank (the middle one) unpickles its part, makes DCP's Metadata of it and its
    load plan (trainer/load_plan.Planner)."""
    import xxhash

    from trainer.checkpoint import save_plan as sp

    items = state_items(llama_shapes(), True)
    r: dict = {"saved": saved, "world": world}
    plan = sp.GlobalPlan(layout_items(items, saved), saved)
    files, rows = sp.storage_rows(plan, synthetic_written(plan, saved))
    with tempfile.TemporaryDirectory() as folder:
        sp.write_index(folder, plan, mappings_of(items), files, rows)
        del rows, plan
        path = os.path.join(folder, sp.INDEX)
        digest = xxhash.xxh3_64_intdigest(Path(path).read_bytes())  # the manifest's record, at the commit
        base = vm("VmRSS")
        t = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        assert xxhash.xxh3_64_intdigest(data) == digest
        header, arrays = sp.read_index(data)
        del data
        r["reshard_read_s"] = time.perf_counter() - t
    t = time.perf_counter()
    now = sp.Chunks(layout_items(items, world), world)
    shared, own_items, parts = sp.slices(header, arrays, now, world)
    r["reshard_slices_s"] = time.perf_counter() - t
    del arrays, now
    t = time.perf_counter()
    header_blob = pickle.dumps((header, shared, own_items))
    sent = [pickle.dumps(p) for p in parts]
    r["reshard_send_s"] = time.perf_counter() - t
    r["reshard_header_bytes"] = len(header_blob)
    rank = world // 2
    sizes = [len(b) for b in sent]
    r["reshard_slice_bytes"], r["reshard_slice_max_bytes"] = sizes[rank], max(sizes)
    r["reshard_slice_records"] = len(parts[rank][1].item)
    r["reshard_rank0_s"] = r["reshard_read_s"] + r["reshard_slices_s"] + r["reshard_send_s"]
    r["reshard_rank0_peak_bytes"] = vm("VmHWM") - base
    del parts

    # one rank
    r["reshard_rank_s"], r["reshard_rank_read_items"] = _rank_load_plan(items, world, rank, header_blob, sent[rank])
    # each sharded item read from the 1 or 2 saved chunks its rows overlap (at most 3 at 16,384 -> 12,000)
    assert r["reshard_rank_read_items"] <= 3 * len(items), r["reshard_rank_read_items"]
    return r


def _rank_load_plan(items, world: int, rank: int, header_blob: bytes, mine_blob: bytes) -> tuple[float, int]:
    """One rank's part of a resume from the chunk index: its slice unpickled, DCP's metadata of it,
    trainer/checkpoint/load_plan.py's plan; (seconds, read items). Its state is made before the clock starts."""
    from trainer.checkpoint import load_plan
    from trainer.checkpoint import save_plan as sp

    state = load_state(items, world, rank)
    layout = layout_items(items, world)
    t = time.perf_counter()
    mine = sp.metadata_of(*pickle.loads(header_blob), pickle.loads(mine_blob), sp.Chunks(layout, world), rank)
    planner = load_plan.Planner(None)
    planner.set_up_planner({}, mine, is_coordinator=False)
    planner.original_state_dict = state
    planner.state_dict, planner.mappings = _flatten(state)
    planned = planner.create_local_plan()
    return time.perf_counter() - t, len(planned.items)


def _flatten(state):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)


def _storage_prefix():
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    return _StoragePrefix


# ---------------------------------------------------------------------------------------------------
# Rendezvous


def rendezvous_worker(out: Path) -> None:
    """In each rank under torchrun: time trainer.dist.init and a barrier; write rank_<R>.json."""
    arrived = time.time()
    import torch.distributed as dist

    from trainer import dist as distributed

    imported = time.time()
    env = distributed.init(timeout_s=300)
    initialised = time.time()
    dist.barrier()
    done = time.time()
    (out / f"rank_{env.rank}.json").write_text(
        json.dumps({"started": arrived, "arrived": imported, "initialised": initialised, "done": done})
    )
    dist.destroy_process_group()


def rendezvous_round(world: int, scratch: Path) -> dict:
    """One torchrun of `world` ranks: seconds from the last rank's arrival at init to every rank past
    the barrier, and rank 0's own init."""
    folder = scratch / f"rendezvous_{world}"
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    launched = time.time()
    subprocess.run(
        [
            torchrun,
            "--standalone",
            f"--nproc-per-node={world}",
            "-m",
            "bench.scale",
            "--rendezvous-worker",
            str(folder),
        ],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=600,
    )
    ranks = [json.loads((folder / f"rank_{r}.json").read_text()) for r in range(world)]
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    last = max(x["arrived"] for x in ranks)
    return {
        "world": world,
        "from_last_arrival_s": max(x["done"] for x in ranks) - last,
        "rank0_init_s": ranks[0]["initialised"] - ranks[0]["arrived"],
        "launch_to_last_arrival_s": last - launched,
    }


def store_client(port: int, client: int, seconds: float, out) -> None:
    """One client of store_round: the trainer's per-step write (trainer/train.py _reached) in a loop."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    store.set(f"ready/{client}", "1")
    store.wait(["go"])
    n, began = 0, time.perf_counter()
    while time.perf_counter() < began + seconds:
        store.set(f"trainer/step/{client}", str(n))
        n += 1
    store.get(f"trainer/step/{client}")  # a set does not wait for the store; a get answers after every set
    out.put((n, time.perf_counter() - began))


def store_round(clients: int, seconds: float = 3.0) -> dict:
    """Writes per second that one TCPStore (the rendezvous store every rank talks to) serves to
    `clients` processes writing as fast as they can: an upper bound on the ranks it can take at one
    write per rank per step (ranks <= writes/s x step seconds). All on this host's 2 cores."""
    import multiprocessing
    from datetime import timedelta

    import torch.distributed as dist

    from trainer import dist as distributed

    port = distributed.free_port("127.0.0.1")
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=store_client, args=(port, c, seconds, out)) for c in range(clients)]
    for p in procs:
        p.start()
    server.wait([f"ready/{c}" for c in range(clients)])
    server.set("go", "1")
    done = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return {"clients": clients, "writes_per_s": sum(n for n, _ in done) / max(s for _, s in done)}


# ---------------------------------------------------------------------------------------------------


def fresh(args: list[str], timeout: float) -> dict:
    """Run `python -m bench.scale ARGS --json -` in a fresh process; its result."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.scale", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench.scale {' '.join(args)}: exit {out.returncode}: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


PLAN_KEYS = (
    "gather_s",
    "global_plan_s",
    "scatter_s",
    "finish_s",
    "planning_s",
    "cached_gather_s",
    "cached_global_plan_s",
    "cached_scatter_s",
    "cached_planning_s",
    "cached_local_compare_s",
    "coordinator_peak_bytes",
    "metadata_bytes",
    "plans_bytes",
    "metadata_unpickle_s",
    "metadata_restricted_unpickle_s",
    "metadata_broadcast_pickle_s",
    "load_index_s",
    "load_index_bytes",
    "dcp_load_local_plan_s",
    "load_local_plan_s",
    "load_plan_bytes",
    "manifest_bytes",
    "manifest_read_s",
)


LAYOUT_KEYS = (
    "layout_digest_s",
    "layout_global_plan_s",
    "layout_own_plan_s",
    "layout_rank0_own_plan_s",
    "layout_gather_s",
    "layout_gather_bytes",
    "layout_scatter_s",
    "layout_scatter_bytes",
    "layout_rank_planning_s",
    "layout_planning_s",
    "layout_peak_bytes",
    "layout_results_bytes",
    "layout_results_gather_s",
    "layout_finish_s",
    "layout_metadata_bytes",
    "index_results_bytes",
    "index_finish_s",
    "index_bytes",
    "index_save_peak_bytes",
    "index_read_s",
    "index_slices_s",
    "index_send_s",
    "index_header_bytes",
    "index_slice_bytes",
    "index_rank0_s",
    "index_resume_peak_bytes",
    "index_rank_s",
    "layout_stock_s",
    "layout_stock_bytes",
    "layout_stock_held_bytes",
    "commit_delay_with_metadata_s",
    "commit_delay_s",
)
LAYOUT_SLICED = {"layout_results_bytes", "layout_results_gather_s", "layout_finish_s", "layout_metadata_bytes"}
LAYOUT_SLICED |= {"layout_stock_s", "layout_stock_bytes", "layout_stock_held_bytes"}
RESHARD_KEYS = (
    "reshard_read_s",
    "reshard_slices_s",
    "reshard_send_s",
    "reshard_header_bytes",
    "reshard_slice_bytes",
    "reshard_slice_max_bytes",
    "reshard_slice_records",
    "reshard_rank0_s",
    "reshard_rank0_peak_bytes",
    "reshard_rank_s",
    "reshard_rank_read_items",
)


def summary(rounds: list[dict], keys, factor: float = 1.0) -> dict:
    """key -> bench/stats.py figure of its rounds (scaled by `factor` where it counts items)."""
    # per rank, not per item: the same for any slice (rank 0's cached planning handles N empty plans)
    scaled = {"manifest_bytes", "manifest_read_s", "cached_gather_s", "cached_global_plan_s", "cached_scatter_s"}
    scaled |= {"cached_planning_s"}
    return {k: stats.figure([x[k] * (1 if k in scaled else factor) for x in rounds]) for k in keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="result JSON, rewritten after every round")
    parser.add_argument("--ranks", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each point (each in a fresh process)")
    parser.add_argument("--whole", type=int, nargs="*", default=[1024], help="rank counts to plan the whole state at")
    parser.add_argument("--rendezvous", type=int, nargs="*", default=[2, 4, 8, 16], help="torchrun sizes")
    parser.add_argument("--store-clients", type=int, nargs="*", default=[1, 4], help="writers to one TCPStore")
    parser.add_argument("--scratch", default=str(ROOT / "runs" / "bench-scale"))
    parser.add_argument("--dcp", action="store_true", help="also DCP's own planning (minutes a round at 16k ranks)")
    parser.add_argument("--plan-round", type=int, help=argparse.SUPPRESS)  # one round, in a fresh process
    parser.add_argument("--layout-round", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--reshard", nargs="*", default=["16384:8192", "16384:12000"], help="resumes SAVED:NOW ranks to measure"
    )
    parser.add_argument("--reshard-round", help=argparse.SUPPRESS)  # SAVED:NOW, one round in a fresh process
    parser.add_argument("--plan-whole", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rendezvous_worker:
        rendezvous_worker(Path(args.rendezvous_worker))
        return 0
    if args.plan_round:
        print(json.dumps(plan_round(args.plan_round, args.plan_whole)))
        return 0
    if args.layout_round:
        r = {**layout_round(args.layout_round), **index_round(args.layout_round)}
        factor = len(state_items(llama_shapes(), True)) / len(state_items(llama_shapes(), False))
        # what the commit waits for after the last byte is written: the chunk index, and .metadata
        # where it is written before the commit (DCP's way; past METADATA_BEFORE_COMMIT, not)
        r["commit_delay_with_metadata_s"] = r["index_finish_s"] + r["layout_finish_s"] * factor
        r["commit_delay_s"] = r["index_finish_s"]
        print(json.dumps(r))
        return 0
    if args.reshard_round:
        saved, world = map(int, args.reshard_round.split(":"))
        print(json.dumps(reshard_round(saved, world)))
        return 0
    if not args.out:
        parser.error("--out is required")

    factor = len(state_items(llama_shapes(), True)) / len(state_items(llama_shapes(), False))
    result: dict = {"slice_to_whole": factor, "layout": {}, "planning": {}, "whole": {}, "rendezvous": {}, "store": {}}
    result["reshard"] = {}
    raw: dict = {
        "layout": {n: [] for n in args.ranks},
        "reshard": {pair: [] for pair in args.reshard},
        "planning": {n: [] for n in args.ranks},
        "rendezvous": {n: [] for n in args.rendezvous},
        "store": {n: [] for n in args.store_clients},
    }
    scratch = Path(args.scratch)

    def write() -> None:
        keys = LAYOUT_KEYS
        for n, rs in raw["layout"].items():
            if rs:
                result["layout"][n] = {
                    "rounds": rs,
                    **{k: stats.figure([x[k] * (factor if k in LAYOUT_SLICED else 1) for x in rs]) for k in keys},
                }
        for pair, rs in raw["reshard"].items():
            if rs:
                result["reshard"][pair] = {"rounds": rs, **{k: stats.figure([x[k] for x in rs]) for k in RESHARD_KEYS}}
        for n, rs in raw["planning"].items():
            if rs:
                result["planning"][n] = {"rounds": rs, **summary(rs, PLAN_KEYS, factor)}
        for part in ("rendezvous", "store"):
            for n, rs in raw[part].items():
                if rs:
                    result[part][n] = {"rounds": rs, **{k: stats.figure([x[k] for x in rs]) for k in rs[0]}}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    for i in range(args.rounds):
        order = args.ranks if i % 2 == 0 else args.ranks[::-1]
        for n in order:
            raw["layout"][n].append(fresh(["--layout-round", str(n)], 1800))
            print(f"bench.scale: round {i + 1}, {n} ranks planned from the layout: {raw['layout'][n][-1]}", flush=True)
            write()
            if not args.dcp:
                continue
            raw["planning"][n].append(fresh(["--plan-round", str(n)], 1800))
            print(f"bench.scale: round {i + 1}, {n} ranks: {raw['planning'][n][-1]}", flush=True)
            write()
        for pair in args.reshard:
            raw["reshard"][pair].append(fresh(["--reshard-round", pair], 1800))
            print(f"bench.scale: round {i + 1}, a resume {pair} ranks: {raw['reshard'][pair][-1]}", flush=True)
            write()
        for n in args.rendezvous if i % 2 == 0 else args.rendezvous[::-1]:
            raw["rendezvous"][n].append(rendezvous_round(n, scratch))
            print(f"bench.scale: round {i + 1}, rendezvous of {n}: {raw['rendezvous'][n][-1]}", flush=True)
            write()
        for n in args.store_clients:
            raw["store"][n].append(store_round(n))
            print(f"bench.scale: round {i + 1}, store writes: {raw['store'][n][-1]}", flush=True)
            write()
    for n in args.whole if args.dcp else ():
        whole = fresh(["--plan-round", str(n), "--plan-whole"], 1800)
        rounds = raw["planning"].get(n, [])
        part = {k: stats.median([x[k] for x in rounds]) for k in PLAN_KEYS} if rounds else {}
        result["whole"][n] = {
            "round": whole,
            # the whole state's value / the slice's median x factor, per phase: how well the factor predicts it
            "measured_vs_extrapolated": {
                k: whole[k] / (part[k] * factor) for k in PLAN_KEYS if part.get(k) and "manifest" not in k
            },
        }
        print(f"bench.scale: the whole state at {n} ranks: {whole}", flush=True)
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
