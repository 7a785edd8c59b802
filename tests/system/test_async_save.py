"""The system tier of tests/unit/test_async_save.py, whose docstring says what both halves test."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from tests.helpers.checkpoints import small_parts, small_step
from trainer.checkpoint import manager
from trainer.dist import exit_process

pytestmark = pytest.mark.skipif(not manager._PLAN_CACHING, reason="this torch's DCP has no save-plan caching")


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
