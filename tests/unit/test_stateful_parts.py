"""A checkpoint is a set of named Stateful parts (trainer/checkpoint/manager.py): a sharded part beyond the
model and the optimizer (here EMA weights, sharded like FSDP2 shards the model) is saved through DCP
and resharded at a load on another number of ranks; small parts stay in meta.json; a checkpoint
saved before a part existed loads without it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.checkpoint import manager

EMA_ROWS = 10  # 5 + 5 rows on 2 ranks, 4 + 4 + 2 on 3: the load reads across the saved shards' edges


class EMA:
    """Weights averaged over steps, sharded by rows over the ranks: a state of DTensors, as an EMA
    of an FSDP2 model is. load_state_dict takes what DCP read into state_dict()'s tensors."""

    def __init__(self, mesh, full: torch.Tensor):
        self.weight = distribute_tensor(full, mesh, [Shard(0)])

    def state_dict(self) -> dict:
        return {"weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.weight = state["weight"]


def _ema_full(seed: int) -> torch.Tensor:
    return torch.randn(EMA_ROWS, 3, generator=torch.Generator().manual_seed(seed))


def _checkpointer(run_dir, group, seed: int, ema: EMA | None):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    parts = {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)}
    args = manager.CheckpointArgs(keep=0)
    ckpt = manager.Checkpointer(args, str(run_dir), 0, 1, group, model, optimizer, parts, sharded={"ema": ema})
    return ckpt, model


def test_a_checkpoint_saved_before_a_sharded_part_existed_loads_without_it(tmp_path, group, caplog):
    """A checkpoint of the model and optimizer only (as every checkpoint before sharded parts):
    a run with an EMA part resumes from it, its weights restored, the EMA left as it was, one line
    saying so; its meta.json without 'sharded' reads as the model and the optimizer."""
    ckpt, model = _checkpointer(tmp_path, group, 0, None)
    ckpt.save(1, {"samples": 3}, blocking=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    meta_file = Path(manager.step_path(tmp_path, 1)) / "meta.json"
    assert json.loads(meta_file.read_text())["sharded"] == ["model", "optim"]

    mesh = init_device_mesh("cpu", (1,))
    ema = EMA(mesh, _ema_full(1))
    ckpt, model = _checkpointer(tmp_path, group, 1, ema)
    caplog.set_level(logging.INFO, "trainer")
    meta = ckpt.load()
    assert meta["step"] == 1 and "sharded" in meta
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(ema.weight.full_tensor(), _ema_full(1))
    assert f"checkpoint {meta['path']} holds no ema state (saved before it was kept): it starts afresh" in caplog.text


def test_a_sharded_part_named_like_another_part_is_refused(tmp_path, group):
    mesh = init_device_mesh("cpu", (1,))
    for name in ("model", "optim", "rng"):
        with pytest.raises(ValueError, match=rf"sharded checkpoint part names \['{name}'\] are taken by other parts"):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            manager.Checkpointer(
                manager.CheckpointArgs(),
                str(tmp_path),
                0,
                1,
                group,
                model,
                torch.optim.AdamW(model.parameters()),
                sharded={name: EMA(mesh, _ema_full(0))},
            )
    assert not os.path.exists(manager.folder(str(tmp_path)))  # refused before anything is written
