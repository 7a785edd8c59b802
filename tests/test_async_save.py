"""Saves that do not grow with the job or stall it (trainer/checkpoint/manager.py): DCP's save-plan caching
(a rank whose plan is unchanged sends none; rank 0 reuses its global plan) with the checksumming
writer, the async saves, and a layout that changes in the same processes; the async save's
process-based path where the installed torch has it."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.device_mesh import DeviceMesh

from conftest import small_parts, small_step
from trainer import torch_compat
from trainer.checkpoint import manager
from trainer.dist import exit_process

UNCHANGED = "No change in the local plan"  # DCP's line when a rank's cached plan is reused
DCP_PLANNER = "torch.distributed.checkpoint.default_planner"

pytestmark = pytest.mark.skipif(not manager._PLAN_CACHING, reason="this torch's DCP has no save-plan caching")


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("planner", ["layout", "dcp"])
@pytest.mark.parametrize("how", ["blocking", "thread", "process"])
def test_a_cached_plan_saves_what_a_fresh_one_does(tmp_path, group, caplog, monkeypatch, how, planner):
    """Three saves of a changing model through one Checkpointer, blocking, async in a thread, and
    async in DCP's save process (where torch has it), planned from the layout (save_plan.py, no
    plan gathered) or, for a state it cannot describe, by DCP's planner: each checkpoint passes
    the manifest and checksum checks (the .xxh3 records written by ChecksumWriter, in the save
    process too) and loads the weights it was saved with; with DCP's planner, in this process,
    the second and third saves reuse the plan (DCP says so; the save process's lines are its own)."""
    if planner == "dcp":
        monkeypatch.setattr(manager.save_plan, "describe", lambda state, world: None)
    if how == "thread":  # what a Checkpointer does when DCP's save process is another layout's
        monkeypatch.setattr(manager, "_SAVER_PROCESS_FOR", (-1, -1))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # where the save process's process group meets
    model, optimizer, scheduler = small_parts(0)
    args = manager.CheckpointArgs(keep=0, async_save=how != "blocking")
    ckpt = manager.Checkpointer(args, str(tmp_path), 0, 1, group, model, optimizer, {"scheduler": scheduler})
    in_process = "async_checkpointer_type" in (ckpt.stager or {})
    if how == "process" and not in_process:
        pytest.skip("this torch's async_save has no process-based path")
    assert in_process == (how == "process")
    caplog.set_level(logging.INFO, DCP_PLANNER)
    saved, reused = {}, []
    for step in (1, 2, 3):
        small_step(model, optimizer, scheduler)
        caplog.clear()
        ckpt.save(step, {"samples": step * 3})
        ckpt.wait()
        reused.append(UNCHANGED in caplog.text)
        assert ckpt.planned_by == planner
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.close()
    assert reused == ([False] * 3 if in_process or planner == "layout" else [False, True, True])
    assert not any(ckpt.plan_key in getattr(SavePlanner, c) for c in torch_compat.PLAN_CACHES)

    for step in (1, 2, 3):
        path = manager.step_path(str(tmp_path), step)
        assert manager.unusable(path) is None
        model, optimizer, scheduler = small_parts(1)
        reader = manager.Checkpointer(
            manager.CheckpointArgs(keep=0, resume_from=path),
            str(tmp_path / f"load{step}"),
            0,
            1,
            group,
            model,
            optimizer,
            {"scheduler": scheduler},
        )
        assert reader.load()["step"] == step
        for key, value in saved[step].items():
            assert torch.equal(model.state_dict()[key], value), (step, key)


def _layouts(rank: int, world: int, root: str, out: str) -> None:
    """Saves of two layouts in the same processes: an FSDP2 model over ranks 0-1, saved twice (the
    second from cached plans), then another over all 3, saved twice; then each checkpoint loaded
    on the 3 ranks. Rank 0 writes what was saved and what was loaded to `out`."""
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=world)
    try:
        pair = dist.new_group([0, 1])
        held = {}
        for name, ranks, grp in (("pair", 2, pair), ("all", world, dist.group.WORLD)):
            if rank < ranks:
                model, optimizer, scheduler = small_parts(0, DeviceMesh.from_group(grp, "cpu"))
                ckpt = manager.Checkpointer(
                    manager.CheckpointArgs(keep=0),
                    os.path.join(root, name),
                    rank,
                    ranks,
                    grp,
                    model,
                    optimizer,
                    {"scheduler": scheduler},
                )
                for step in (1, 2):
                    small_step(model, optimizer, scheduler)
                    ckpt.save(step, {"samples": step * 3}, blocking=True)
                held[f"{name}_saved"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
                ckpt.close()
            dist.barrier()
        for name in ("pair", "all"):
            model, optimizer, scheduler = small_parts(1, DeviceMesh.from_group(dist.group.WORLD, "cpu"))
            path = manager.step_path(os.path.join(root, name), 2)
            ckpt = manager.Checkpointer(
                manager.CheckpointArgs(keep=0, resume_from=path),
                os.path.join(root, f"load_{name}"),
                rank,
                world,
                dist.group.WORLD,
                model,
                optimizer,
                {"scheduler": scheduler},
            )
            assert ckpt.load()["step"] == 2
            held[f"{name}_loaded"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(held, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_process(0)  # past Python's teardown, as the trainer's ranks end (trainer/dist.py exit_process)


@pytest.mark.slow
def test_a_cached_plan_is_never_used_for_another_layout(tmp_path):
    """2 ranks save twice (the second from cached plans), then 3 ranks in the same processes save
    twice: rank 0's cached plans of 2 ranks merged with 3 ranks' new ones would drop a rank's
    shards. Each checkpoint loads on 3 ranks the weights it was saved with."""
    out = tmp_path / "held.pt"
    mp.spawn(_layouts, args=(3, str(tmp_path), str(out)), nprocs=3)
    held = torch.load(out, weights_only=True)
    for name in ("pair", "all"):
        assert held[f"{name}_saved"].keys() == held[f"{name}_loaded"].keys()
        for key, value in held[f"{name}_saved"].items():
            assert torch.equal(held[f"{name}_loaded"][key], value), (name, key)
    assert not torch.equal(held["pair_saved"]["0.weight"], small_parts(1)[0].state_dict()["0.weight"])
