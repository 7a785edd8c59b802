"""How the model is spread over the ranks: FSDP2 (`fully_shard`), DDP as the baseline, or nothing.

`apply` is the one function that does it: the config in, the wrapped model out. What the FSDP
tutorials call auto-wrap policies, sharding strategies, mixed precision and CPU offload all map
onto `fully_shard` arguments here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ParallelArgs
from trainer.dist import Env

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def autocast_dtype(model: nn.Module, args: ParallelArgs) -> torch.dtype | None:
    """The dtype to run the forward under torch.autocast, or None.

    FSDP casts its parameters itself. DDP and plain training use autocast instead, and so does FSDP
    for models with BatchNorm: its running statistics stay float32, which the CPU kernels refuse to
    mix with bfloat16 parameters (FSDP1 kept BatchNorm in float32 for the same reason).
    """
    dtype = DTYPES[args.param_dtype]
    if dtype == torch.float32 or (args.strategy == "fsdp" and not has_batchnorm(model)):
        return None
    return dtype


def mesh_for(args: ParallelArgs, env: Env) -> DeviceMesh:
    device_type = env.device.type
    if args.strategy == "fsdp" and args.sharding == "hybrid":
        shard = args.shard_size or env.local_world_size
        return init_device_mesh(device_type, (env.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (env.world_size,), mesh_dim_names=("dp",))


# A model family's repeated units of a built model (trainer.models.Family.blocks).
Blocks = Callable[[nn.Module], list[nn.Module]]


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


def units_of(model: nn.Module, args: ParallelArgs, blocks: Blocks) -> list[nn.Module]:
    """What activation checkpointing and torch.compile wrap one by one: the FSDP units under FSDP,
    else the model's blocks."""
    return wrap_units(model, args, blocks) if args.strategy == "fsdp" else blocks(model)


def apply(model: nn.Module, args: ParallelArgs, env: Env, blocks: Blocks) -> nn.Module:
    """Wrap `model` for the configured strategy; parameters end up on `env.device`. `blocks`: the
    model family's repeated units (per-block wrapping, activation checkpointing, compile)."""
    if args.float8 != "none":  # first, as torchtitan: compile, checkpointing and FSDP see the float8 layers
        from trainer import float8

        shards = (args.shard_size or env.local_world_size) if args.sharding == "hybrid" else env.world_size
        float8.convert(model, args, blocks, fsdp_ranks=shards if args.strategy == "fsdp" else 0)
    units = units_of(model, args, blocks)
    if args.compile:
        for unit in units:
            unit.compile()
    if args.activation_checkpointing:
        # The wrappers become the FSDP units (torchtitan's order): FSDP's pre-forward hook casts the
        # block's float inputs (the RoPE tables) to param_dtype outside the checkpointed region, so
        # the recompute sees the dtypes the forward saved. Sharded inside the wrapper, torch < 2.13
        # skips that cast in the recompute (pytorch#150140) and raises CheckpointError at step 1.
        units = checkpoint_units(model, units)
    if args.strategy == "none":
        return model.to_empty(device=env.device) if _on_meta(model) else model.to(env.device)
    if args.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = model.to_empty(device=env.device) if _on_meta(model) else model.to(env.device)
        return DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)

    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = mesh_for(args, env)
    param_dtype = torch.float32 if has_batchnorm(model) else DTYPES[args.param_dtype]  # see autocast_dtype
    options = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[args.reduce_dtype]),
        offload_policy=CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if args.cpu_offload else OffloadPolicy(),
        reshard_after_forward=args.sharding != "grad_op",
    )
    for unit in units:
        fully_shard(unit, **options)
    # The root's parameters (embeddings, head) are needed right after the last block's backward:
    # keeping them unsharded after forward saves one all-gather, as torchtitan does.
    fully_shard(model, **{**options, "reshard_after_forward": False})
    if _on_meta(model):  # fully_shard moved real tensors already; meta ones get storage now
        model.to_empty(device="cpu" if args.cpu_offload else env.device)
        if args.cpu_offload:  # FSDP offloads the parameters only: buffers (RoPE tables) stay where compute is
            _buffers_to(model, env.device)
    return model


@torch.no_grad()
def average_batchnorm_stats(model: nn.Module) -> None:
    """Make every BatchNorm's running mean and variance the mean over all ranks.

    FSDP shards parameters, not buffers: each rank's running statistics follow its own batches and
    drift apart (15% after 20 steps of a ResNet), so evaluation and a checkpoint (which keeps one
    rank's copy) would depend on the rank. The trainer calls this before both. The mean of the
    variances leaves out the spread of the ranks' means, as SyncBatchNorm's running statistics do
    not; num_batches_tracked is the same on every rank (every rank takes every step)."""
    stats = [
        buffer
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
        for buffer in (m.running_mean, m.running_var)
    ]
    if not stats or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flat = torch.cat([s.flatten().double() for s in stats])
    dist.all_reduce(flat)  # gloo has no AVG
    flat /= dist.get_world_size()
    for s, mean in zip(stats, flat.split([s.numel() for s in stats])):
        s.copy_(mean.view_as(s))


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def checkpoint_units(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Replace each unit by a checkpoint-wrapped one, in place in its parent; the wrappers, in the
    units' order. State-dict keys do not change: the wrapper's hooks (and DCP) drop its
    `_checkpoint_wrapped_module.` prefix."""
    from trainer.torch_compat import checkpoint_wrapper

    wrapped: dict[int, nn.Module] = {}
    targets = {id(u) for u in units}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                wrapped[id(child)] = checkpoint_wrapper(child)
                parent.register_module(name, wrapped[id(child)])
    return [wrapped[id(u)] for u in units]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model under a DDP wrapper (FSDP2 wraps in place)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
