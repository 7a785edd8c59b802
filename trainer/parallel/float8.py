"""float8 training (parallel.float8) through torchao, as torchtitan's float8 converter does.

The blocks' linear layers become torchao's `Float8Linear`: their matmuls run in float8 with dynamic
scales (tensorwise: one per tensor; rowwise: one per row), their weights and the optimizer's state
stay in high precision. The output head and the embeddings are not in a block and stay as they are
(torchtitan filters the output layer out: float8 costs it the most accuracy). Under FSDP, tensorwise
all-gathers the weights in float8 (half of bf16's bytes) and the scales of all of them are computed
in one go after each optimizer step (`precompute_scales`).

Checkpoints stay plain: a `Float8Linear` has `nn.Linear`'s state-dict keys and high-precision
weights, so a float8 checkpoint loads with float8=none and exports to Hugging Face unchanged.

torchao is optional (`pip install .[float8]`): this module is imported only where float8 is asked
for. `emulate` runs the float8 casts and matmuls in high precision on any device: how the tests
train float8 on the CPU; it is no faster.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn as nn

from trainer import torch_compat
from trainer.config import Config, ParallelArgs

log = logging.getLogger("trainer")

# float8 matmuls (torch._scaled_mm) need Ada or Hopper tensor cores: compute capability 8.9 or newer.
MIN_CAPABILITY = (8, 9)
# Every dimension of a float8 matmul must be a multiple of this (torch._scaled_mm's rule).
MULTIPLE = 16


def config_problem(cfg: Config) -> str | None:
    """What makes parallel.float8 impossible for this config, or None; checked before anything
    starts (trainer/preflight/check.py). The device's own check is `device_problem`, on each rank."""
    p = cfg.parallel
    if importlib.util.find_spec("torchao") is None:
        return f"{p.float8} needs torchao, which is not installed; install it with: pip install .[float8]"
    if not p.compile and not p.float8_emulate:
        return (
            f"{p.float8} needs parallel.compile=true: without torch.compile torchao's float8 casts run as "
            "separate kernels and the run is slower than bf16"
        )
    linears = block_linears(cfg)
    if not linears:
        return f"{p.float8}: the model ({cfg.model.name}) has no linear layer in its blocks to train in float8"
    for name, linear in linears:
        if linear.in_features % MULTIPLE or linear.out_features % MULTIPLE:
            return (
                f"{p.float8}: the blocks' linear layer {name} is {linear.in_features} -> {linear.out_features}, "
                f"not divisible by {MULTIPLE} (float8 matmuls need it); change the model's dimensions or use none"
            )
    return None


def device_problem(args: ParallelArgs, device: torch.device) -> str | None:
    """What keeps this rank's device from float8 matmuls, or None (emulation runs anywhere)."""
    if args.float8 == "none" or args.float8_emulate:
        return None
    if device.type != "cuda":
        return (
            f"{args.float8} needs a GPU of compute capability {'.'.join(map(str, MIN_CAPABILITY))} or newer, "
            f"and this rank runs on the {device.type}; use none here (parallel.float8_emulate=true only tests it)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"{args.float8} needs a GPU of compute capability {'.'.join(map(str, MIN_CAPABILITY))} or newer "
            f"(Ada, Hopper), and {torch.cuda.get_device_name(device)} has {'.'.join(map(str, capability))}; use none"
        )
    return None


def block_linears(cfg: Config) -> list[tuple[str, nn.Linear]]:
    """The linear layers float8 converts, built on the meta device (nothing allocated)."""
    from trainer import models

    family = models.spec(cfg.model)
    with torch.device("meta"):
        model = family.build(cfg.model)
    return _linears(model, family.blocks)


def _linears(model: nn.Module, blocks) -> list[tuple[str, nn.Linear]]:
    names = {id(m): name for name, m in model.named_modules()}
    return [
        (f"{names[id(block)]}.{name}", m)
        for block in blocks(model)
        for name, m in block.named_modules()
        if type(m) is nn.Linear
    ]


def convert(model: nn.Module, args: ParallelArgs, blocks, fsdp_ranks: int) -> None:
    """Swap the blocks' linear layers for torchao's Float8Linear, in place; before fully_shard, so
    that FSDP shards (and, tensorwise, all-gathers in float8) their weights. `fsdp_ranks`: how many
    ranks FSDP shards a weight over (0: no FSDP).

    Float8 all-gather only where each rank holds as many rows: torchao 0.18 casts the unpadded
    shard (its fsdp_pre_all_gather takes the mesh alone, so FSDP2 does not check it), and a rank
    whose shard FSDP padded sends fewer bytes than the all-gather expects (64 rows on 3 ranks:
    gloo aborts on the size mismatch). Such a layer is all-gathered in param_dtype, then cast."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = _linears(model, blocks)
    if args.float8 == "tensorwise":
        config = Float8LinearConfig(emulate=args.float8_emulate)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=args.float8_emulate)
        # torchtitan's workaround for pytorch#150859: compiled rowwise casts must round as eager ones do
        torch_compat.emulate_precision_casts()
    gathered = set()
    if args.float8 == "tensorwise" and fsdp_ranks:
        gathered = {id(m) for _, m in linears if m.out_features % fsdp_ranks == 0}
        uneven = [name for name, m in linears if id(m) not in gathered]
        if uneven:
            log.info(
                "float8: %d linear layer(s) (%s) have rows that %d ranks do not share evenly: they are "
                "all-gathered in param_dtype, the others in float8",
                len(uneven),
                ", ".join(uneven[:3]) + (", ..." if len(uneven) > 3 else ""),
                fsdp_ranks,
            )
        all_gather = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=all_gather, module_filter_fn=lambda m, _fqn: id(m) in gathered)
    rest = {id(m) for _, m in linears} - gathered
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, _fqn: id(m) in rest)
    for module in model.modules():
        if type(module).__name__ == "Float8Linear":  # a no-op where the weight is a plain tensor
            module.register_state_dict_post_hook(_plain_weight)


def _plain_weight(module: nn.Module, state_dict: dict, prefix: str, _local_metadata) -> None:
    """The weight in the state dict as a plain tensor (a DTensor of one under FSDP) sharing the
    parameter's storage, where float8 all-gather made it torchao's WeightWithDynamicFloat8CastTensor:
    DCP would pickle that class into the checkpoint, which then loads only with torchao (and not
    through the trainer's restricted unpickler). A load into the plain view fills the parameter."""
    from torch.distributed.tensor import DTensor

    key = prefix + "weight"
    weight = state_dict.get(key)
    if isinstance(weight, DTensor) and hasattr(torch_compat.local_tensor(weight), "_tensor"):
        state_dict[key] = DTensor.from_local(
            torch_compat.local_tensor(weight)._tensor,
            weight.device_mesh,
            weight.placements,
            run_check=False,
            shape=weight.shape,
            stride=weight.stride(),
        )
    elif hasattr(weight, "_tensor"):
        state_dict[key] = weight._tensor


def precompute_scales(model: nn.Module, args: ParallelArgs, fsdp_ranks: int) -> None:
    """After each optimizer step under FSDP with tensorwise scaling: the scales of all float8 weights
    in one all-reduce, instead of one per weight at its all-gather. `fsdp_ranks`: as `convert`'s, the
    plan's (0: no FSDP)."""
    if args.float8 == "tensorwise" and fsdp_ranks:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
