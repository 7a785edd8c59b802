"""The system tier of tests/unit/test_stateful_parts.py, whose docstring says what both halves test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.unit.test_stateful_parts import EMA, _ema_full
from trainer.checkpoint import manager, reader
from trainer.checkpoint.reader import load_metadata
from trainer.dist import exit_process


def _worker(rank: int, world: int, run_dir: str, action: str, out: str) -> None:
    """One rank: `save` step 1 with the EMA part (the full EMA and weights written to `out`), or
    `load` it into a fresh model and EMA of another seed (what they hold after the load to `out`)."""
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0 if action == "save" else 1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Linear(7, 2))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        ema = EMA(mesh, _ema_full(0 if action == "save" else 1))
        ckpt = manager.Checkpointer(
            manager.CheckpointArgs(keep=0),
            run_dir,
            rank,
            world,
            dist.group.WORLD,
            model,
            optimizer,
            parts={"scheduler": scheduler},
            sharded={"ema": ema},
        )
        if action == "save":
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            scheduler.step()
            ckpt.save(1, {"samples": 3}, blocking=True)
        else:
            # the checkpoint's metadata read by this rank (its chunk index, or .metadata unpickled where it
            # has none): rank 0 once, for every rank (checkpoint.choose)
            reads = []
            real, real_index = reader.load_metadata, manager._read_index
            manager.load_metadata = reader.load_metadata = lambda path: reads.append(path) or real(path)
            manager._read_index = lambda path, record: reads.append(path) or real_index(path, record)
            meta = ckpt.load()
            assert meta is not None and meta["step"] == 1
            counts = [None] * world
            dist.all_gather_object(counts, len(reads))
            assert counts == [1] + [0] * (world - 1), counts
            # each rank got the saved chunks its own rows overlap (rows 0-4, 4-8, 8-10 of 5 + 5), no other
            held = [None] * world
            dist.all_gather_object(
                held, [list(c.offsets) for c in ckpt.metadata.state_dict_metadata["ema.weight"].chunks]
            )
            assert held == [[[0, 0]], [[0, 0], [5, 0]], [[5, 0]]], held
        held = {"ema": ema.weight.full_tensor(), **{k: v.full_tensor() for k, v in model.state_dict().items()}}
        held["last_epoch"] = torch.tensor(scheduler.last_epoch)
        if rank == 0:
            torch.save(held, out)
        ckpt.close()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Past Python's teardown, as the trainer's ranks end: a gloo thread that outlives the
    # interpreter aborts the process one exit in a few (trainer/dist.py exit_process).
    exit_process(0)


def _run(world: int, run_dir, action: str, out) -> dict:
    mp.spawn(_worker, args=(world, str(run_dir), action, str(out)), nprocs=world)
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_a_sharded_part_is_saved_through_dcp_and_resharded_from_2_to_3_ranks(tmp_path):
    """EMA weights of 10 rows saved by 2 ranks (5 + 5) load on 3 (4 + 4 + 2) equal, with the model
    and the small parts; the load's metadata (its chunk index) is read once, by rank 0, and each rank
    gets the records of the saved chunks its own rows overlap."""
    run_dir = tmp_path / "run"
    saved = _run(2, run_dir, "save", tmp_path / "saved.pt")
    step1 = Path(manager.step_path(run_dir, 1))
    meta = json.loads((step1 / "meta.json").read_text())
    assert meta["sharded"] == ["model", "optim", "ema"] and "ema" not in meta and meta["scheduler"]["last_epoch"] == 1
    stored = {key.split(".")[0] for key in load_metadata(step1 / ".metadata").state_dict_metadata}
    assert stored == {"model", "optim", "ema"}

    loaded = _run(3, run_dir, "load", tmp_path / "loaded.pt")
    assert set(loaded) == set(saved)
    assert not torch.equal(_ema_full(0), _ema_full(1))  # the load had something to change
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), key
    assert torch.equal(loaded["ema"], _ema_full(0))
