"""The system tier of tests/unit/test_save_plan.py, whose docstring says what both halves test."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from trainer.checkpoint import manager


def _real_saves(rank: int, world: int, root: str, out: str) -> None:
    """On 4 gloo ranks, two layouts of small_parts' model: FSDP2 over 4 ranks (uneven: the second
    layer's weight has 2 rows for 4 ranks) and hybrid sharding (2 replicas x 2 shards). Each saved
    by the Checkpointer planning from the layout, and again with DCP's planner; loaded back by the
    Checkpointer into another seed's parts, and by stock DCP (dcp.load, its own FileSystemReader
    and planner). Rank 0 writes what it saw to `out`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers.checkpoints import small_parts, small_step
    from trainer.checkpoint import manager
    from trainer.checkpoint.reader import load_metadata
    from trainer.dist import exit_process

    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=world)
    seen: dict = {}
    try:
        for name, shape, dims in (("fsdp", (4,), ("shard",)), ("hsdp", (2, 2), ("replicate", "shard"))):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
            model, optimizer, scheduler = small_parts(0, mesh)
            small_step(model, optimizer, scheduler)
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            moments = {k: v["exp_avg"].full_tensor() for k, v in optimizer.state_dict()["state"].items()}
            for planner in ("layout", "dcp"):
                run_dir = os.path.join(root, f"{name}_{planner}")
                ckpt = manager.Checkpointer(
                    manager.CheckpointArgs(keep=0),
                    run_dir,
                    rank,
                    world,
                    dist.group.WORLD,
                    model,
                    optimizer,
                    {"scheduler": scheduler},
                )
                if planner == "dcp":
                    real, manager.save_plan.describe = manager.save_plan.describe, lambda state, world: None
                ckpt.save(1, {"samples": 3}, blocking=True)
                if planner == "dcp":
                    manager.save_plan.describe = real
                seen[f"{name}_{planner}_planned_by"] = ckpt.planned_by
                ckpt.close()
            paths = {p: manager.step_path(os.path.join(root, f"{name}_{p}"), 1) for p in ("layout", "dcp")}
            if rank == 0:
                mds = {p: load_metadata(os.path.join(path, ".metadata")) for p, path in paths.items()}
                seen[f"{name}_same_chunks"] = mds["layout"].state_dict_metadata == mds["dcp"].state_dict_metadata
                seen[f"{name}_same_storage"] = mds["layout"].storage_data == mds["dcp"].storage_data
                seen[f"{name}_same_mappings"] = mds["layout"].planner_data == mds["dcp"].planner_data
            # the trainer's load, into another seed's parts
            model2, optimizer2, scheduler2 = small_parts(1, mesh)
            small_step(model2, optimizer2, scheduler2)
            ckpt = manager.Checkpointer(
                manager.CheckpointArgs(keep=0, resume_from=paths["layout"]),
                os.path.join(root, f"{name}_load"),
                rank,
                world,
                dist.group.WORLD,
                model2,
                optimizer2,
                {"scheduler": scheduler2},
            )
            seen[f"{name}_loaded_step"] = ckpt.load()["step"]
            seen[f"{name}_index_written"] = os.path.isfile(os.path.join(paths["layout"], "chunks.npz"))
            chunks = ckpt.metadata.state_dict_metadata["model.0.weight"].chunks
            seen[f"{name}_chunks_held_{rank}"] = len(chunks)
            got = {k: v.full_tensor() for k, v in model2.state_dict().items()}
            got_moments = {k: v["exp_avg"].full_tensor() for k, v in optimizer2.state_dict()["state"].items()}
            seen[f"{name}_exact"] = all(torch.equal(got[k], full[k]) for k in full) and all(
                torch.equal(got_moments[k], moments[k]) for k in moments
            )
            # stock DCP: its reader, its planner
            model3, _, _ = small_parts(2, mesh)
            stock = {"model": get_model_state_dict(model3)}
            dcp.load(stock, checkpoint_id=paths["layout"])
            seen[f"{name}_stock_exact"] = all(torch.equal(stock["model"][k].full_tensor(), full[k]) for k in full)
        _deferred(rank, world, root, seen)
        if rank == 0:
            torch.save(seen, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_process(0)


def _deferred(rank: int, world: int, root: str, seen: dict) -> None:
    """A save past save_plan.METADATA_BEFORE_COMMIT (0 here), FSDP2 over the 4 ranks: committed with
    chunks.npz and no .metadata, which rank 0's background process (trainer/checkpoint/stock.py)
    writes after the commit; a second save at once with keep=1, whose retention deletes the first
    (its writer stopped first). Then stock dcp.load of the second, once its .metadata is there; the
    trainer's resume from it with .metadata moved away; the command writing it on demand."""
    import json
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers.checkpoints import small_parts, small_step
    from trainer.checkpoint import manager, save_plan
    from trainer.checkpoint.reader import load_metadata

    before = save_plan.METADATA_BEFORE_COMMIT
    save_plan.METADATA_BEFORE_COMMIT = 0
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model, optimizer, scheduler = small_parts(0, mesh)
    small_step(model, optimizer, scheduler)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    moments = {k: v["exp_avg"].full_tensor() for k, v in optimizer.state_dict()["state"].items()}
    run_dir = os.path.join(root, "deferred")
    args = manager.CheckpointArgs(keep=1)
    ckpt = manager.Checkpointer(
        args, run_dir, rank, world, dist.group.WORLD, model, optimizer, {"scheduler": scheduler}
    )
    ckpt.save(1, {"samples": 3}, blocking=True)
    if rank == 0:
        with open(os.path.join(manager.step_path(run_dir, 1), "manifest.json")) as f:
            listed = json.load(f)["files"]
        seen["deferred_listed"] = (".metadata" in listed, save_plan.INDEX in listed)
    ckpt.save(2, {"samples": 6}, blocking=True)
    ckpt.close()
    path = manager.step_path(run_dir, 2)
    if rank == 0:
        if ckpt.stock.running:
            seen["deferred_writer_exit"] = ckpt.stock.running[1].wait()
        seen["deferred_folders"] = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
        seen["deferred_files"] = sorted(os.listdir(path))
    dist.barrier()
    stock_parts, _, _ = small_parts(2, mesh)
    stock = {"model": get_model_state_dict(stock_parts)}
    dcp.load(stock, checkpoint_id=path)
    seen["deferred_stock_exact"] = all(torch.equal(stock["model"][k].full_tensor(), full[k]) for k in full)
    dist.barrier()
    moved = os.path.join(root, "deferred.metadata")
    if rank == 0:
        os.rename(os.path.join(path, ".metadata"), moved)
        try:  # what a reader of .metadata is told meanwhile
            load_metadata(os.path.join(path, ".metadata"))
        except FileNotFoundError as e:
            seen["deferred_missing"] = str(e)
    dist.barrier()
    model2, optimizer2, scheduler2 = small_parts(1, mesh)
    small_step(model2, optimizer2, scheduler2)
    args = manager.CheckpointArgs(keep=0, resume_from=path)
    again = manager.Checkpointer(
        args,
        os.path.join(root, "deferred_load"),
        rank,
        world,
        dist.group.WORLD,
        model2,
        optimizer2,
        {"scheduler": scheduler2},
    )
    seen["deferred_loaded_step"] = again.load()["step"]
    got = {k: v.full_tensor() for k, v in model2.state_dict().items()}
    got_moments = {k: v["exp_avg"].full_tensor() for k, v in optimizer2.state_dict()["state"].items()}
    seen["deferred_exact"] = all(torch.equal(got[k], full[k]) for k in full) and all(
        torch.equal(got_moments[k], moments[k]) for k in moments
    )
    again.close()
    dist.barrier()
    if rank == 0:
        command = [sys.executable, "-m", "trainer.checkpoint.stock", path]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        seen["deferred_command"] = (done.returncode, done.stdout.strip(), done.stderr.strip())
        with open(moved, "rb") as a, open(os.path.join(path, ".metadata"), "rb") as b:
            seen["deferred_same_bytes"] = a.read() == b.read()
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        seen["deferred_command_again"] = (done.returncode, done.stdout.strip())
    save_plan.METADATA_BEFORE_COMMIT = before
    dist.barrier()


@pytest.mark.slow
def test_a_real_4_rank_save_planned_from_the_layout_is_dcps_and_loads_exactly(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "seen.pt"
    mp.spawn(_real_saves, args=(4, str(tmp_path), str(out)), nprocs=4)
    seen = torch.load(out, weights_only=True)
    for name in ("fsdp", "hsdp"):
        assert seen[f"{name}_layout_planned_by"] == "layout" and seen[f"{name}_dcp_planned_by"] == "dcp"
        assert seen[f"{name}_same_chunks"], f"{name}: .metadata's chunk lists are DCP's"
        assert seen[f"{name}_same_storage"], f"{name}: .metadata's storage records are DCP's"
        assert seen[f"{name}_same_mappings"]
        assert seen[f"{name}_loaded_step"] == 1
        assert seen[f"{name}_index_written"]
        assert seen[f"{name}_chunks_held_0"] == 1, "rank 0 planned its reads from its own chunk's record alone"
        assert seen[f"{name}_exact"], f"{name}: weights and moments loaded as saved"
        assert seen[f"{name}_stock_exact"], f"{name}: stock dcp.load reads the checkpoint"
    # past METADATA_BEFORE_COMMIT: .metadata after the commit, by rank 0's background process
    assert seen["deferred_listed"] == (False, True), "committed with chunks.npz, without .metadata"
    assert seen.get("deferred_writer_exit", 0) == 0
    assert seen["deferred_folders"] == ["step_00000002"], "retention deleted step 1 whole, its writer stopped"
    assert ".metadata" in seen["deferred_files"] and not [n for n in seen["deferred_files"] if ".tmp-" in n]
    assert seen["deferred_stock_exact"], "stock dcp.load reads the .metadata written after the commit"
    assert seen["deferred_loaded_step"] == 2 and seen["deferred_exact"], "the trainer's resume needs no .metadata"
    path = manager.step_path(str(tmp_path / "deferred"), 2)
    code, said, errors = seen["deferred_command"]
    assert code == 0 and said.startswith(f"wrote {path}/.metadata: ") and not errors, seen["deferred_command"]
    assert seen["deferred_same_bytes"], "the command writes what the background process wrote"
    assert seen["deferred_command_again"] == (0, f"{path} has its .metadata already")
    assert seen["deferred_missing"] == (
        f"{path}/.metadata is not written (yet): the checkpoint committed without it, its chunks.npz stands for "
        f"it; `python -m trainer.checkpoint.stock {path}` writes it"
    )
