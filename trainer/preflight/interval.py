"""When to save: the checkpoint interval's planning, apart from checkpoint I/O (trainer/checkpoint/manager.py).

The Young-Daly interval of checkpoint.interval=auto (AutoInterval), and what one save costs before a
save was measured (save_seconds, from the model's parameters counted on the meta device). The Slurm
submission and the preflight (trainer/preflight/startup.py) ask these from a login node without
importing the checkpoint module; the trainer asks them at its first step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from trainer.rundir import objects

if TYPE_CHECKING:
    from trainer.config import Config


# Mean time between interruptions of one GPU, in hours, from the Llama 3 report (Meta, 2024, section
# 3.3.4): 466 job interruptions in 54 days of pre-training on 16,384 H100 GPUs. A job of G GPUs is
# interrupted G times as often.
GPU_MTBF_HOURS = 54 * 24 * 16384 / 466


def young_daly_interval(save_s: float, mtbf_s: float, step_s: float) -> int:
    """Optimizer steps between saves that lose the least expected time (Young 1974, Daly 2006): a save
    every sqrt(2 x save_s x mtbf_s) seconds, `save_s` being what one save blocks training, `mtbf_s` the
    mean time between interruptions, `step_s` one step; at least 1."""
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    return max(1, round(math.sqrt(2 * max(save_s, 0.0) * mtbf_s) / step_s))


# Write speed of one node assumed until a save of the run was measured: cautious for NFS/Lustre
# (bench/results has this machine's figures; a parallel filesystem often does several GB/s).
ASSUMED_SAVE_GB_PER_S_PER_NODE = 1.0


def param_count(cfg: Config) -> int:
    """Parameters of the model of `cfg`, a resolved config (the preflight's, trainer/preflight/startup.py:
    model.init_from's shape read from its config.json, the vocabulary from the sidecars), counted on
    the meta device (nothing is allocated)."""
    import torch

    from trainer.models import build

    with torch.device("meta"):
        return sum(p.numel() for p in build(cfg.model).parameters())


def save_seconds(cfg: Config, nodes: int, run_dir: str, shown: str | None = None) -> tuple[float, str]:
    """(seconds one blocking save takes, how that was found): measured by this run dir's last
    blocking save if there was one, else estimated from the state's size (`cfg`: resolved).
    `shown`: the run dir as the answer names it (an s3:// run dir's URL, `run_dir` its staging copy)."""
    measured = objects.read_status(run_dir).get("save_s")
    if isinstance(measured, (int, float)) and not isinstance(measured, bool) and measured >= 0:  # status is untrusted
        return float(measured), f"measured by the last save in {shown or run_dir}"
    params = param_count(cfg)
    from trainer.preflight.memory import checkpoint_bytes  # the one table of bytes per parameter

    gb = params * checkpoint_bytes(cfg.optim.name) / 1e9
    seconds = gb / (nodes * ASSUMED_SAVE_GB_PER_S_PER_NODE)
    return seconds, (
        f"estimated: {params / 1e6:.1f}M parameters, {gb:.2f} GB of weights and optimizer state over "
        f"{nodes} node(s) at an assumed {ASSUMED_SAVE_GB_PER_S_PER_NODE:g} GB/s each"
    )


class AutoInterval:
    """checkpoint.interval=auto: the Young-Daly interval, chosen once the first step's time is known
    (with the save cost estimated), chosen again after each save whose measured cost differs by more
    than RECHOOSE from the one the interval was chosen with."""

    RECHOOSE = 0.25  # relative change of the save cost that makes the interval be chosen again

    def __init__(self, mtbf_s: float, estimated_save_s: float, how: str):
        self.mtbf_s, self.save_s, self.how = mtbf_s, estimated_save_s, how
        self.steps: int | None = None  # the interval chosen, in steps; None before the first step
        self.chosen_with: float | None = None  # the save cost it was chosen with

    def choose(self, step_s: float) -> int:
        self.steps, self.chosen_with = young_daly_interval(self.save_s, self.mtbf_s, step_s), self.save_s
        return self.steps

    def measured(self, save_s: float) -> bool:
        """Record a measured save; True if the interval should be chosen again."""
        self.save_s, self.how = save_s, "measured by the last save"
        return abs(save_s - self.chosen_with) > self.RECHOOSE * self.chosen_with

    def line(self, step: int, step_s: float, next_save: int) -> str:
        return (
            f"checkpoint.interval=auto: every {self.steps} steps (~{self.steps * step_s:.1f} s) from step {step}, "
            f"next save at step {next_save}: sqrt(2 x {self.save_s:.3f} s per save ({self.how}) x "
            f"{self.mtbf_s / 3600:.4g} h between interruptions) / {step_s:.3f} s per step"
        )
