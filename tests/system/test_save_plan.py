"""The system tier of tests/unit/test_save_plan.py, whose docstring says what both halves test."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


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
        if rank == 0:
            torch.save(seen, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_process(0)


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
