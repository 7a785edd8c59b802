"""What a run reports: JSON rows in run_dir/metrics.jsonl and a live progress line, both from rank 0."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("trainer")


@dataclass
class LogArgs:
    interval: int = 10  # optimizer steps between metric rows
    progress: bool = True  # live progress line on a terminal (rank 0 only)
    tensorboard: bool = False  # also write TensorBoard event files to <run_dir>/tensorboard (trainer/trackers.py)
    wandb: bool = False  # also log to a Weights & Biases run, the same one after each restart
    mlflow: bool = False  # also log to an MLflow run at MLFLOW_TRACKING_URI, the same one after each restart
    project: str | None = None  # W&B project / MLflow experiment; None: the run dir's name
    # A rank whose compute time per step (a metrics row's compute_s_*) exceeds this many times the
    # median of all ranks' for 3 logged windows in a row is named as a straggler (rank and node); > 1.
    straggler_factor: float = 1.5


# Dense bf16 peak FLOP/s by device name, from the vendors' data sheets. The first key found in the
# name counts: the specific names come before the general ones.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak device memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def setup_logging(rank: int) -> None:
    """INFO from rank 0 only; the other ranks speak up for warnings and errors."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


class Reporter:
    def __init__(self, run_dir: str, args: LogArgs, total_steps: int, is_main: bool):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.total_steps, self.is_main = total_steps, is_main
        self.live = is_main and args.progress and sys.stdout.isatty()
        self.started = time.perf_counter()
        self.first_step: int | None = None
        self.trackers = None  # trainer.trackers.Trackers on rank 0 when any is configured

    def write(self, values: dict) -> None:
        """Append one row to metrics.jsonl (and hand it to the trackers)."""
        if self.is_main:
            with open(self.path, "a") as f:
                f.write(json.dumps(finite_or_null(values), allow_nan=False) + "\n")
            if self.trackers:
                self.trackers.log(values)

    def row(self, values: dict) -> None:
        """Append a training row and refresh the progress line."""
        if not self.is_main:
            return
        self.write(values)
        step = values["step"]
        if self.first_step is None:
            self.first_step, self.started = step, time.perf_counter()
            eta = float("nan")
        else:
            rate = (step - self.first_step) / (time.perf_counter() - self.started)
            eta = (self.total_steps - step) / rate
        text = f"step {step}/{self.total_steps}  loss {values['loss']:.4f}  {values['samples_per_s']:.1f} samples/s"
        if "tokens_per_s" in values:
            text += f"  {values['tokens_per_s']:.0f} tok/s"
        if "mfu" in values:
            text += f"  mfu {values['mfu']:.1%}"
        text += f"  eta {_duration(eta)}"
        if self.live:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
        else:
            log.info(text)

    def message(self, text: str) -> None:
        """A log line (rank 0) that does not garble the live progress line."""
        if not self.is_main:
            return
        if self.live:
            sys.stdout.write("\n")
        log.info(text)


def finite_or_null(values: dict) -> dict:
    """The row with NaN and infinities as null: strict JSON readers refuse bare NaN/Infinity."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
