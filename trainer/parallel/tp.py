"""Tensor parallelism (parallel.tp > 1, torchtitan's `apply_tp`): the model family's plan splits each
block's matmuls over the mesh's "tp" dimension, the ranks of one node; the loss runs on the head's
vocabulary-sharded logits (`loss_parallel`). What it cannot run with is refused before anything
starts (`problems`). The plan (trainer/parallel/plan.py) applies it first, as torchtitan does:
activation checkpointing, compile and FSDP then see the DTensor blocks.

Importing this module needs no torch (each function imports it where it runs).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from trainer.config import ConfigError

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.config import ParallelArgs
    from trainer.models import ModelArgs
    from trainer.models.family import Family


def problems(
    args: ParallelArgs, world_size: int, ranks_per_node: int, model: ModelArgs | None
) -> list[tuple[str, str]]:
    """What tensor parallelism (tp > 1) cannot run with: the layout, the options it does not compose
    with, and, given the resolved model keys (`model`), a family or shape it cannot split.
    `ranks_per_node`: the ranks of one node (0: not known)."""
    tp, found = args.tp, []
    if args.strategy != "fsdp":
        found.append(("parallel.tp", f"is {tp} but needs parallel.strategy=fsdp (it is {args.strategy}); set tp=1"))
    # its ranks talk at every layer, so they share a node (NVLink): tp divides the ranks of one node
    node = ranks_per_node
    if node and node % tp:
        found.append(
            (
                "parallel.tp",
                f"{tp} does not divide the {node} processes (GPUs) of a node; tensor parallelism stays inside "
                f"a node: choose a divisor of {node}",
            )
        )
    elif world_size % tp:
        found.append(("parallel.tp", f"{tp} does not divide the {world_size} processes; choose a divisor"))
    for key, on in (
        ("cpu_offload", args.cpu_offload),
        ("float8", args.float8 != "none"),
    ):
        if on:
            found.append((f"parallel.{key}", f"does not compose with parallel.tp={tp} (not built); use one of them"))
    if model is None:
        return found
    from trainer.models import spec

    if spec(model).tp_plan is None:
        found.append(("parallel.tp", f"is {tp} but model {model.name!r} has no tensor-parallel plan; set tp=1"))
        return found
    for key, why in (
        ("n_heads", "attention heads"),
        ("n_kv_heads", "key/value heads"),
        ("ffn_dim", "feed-forward units"),
        ("seq_len", "positions (sequence parallelism)"),
    ):
        value = getattr(model, key, None)
        if isinstance(value, int) and value % tp:
            found.append((f"model.{key}", f"{value} {why} do not split over parallel.tp={tp}; use a multiple of {tp}"))
    for key in ("tie_embeddings", "qk_norm"):
        if getattr(model, key, False):
            found.append((f"model.{key}", f"does not compose with parallel.tp={tp} (not built); use one of them"))
    return found


def apply_tp(model: nn.Module, family: Family, mesh: DeviceMesh) -> None:
    """Split the blocks over `mesh` (the "tp" dimension) by the family's plan, in place."""
    if family.tp_plan is None:
        raise ConfigError(f"parallel.tp: is {mesh.size()} but this model has no tensor-parallel plan; set tp=1")
    family.tp_plan(model, mesh)


def loss_parallel(tp: int):
    """Where the loss and its backward run: under tensor parallelism (`tp` > 1) the head's logits stay
    sharded over the vocabulary and cross-entropy is computed on them as they are (torch's
    loss_parallel)."""
    if tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel as sharded_loss

    return sharded_loss()
