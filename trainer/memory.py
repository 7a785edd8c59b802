"""How much memory one rank needs, estimated without allocating anything (the model runs on the meta
device), and how much a machine has.

The estimate is a lower bound, to refuse what cannot fit (train.global_batch_size=1000000000), not
to promise that the rest fits. It leaves out: the CUDA context and the allocator's caching and
fragmentation; FSDP's all-gathered (unsharded) copy of the unit being computed; lower-precision
copies of parameters under mixed precision; temporary buffers inside operations (attention
workspaces, the communication buffers of all-reduce and reduce-scatter); tensors that functional
operations between modules keep for backward (residual adds, RoPE); DataLoader workers, pinned
memory and torch.compile's caches. Issue #18 (memory preflight, "will it fit") extends it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer.parallel import DTYPES

# Bytes of optimizer state per parameter (float32): Adam(W) and Adadelta keep two tensors, SGD one
# (its momentum buffer, none without momentum).
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "adadelta": 8, "sgd": 4}


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank holds while it trains, by part."""

    parameters: int  # this rank's float32 parameters (its shard under FSDP)
    gradients: int  # their gradients (sharded under FSDP full and grad_op)
    optimizer: int  # optimizer state (sharded under FSDP full and grad_op)
    activations: int  # what one micro-batch keeps for backward: module outputs and the loss's float32 logits
    activations_per_sample: int  # the same for one sample, to size the micro-batch

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


def estimate(cfg, world_size: int, micro_batch: int) -> Estimate:
    """The memory of one rank training `cfg` on `world_size` ranks, `micro_batch` samples at a time."""
    from trainer import models

    with torch.device("meta"):
        model = models.build(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    p = cfg.parallel
    shards = 1
    if p.strategy == "fsdp":
        shards = (p.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))) if p.sharding == "hybrid" else world_size
    param_shards = shards if p.strategy == "fsdp" and p.sharding != "grad_op" else 1
    state = OPTIMIZER_BYTES[cfg.optim.name] if cfg.optim.name != "sgd" or cfg.optim.momentum else 0
    per_sample = _activations_per_sample(model, cfg)
    return Estimate(parameters=4 * n // param_shards, gradients=4 * n // shards, optimizer=state * n // shards,
                    activations=per_sample * micro_batch, activations_per_sample=per_sample)


def _activations_per_sample(model: torch.nn.Module, cfg) -> int:
    """Bytes of the outputs of every leaf module (conv, linear, norm, ...) for one sample, with
    activation checkpointing only the blocks' inputs and one block's outputs; plus the float32
    copy of the output the loss makes."""
    from trainer import models

    m = cfg.model
    if m.name == "transformer":
        x = torch.zeros(2, m.seq_len, dtype=torch.long, device="meta")
    else:
        side, channels = (28, 1) if m.name == "mnist_cnn" else (m.image_size, 3)
        x = torch.zeros(2, channels, side, side, device="meta")  # 2: BatchNorm refuses one value per channel
    sizes: dict[int, int] = {}  # id(leaf module) -> elements of its output
    block_inputs: list[int] = []

    def leaf_hook(module, args, output):
        sizes[id(module)] = sum(t.numel() for t in _tensors(output))

    def block_hook(module, args):
        block_inputs.append(sum(t.numel() for t in _tensors(args)))

    leaves = [mod for mod in model.modules() if next(mod.children(), None) is None]
    blocks = models.blocks(model) if cfg.parallel.activation_checkpointing else []
    handles = [mod.register_forward_hook(leaf_hook) for mod in leaves]
    handles += [b.register_forward_pre_hook(block_hook) for b in blocks]
    try:
        output = model(x)
    finally:
        for h in handles:
            h.remove()
    elements = sum(sizes.values())
    if blocks:
        inside = [sum(sizes.get(id(mod), 0) for mod in b.modules()) for b in blocks]
        elements += sum(block_inputs) + max(inside) - sum(inside)
    elements_size = DTYPES[cfg.parallel.param_dtype].itemsize
    logits = sum(t.numel() for t in _tensors(output))
    return (elements * elements_size + 4 * logits) // 2  # the forward ran on 2 samples


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def machine_bytes() -> int | None:
    """This machine's memory (MemTotal of /proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
