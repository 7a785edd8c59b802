"""Activation checkpointing (parallel.activation_checkpointing: none, full, selective; torchtitan's
`apply_ac`): a unit's activations are recomputed in backward instead of kept, in full or by the
operator policy (`selective_policy`), or every selective_ac-th unit in full. The plan
(trainer/parallel/plan.py) applies it after tensor parallelism and float8 and before compile and
FSDP, so that the wrappers become the FSDP units.

Importing this module needs no torch (each function imports it where it runs).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn

    from trainer.config import ParallelArgs


def checkpoint_units(model: nn.Module, units: list[nn.Module], args: ParallelArgs | None = None) -> list[nn.Module]:
    """Replace units by checkpoint-wrapped ones, in place in their parents, as `args` says
    (activation_checkpointing and selective_ac; None: full): every unit, in full or with the
    operator policy (`selective_policy`), or every selective_ac-th unit in full (torchtitan counts
    from 1: with 2, the second, fourth, ...). The units with the wrappers in their place, in order.
    State-dict keys do not change: the wrapper's hooks (and DCP) drop its
    `_checkpoint_wrapped_module.` prefix."""
    from trainer.torch_compat import checkpoint_wrapper

    mode, option = (args.ac_mode, args.selective_ac) if args else ("full", "op")
    by_op = mode == "selective" and option == "op"
    every = option if mode == "selective" and not by_op else 1
    targets = {id(u) for i, u in enumerate(units) if (i + 1) % every == 0}
    wrapped: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                wrapped[id(child)] = checkpoint_wrapper(child, selective_context if by_op else None)
                parent.register_module(name, wrapped[id(child)])
    return [wrapped.get(id(u), u) for u in units]


def _saved_ops() -> set:
    """What selective checkpointing by operator keeps (torchtitan's _save_list): the matmuls' outputs
    (every other mm: `selective_policy`), the attention kernels' (the CPU's flash kernel too, so that
    the CPU runs what a GPU does), tensor parallelism's reduce-scatters, and float8's: its scaled
    matmul and the abs-max its scales come from."""
    import torch

    from trainer.torch_compat import reduce_scatter_op

    aten, names = (
        torch.ops.aten,
        (
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_mm",
            "max",
        ),
    )
    ops = {aten.mm.default, reduce_scatter_op()}
    return ops | {getattr(aten, name).default for name in names if hasattr(aten, name)}


def selective_policy(counts: dict):
    """torchtitan's operator policy: keep the outputs of the ops of `_saved_ops`, but recompute every
    second matmul (those with an even count in this forward, or in its recompute: torch < 2.14 asks
    again there); recompute every other op. `counts`: one forward's matmuls, by phase."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    saved, mm = _saved_ops(), torch.ops.aten.mm.default

    def policy(ctx, func, *args, **kwargs):
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[phase] += 1
        keep = func in saved and not (func == mm and counts[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context():
    """The context_fn of a block's checkpoint wrapper: torch's create_selective_checkpoint_contexts
    with the operator policy, its matmul counts new for each forward."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy(collections.Counter()))
