"""Fully sharded data parallelism (FSDP2's `fully_shard`, torchtitan's `apply_fsdp`): which modules
become units (the wrap policy), sharding them over the mesh's data-parallel dimensions, whether
a unit reshards after its forward, and when gradients are reduced under accumulation.

What the FSDP tutorials call auto-wrap policies, sharding strategies, mixed precision and CPU
offload all map onto `fully_shard` arguments here. The plan (trainer/parallel/plan.py) decides
whether FSDP runs and composes it after tensor parallelism, activation checkpointing and compile.

Importing this module needs no torch (each function imports it where it runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.config import ParallelArgs

# A model family's repeated units of a built model (trainer.models.Family.blocks).
Blocks = Callable[["nn.Module"], list["nn.Module"]]


def wrap_units(model: nn.Module, args: ParallelArgs, blocks: Blocks) -> list[nn.Module]:
    """The submodules that become their own FSDP unit (the root is always one more)."""
    if args.wrap == "block":
        return blocks(model)
    # Size policy, like size_based_auto_wrap_policy: post-order, wrap a module once the
    # parameters under it that are not yet wrapped reach the threshold.
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        pending = sum(visit(child) for child in module.children())
        pending += sum(p.numel() for p in module.parameters(recurse=False))
        if module is not model and pending >= args.wrap_min_params:
            units.append(module)
            return 0
        return pending

    visit(model)
    return units


def apply_fsdp(
    model: nn.Module,
    units: list[nn.Module],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
    reshard_after_forward: bool,
    device: torch.device | str,
) -> nn.Module:
    """`fully_shard` each unit, then the root, over `mesh` (its data-parallel dimensions: a 2-D one
    is hybrid sharding, replicated over its outer dimension); parameters end up on `device` (the
    host's memory under `cpu_offload`). `reshard_after_forward`: False keeps every unit gathered
    from forward to backward (sharding=grad_op, ZeRO-2)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    device = torch.device(device)
    options = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy(),
        reshard_after_forward=reshard_after_forward,
    )
    for unit in units:
        fully_shard(unit, **options)
    # The root's parameters (embeddings, head) are needed right after the last block's backward:
    # keeping them unsharded after forward saves one all-gather, as torchtitan does.
    fully_shard(model, **{**options, "reshard_after_forward": False})
    if on_meta(model):  # fully_shard moved real tensors already; meta ones get storage now
        model.to_empty(device="cpu" if cpu_offload else device)
        if cpu_offload:  # FSDP offloads the parameters only: buffers (RoPE tables) stay where compute is
            _buffers_to(model, device)
    return model


def grad_sync(model: nn.Module, micro: int, accum: int, *, every_micro_batch: bool, hybrid: bool):
    """The gradient reduction of micro-batch `micro` of `accum` under FSDP (parallel.grad_sync,
    resolved: trainer.preflight.memory.choose_grad_sync). last_micro_batch: none before the last (the gradients
    stay unsharded). every_micro_batch: a reduce-scatter each micro-batch, FSDP2 adding it into the
    sharded gradient; hybrid sharding all-reduces across its replicas at the last only (torchtitan's
    set_requires_all_reduce). Without accumulation there is nothing to do: the reduction is on by
    default (FSDP's setters walk every module)."""
    if accum == 1:
        return contextlib.nullcontext()
    last_micro = micro == accum - 1
    if every_micro_batch:
        if micro == 0:
            model.set_requires_gradient_sync(True)
        if hybrid:
            model.set_requires_all_reduce(last_micro)
    else:
        model.set_requires_gradient_sync(last_micro)
    return contextlib.nullcontext()


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))  # a registered buffer stays one
