"""Optimizers and learning-rate schedules.

torch is imported by the functions that build something: the config and its checks (OptimArgs,
schedule_warning) import this module without it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from trainer import torch_compat
from trainer.ranges import AT_LEAST_1, NOT_NEGATIVE, POSITIVE, Range

if TYPE_CHECKING:
    import torch


@dataclass
class OptimArgs:
    name: Literal["adamw", "adam", "adadelta", "sgd"] = "adamw"  # the optimizer (torch.optim's class)
    lr: Annotated[float, POSITIVE] = 3e-3  # peak learning rate
    weight_decay: Annotated[float, NOT_NEGATIVE] = 0.0  # decoupled for AdamW, L2 for the others
    # Adam(W) moment decay rates
    betas: Annotated[
        tuple[float, float],
        Range(0, 1, high_open=True, note=", e.g. 0.9", item=0),
        Range(0, 1, high_open=True, note=", e.g. 0.95", item=1),
    ] = (0.9, 0.95)
    momentum: Annotated[float, Range(0, 1, high_open=True, note=", e.g. 0.9")] = 0.9  # SGD momentum
    # warmup_cosine: linear warmup then cosine decay to min_lr_ratio·lr; step: multiply by gamma
    # every step_size steps (the tutorials' StepLR); constant: lr throughout.
    schedule: Literal["warmup_cosine", "step", "constant"] = "warmup_cosine"
    warmup_steps: Annotated[int, NOT_NEGATIVE] = 20  # linear warmup length, in optimizer steps
    # Optimizer step at which the cosine decay reaches min_lr_ratio·lr (the lr stays there after it);
    # null: train.steps. Set it to keep a run's decay horizon when train.steps is raised to continue it.
    decay_steps: Annotated[int | None, AT_LEAST_1] = None
    min_lr_ratio: Annotated[float, Range(0, 1)] = 0.1  # final lr of the cosine schedule, as a fraction of lr
    step_size: Annotated[int, AT_LEAST_1] = 1  # StepLR period, in optimizer steps
    gamma: Annotated[float, Range(0, 1, low_open=True, note=", e.g. 0.7")] = 0.7  # StepLR decay factor
    fused: bool | None = None  # fused Adam(W) kernels; None: where the device supports them


def build(params, args: OptimArgs, device: torch.device) -> torch.optim.Optimizer:
    import torch

    params = list(params)
    if args.name in ("adamw", "adam"):
        cls = torch.optim.AdamW if args.name == "adamw" else torch.optim.Adam
        fused = args.fused if args.fused is not None else device.type == "cuda"
        return cls(params, lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay, fused=fused)
    if args.name == "adadelta":
        return torch.optim.Adadelta(params, lr=args.lr, weight_decay=args.weight_decay)
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def lr_factor(args: OptimArgs, total_steps: int, step: int) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if args.schedule == "constant":
        return 1.0
    if args.schedule == "step":
        return args.gamma ** (step // args.step_size)
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    decay_steps = max(1, horizon(args, total_steps) - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / decay_steps)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def horizon(args: OptimArgs, total_steps: int) -> int:
    """The step at which the cosine decay ends: optim.decay_steps, else train.steps."""
    return args.decay_steps or total_steps


def schedule_warning(args: OptimArgs, total_steps: int) -> str | None:
    """A line for a schedule that does not do what its numbers suggest, or None."""
    if args.schedule == "warmup_cosine" and total_steps < args.warmup_steps:
        return (
            f"train.steps={total_steps} ends inside the warm-up (optim.warmup_steps={args.warmup_steps}): the lr "
            f"never reaches its peak {args.lr:g}; lower optim.warmup_steps or raise train.steps"
        )
    return None


def schedule_change(saved: dict, args: OptimArgs, total_steps: int, step: int) -> str | None:
    """On a resume at `step`: what happens to the lr when train.steps or the schedule differ from the
    run's saved config (`saved`, the checkpoint's config as a dict); None when the schedule is the same."""
    saved_optim, saved_steps = saved.get("optim", {}), saved.get("train", {}).get("steps", total_steps)
    keys = ("schedule", "warmup_steps", "decay_steps", "min_lr_ratio", "step_size", "gamma")
    changed = [
        f"optim.{k} {saved_optim[k]} -> {getattr(args, k)}"
        for k in keys
        if k in saved_optim and saved_optim[k] != getattr(args, k)
    ]
    old_horizon = saved_optim.get("decay_steps") or saved_steps
    if args.schedule == "warmup_cosine" and old_horizon != horizon(args, total_steps):
        changed.insert(
            0,
            f"train.steps {saved_steps} -> {total_steps}"
            if saved_steps != total_steps
            else f"the decay's end {old_horizon} -> {horizon(args, total_steps)}",
        )
    if not changed:
        return None
    before = _saved_args(saved_optim, args)
    was = args.lr * lr_factor(before, saved_steps, step)
    now = args.lr * lr_factor(args, total_steps, step)
    line = f"the lr schedule changed ({', '.join(changed)})"
    if f"{now:.4g}" != f"{was:.4g}":  # equal as printed: nothing to say about the next step's lr
        line += f": the lr at step {step + 1} is {now:.4g} (it would have been {was:.4g})"
    if args.schedule == "warmup_cosine" and args.decay_steps is None and saved_steps != total_steps:
        line += (
            f"; the cosine decay now ends at step {total_steps} instead of {old_horizon}: to keep the original "
            f"decay, set optim.decay_steps={old_horizon}"
        )
    return line


def _saved_args(saved_optim: dict, args: OptimArgs) -> OptimArgs:
    """OptimArgs as the saved run had them (its schedule keys; the rest as now)."""
    known = {k: v for k, v in saved_optim.items() if k in OptimArgs.__dataclass_fields__ and k != "betas"}
    return OptimArgs(**{**args.__dict__, **known})


def scheduler(optimizer: torch.optim.Optimizer, args: OptimArgs, total_steps: int):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(args, total_steps, step))


def set_peak_lr(scheduler, args: OptimArgs, total_steps: int) -> None:
    """Make args.lr the peak of a resumed schedule: it keeps its place (step) and shape, and the
    configured lr applies from the next step, as a user who changed optim.lr expects."""
    scheduler.base_lrs = [args.lr] * len(scheduler.base_lrs)
    lr = args.lr * lr_factor(args, total_steps, scheduler.last_epoch)
    for group in scheduler.optimizer.param_groups:
        group["initial_lr"], group["lr"] = args.lr, lr
    torch_compat.set_last_lr(scheduler, [lr] * len(scheduler.base_lrs))
