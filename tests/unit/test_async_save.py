"""Saves that do not grow with the job or stall it (trainer/checkpoint/manager.py): DCP's save-plan caching
(a rank whose plan is unchanged sends none; rank 0 reuses its global plan) with the checksumming
writer, the async saves, and a layout that changes in the same processes; the async save's
process-based path where the installed torch has it."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlanner

from tests.helpers.checkpoints import small_parts, small_step
from trainer import torch_compat
from trainer.checkpoint import manager

UNCHANGED = "No change in the local plan"  # DCP's line when a rank's cached plan is reused
DCP_PLANNER = "torch.distributed.checkpoint.default_planner"

pytestmark = pytest.mark.skipif(not manager._PLAN_CACHING, reason="this torch's DCP has no save-plan caching")


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
