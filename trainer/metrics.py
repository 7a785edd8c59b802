"""What a run reports: JSON rows in run_dir/metrics.jsonl and a live progress line, both from rank 0.

Every row has `time` (Unix seconds). Training rows have `loss`; evaluation rows `eval_loss`; event
rows `event`: "resume" (this start continues from a checkpoint: its `step`, `world_size` and
`checkpoint`) and "restart" (the launcher restarted the ranks after one failed: trainer/launch.py).
A start keeps each step's row once: rows of steps after the one it starts from, logged by an
earlier start that did not save them, move to metrics.superseded.jsonl.
"""

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

    def write(self, values: dict) -> None:
        """Append one row to metrics.jsonl, as given (rows of the run: `timed(...)`)."""
        if self.is_main:
            with open(self.path, "a") as f:
                f.write(_line(values))

    def start(self, step: int, resumed: dict | None) -> None:
        """Before this start's first step: the rows after `step` (an earlier start's, not saved) move
        to metrics.superseded.jsonl, and a resume row follows when `resumed` (the checkpoint's meta)
        says this start continues from a checkpoint. metrics.jsonl is replaced atomically."""
        if not self.is_main:
            return
        try:
            with open(self.path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        kept, superseded = [], []
        for line in lines:
            (superseded if _after(line, step) else kept).append(line + "\n")
        if superseded:
            with open(os.path.join(os.path.dirname(self.path), "metrics.superseded.jsonl"), "a") as f:
                f.writelines(superseded)
        if resumed:
            kept.append(_line(timed({"event": "resume", "step": step, "world_size": resumed["world_size"],
                               "checkpoint": resumed["path"]})))
        if not superseded and not resumed:
            return
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def row(self, values: dict) -> None:
        """Append a training row and refresh the progress line."""
        if not self.is_main:
            return
        self.write(timed(values))
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


def timed(values: dict) -> dict:
    """The row with the wall-clock `time` (Unix seconds) that every row of a run carries."""
    return {**values, "time": round(time.time(), 3)}


def _line(values: dict) -> str:
    return json.dumps(finite_or_null(values), allow_nan=False) + "\n"


def _after(line: str, step: int) -> bool:
    """Whether a metrics.jsonl line belongs after `step`: its row's step is later, or it is no row
    (a line cut short by a kill)."""
    try:
        row = json.loads(line)
        return not isinstance(row, dict) or row.get("step", 0) > step
    except ValueError:
        return True


def finite_or_null(values: dict) -> dict:
    """The row with NaN and infinities as null: strict JSON readers refuse bare NaN/Infinity."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
