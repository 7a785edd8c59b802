"""What a run reports: JSON rows in run_dir/metrics.jsonl and a live progress line, both from rank 0.

Every row has `time` (Unix seconds). Training rows have `loss`; evaluation rows `eval_loss`; event
rows `event`: "resume" (this start continues from a checkpoint: its `step`, `world_size` and
`checkpoint`, and `start`: the moments of this start, below) and "restart" (the launcher restarted the
ranks after one failed: trainer/launchers/torchrun.py; its `time` is when the launcher saw the failure) and
"epoch" (a pass over the training data begins: `epoch`, counted from 0, at `step`, the step that
reads its first sample; with data.sources, `data_source` names whose pass it is: `source` is
trainer.evaluate's, the tool that wrote an evaluation row). Training rows over
data that ends (a token file, images) carry `epoch`, the passes made so far (`epoch/<source>` each
for data.sources), as the live line shows them. "early_stop" (the run stopped early at `step`:
`best_eval_loss` at `best_step`, `patience`, `reason`: "patience", or "not_finite" for a NaN or
infinite eval loss; trainer/early_stop.py) has no `eval_loss` of its own.
A start keeps each step's row once: rows of steps after the one it starts from, logged by an
earlier start that did not save them, move to metrics.superseded.jsonl. A line that is not such a
row (not a JSON object with an integer `step` and a numeric `time` if any: a line cut short by a kill, or
someone else's bytes in a shared run dir) is dropped with one warning, never copied anywhere.
Both files are touched only through trainer/rundir/files.py: a link or FIFO planted at either is refused.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer import cli, early_stop
from trainer.config import LogArgs
from trainer.rundir import files, layout, objects

if TYPE_CHECKING:  # torch is imported where a device is asked about: reading rows (api.metrics) needs none
    import torch

log = logging.getLogger("trainer")

# The launcher's moments of a start, handed to its ranks as JSON in this variable (Unix seconds):
# `launcher` its process began, `stopped` torchrun's agent had stopped the ranks before (a restart
# inside the allocation only), `rendezvous` the agent's rendezvous was done and it started the ranks.
START_ENV = "TRAINER_START_TIMES"

# The longest line of a metrics file that can be a row (a row is ~300 bytes; one with many sources'
# keys a few kilobytes): a longer one is read through and dropped as not a row. The files themselves
# are streamed, never read whole: a long run's metrics.jsonl may be gigabytes.
METRICS_LINE_BYTES = 64 << 10


def process_started() -> float:
    """Unix seconds at which this process began (Linux /proc, to 10 ms); now where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return round(time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return round(time.time(), 3)


def start_times(**mine: float) -> dict:
    """The moments of this start for the resume row: the launcher's (START_ENV), this process's start
    and `mine` (the rank's own: imports done, process group, load start and end), rounded to 1 ms."""
    try:
        given = json.loads(os.environ.get(START_ENV, "{}"))
    except ValueError:
        given = {}
    return {**given, "process": process_started(), **{k: round(v, 3) for k, v in mine.items()}}


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
    import torch

    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def peak_memory_gb(device: torch.device | None) -> float:
    """Peak device memory on GPU; peak resident set size of this process on CPU (or device None)."""
    if device is not None and device.type == "cuda":
        import torch

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


@dataclass
class Speed:
    """What a training row's throughput and MFU are computed from."""

    samples_per_step: int  # the global batch
    tokens_per_sample: int | None = None  # language models: the sequence length; None: no token figures
    flops_per_token: float | None = None  # the model's training FLOPs per token; None: no MFU
    peak_flops: float | None = None  # one device's peak (metrics.peak_flops); None: no MFU
    world_size: int = 1
    device: torch.device | None = None  # whose peak memory the rows report; None: this process's (CPU)


class Reporter:
    def __init__(self, run_dir: str, args: LogArgs, total_steps: int, is_main: bool):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.args, self.total_steps, self.is_main = args, total_steps, is_main
        self.live = is_main and args.progress and sys.stdout.isatty()
        self.started = time.perf_counter()
        self.first_step: int | None = None
        self.trackers = None  # trainer.observe.trackers.Trackers on rank 0 when any is configured
        self.speed = Speed(1)
        self.window = (0, time.perf_counter())  # the step and time of the last row (or the start)
        self.stragglers = None
        self.node_of = lambda rank: "?"  # a rank's node, for the straggler line

    def begin(self, step: int, speed: Speed, node_of=None) -> None:
        """Right before the first step: rows measure from here; `node_of(rank)` names a rank's node."""
        from trainer.resilience.hangs import Stragglers

        self.speed, self.window = speed, (step, time.perf_counter())
        self.stragglers = Stragglers(self.args.straggler_factor)
        if node_of is not None:
            self.node_of = node_of

    def training_row(self, step: int, values: dict, compute_times: list[float]) -> None:
        """The row of a logged step, on every rank alike: `values` (loss, lr, ...) and what the reporter
        measures itself: throughput and step time over the steps since the last row, tokens and MFU
        where the model counts them, peak memory, and the spread of the ranks' compute time per step
        (`compute_times`, one per rank), naming a straggler in a line."""
        since, started = self.window
        elapsed = (time.perf_counter() - started) / max(1, step - since)
        sp = self.speed
        row = {
            "step": step,
            **values,
            "world_size": sp.world_size,
            "samples_per_s": sp.samples_per_step / elapsed,
            "step_time_s": elapsed,
            "peak_mem_gb": peak_memory_gb(sp.device),
        }
        slowest = max(range(len(compute_times)), key=compute_times.__getitem__)
        row.update(
            compute_s_min=min(compute_times),
            compute_s_median=statistics.median(compute_times),
            compute_s_max=compute_times[slowest],
            slowest_rank=slowest,
        )
        if self.is_main and self.stragglers is not None:
            from trainer.resilience.hangs import STRAGGLER_WINDOWS

            for rank in self.stragglers.update(compute_times):
                self.message(
                    f"straggler at step {step}: rank {rank} on node {self.node_of(rank)} needed "
                    f"{compute_times[rank]:.3g} s of compute per step, more than {self.args.straggler_factor:g} x the "
                    f"median {row['compute_s_median']:.3g} s (log.straggler_factor) for {STRAGGLER_WINDOWS} logged "
                    f"windows in a row"
                )
        if sp.tokens_per_sample:
            row["tokens_per_s"] = sp.samples_per_step * sp.tokens_per_sample / elapsed
            if sp.flops_per_token and sp.peak_flops:
                row["mfu"] = sp.flops_per_token * row["tokens_per_s"] / (sp.peak_flops * sp.world_size)
        self.row(row)
        self.window = (step, time.perf_counter())

    def write(self, values: dict) -> None:
        """Append one row to metrics.jsonl, as given (rows of the run: `timed(...)`), and hand it to the
        trackers."""
        if self.is_main:
            with files.open_append(self.path) as f:
                f.write(_line(values))
            if self.trackers:
                self.trackers.log(values)

    def start(self, step: int, resumed: dict | None, times: dict | None = None) -> None:
        """Before this start's first step: the rows after `step` (an earlier start's, not saved) move
        to metrics.superseded.jsonl, and a resume row follows when `resumed` (the checkpoint's meta)
        says this start continues from a checkpoint, with `times` (start_times()) as its `start`.
        metrics.jsonl is replaced atomically."""
        if not self.is_main:
            return
        # Streamed: the kept rows go straight to a temporary beside the file (renamed into place at the
        # end), the superseded ones are appended in batches; memory stays a few megabytes at any size.
        fd, tmp = files.temporary(self.path)
        superseded_path = os.path.join(os.path.dirname(self.path), layout.SUPERSEDED_FILE)
        superseded, moved, foreign, batch = None, 0, 0, []
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as kept:
                os.fchmod(kept.fileno(), 0o644)
                try:
                    for line in files.read_lines(self.path, METRICS_LINE_BYTES):
                        row = project_row(line) if line is not None else None
                        if row is None:
                            foreign += 1 if line is None or line.strip() else 0
                        elif row["step"] > step:
                            batch.append(line + "\n")
                            moved += 1
                            if len(batch) >= 4096:
                                superseded = superseded or files.open_append(superseded_path)
                                superseded.writelines(batch)
                                batch = []
                        else:
                            kept.write(line + "\n")
                except FileNotFoundError:
                    pass
                if batch:
                    superseded = superseded or files.open_append(superseded_path)
                    superseded.writelines(batch)
                if resumed:
                    kept.write(
                        _line(
                            timed(
                                {
                                    "event": "resume",
                                    "step": step,
                                    "world_size": resumed["world_size"],
                                    "checkpoint": resumed["path"],
                                    **({"start": times} if times else {}),
                                }
                            )
                        )
                    )
                kept.flush()
                os.fsync(kept.fileno())
            if superseded is not None:
                superseded.close()
            if foreign:
                log.warning(
                    f"{self.path}: dropped {foreign} line(s) that are not rows of this run (not a JSON object "
                    f"with a numeric step and time: a line cut short by a kill, or written by someone else)"
                )
            if moved or resumed or foreign:
                os.replace(tmp, self.path)
                tmp = None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

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
        text = progress_line(values, self.total_steps, eta)
        if self.live:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
        else:
            log.info(text)

    def epochs(self, step: int, starts: list[tuple[str, int]]) -> None:
        """An epoch row and a line for each (source, epoch) that begins at `step` (trainer.data's
        epoch_starts; source "" for a single dataset). Not handed to the trackers: the training
        rows' `epoch` is their curve."""
        if not self.is_main:
            return
        for source, epoch in starts:
            row = {"event": "epoch", **({"data_source": source} if source else {}), "epoch": epoch, "step": step}
            with files.open_append(self.path) as f:
                f.write(_line(timed(row)))
            whose = f"source {source}" if source else "the training data"
            self.message(
                f"epoch {epoch} of {whose} begins at step {step}: its samples come again from here (the training "
                f"loss may fall faster; the eval loss tells whether it generalises)"
            )

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


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# What a row holds besides numbers: the key of a value (`loss`, `eval_loss/<source>`), the few keys whose
# values are text (a checkpoint's path, a node's name, a source's label), and the events.
_ROW_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}(/[A-Za-z0-9_.-]{1,64})?")
_TEXT_KEYS = ("checkpoint", "node", "data_source", "source")
_EVENTS = ("resume", "restart", "node_lost", "epoch", "early_stop")
_TEXT_CHARS = 4096  # the longest text value of a row (a checkpoint's path)


def _text(v) -> bool:
    return isinstance(v, str) and len(v) <= _TEXT_CHARS and not _CONTROL.search(v)


def _row_value(key: str, v) -> bool:
    """Whether `v` is what a row of the project's holds under `key`."""
    if v is None or _number(v):
        return True
    if key == "event":
        return v in _EVENTS
    if key in _TEXT_KEYS:
        return _text(v)
    if key == "nodes":  # node_lost: the nodes' names
        return isinstance(v, list) and len(v) <= 65536 and all(map(_text, v))
    if key == "start":  # resume: the moments of the start
        return isinstance(v, dict) and all(_ROW_KEY.fullmatch(k) and _number(t) for k, t in v.items())
    return False


def project_row(line: str) -> dict | None:
    """The row a metrics.jsonl line holds when it is one the project writes, else None: a JSON object
    with an integer `step`, a numeric `time` where it has one, keys of the rows' form (`loss`,
    `eval_loss/<source>`) and numbers (or null) as values, text only under the keys that hold it
    (an event's name, a checkpoint's path, a node, a source) and without control characters. A line
    carrying anything else (issue 41 item 11: a neighbour's strings beside an integer step) is
    someone else's and is copied nowhere."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or ("time" in row and not _number(row["time"])):
        return None
    if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
        return None
    if not all(_ROW_KEY.fullmatch(k) and _row_value(k, v) for k, v in row.items()):
        return None
    return row


def finite_or_null(values: dict) -> dict:
    """The row with NaN and infinities as null: strict JSON readers refuse bare NaN/Infinity."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}


# Below this model FLOPs utilisation the live line leaves MFU out: a tiny model's "mfu 0.0%" says
# nothing (the rows keep the figure). A fraction of the GPU's peak.
MFU_SHOWN_FROM = 0.001


def progress_line(values: dict, total_steps: int, eta: float) -> str:
    """The live line of a logged step: step, loss, the epoch (passes over data that ends, each
    source's for a mixture), throughput, MFU where it means something, eta."""
    text = f"step {values['step']}/{total_steps}  loss {values['loss']:.4f}"
    if "epoch" in values:
        text += f"  epoch {values['epoch']:.2f}"
    passes = [f"{k[len('epoch/') :]} {v:.2f}" for k, v in values.items() if k.startswith("epoch/")]
    if passes:
        text += "  epoch " + " ".join(passes)
    text += f"  {values['samples_per_s']:.1f} samples/s"
    if "tokens_per_s" in values:
        text += f"  {values['tokens_per_s']:.0f} tok/s"
    if values.get("mfu", 0.0) >= MFU_SHOWN_FROM:
        text += f"  mfu {values['mfu']:.1%}"
    return text + f"  eta {_duration(eta)}"


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# -- reading a run's metrics: python -m trainer.metrics RUN_DIR [RUN_DIR ...] [--plot FILE.png] ------


def read_rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl file (a missing file has none), streamed. A line that is not a row
    of the project's (a torn last line, a string `step` or `time`, a line longer than
    METRICS_LINE_BYTES) is left out, with one warning to stderr naming the file and how many.
    files.UnsafeFile for a link or FIFO at `path`."""
    rows, skipped = [], 0
    try:
        for line in files.read_lines(path, METRICS_LINE_BYTES):
            row = project_row(line) if line is not None else None
            if row is not None:
                rows.append(row)
            elif line is None or line.strip():
                skipped += 1
    except FileNotFoundError:
        return []
    if skipped:
        print(
            f"warning: {clean(path)}: skipped {skipped} line(s) that are not rows (a JSON object with a "
            f"numeric step and time)",
            file=sys.stderr,
        )
    return rows


# Control characters and terminal escape sequences (CSI, OSC and the rest): printed raw from a row
# they could retitle or clear the reader's terminal.
_CONTROL = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-_])?|[\x00-\x1f\x7f-\x9f]")


def clean(text) -> str:
    """`text` as str with every control character and escape sequence removed."""
    return _CONTROL.sub("", str(text))


def summary(run_dir: str) -> dict:
    """What a run did, from its metrics.jsonl (and metrics.superseded.jsonl, the rows a restart redid),
    and from its newest checkpoint: the best eval loss's checkpoint, and whether the run stopped early
    there (trainer/early_stop.py)."""
    rows = read_rows(os.path.join(run_dir, "metrics.jsonl"))
    superseded = read_rows(os.path.join(run_dir, "metrics.superseded.jsonl"))
    train = [r for r in rows if isinstance(r.get("loss"), (int, float))]
    evals = [r for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    restarts = [i for i, r in enumerate(rows) if r.get("event") in ("resume", "restart")]
    lost = 0.0
    # From the last row written before the restart to the first step after it; for a new start (a
    # resume row whose `start` has no `stopped`), from its launcher's start.
    for i in restarts:
        before = [
            r["time"]
            for r in rows[:i] + superseded
            if isinstance(r.get("time"), (int, float)) and r["time"] <= rows[i].get("time", float("inf"))
        ]
        after = next(
            (r["time"] for r in rows[i + 1 :] if "loss" in r and isinstance(r.get("time"), (int, float))), None
        )
        start = rows[i].get("start")
        launched = start.get("launcher") if isinstance(start, dict) and "stopped" not in start else None
        if isinstance(launched, (int, float)):  # a new start: its own start-up, not the time nothing ran
            before = [max([*before, launched])]
        if before and after is not None:
            lost += after - max(before)
    best = min(train, key=lambda r: r["loss"]) if train else None
    speed = "tokens_per_s" if any("tokens_per_s" in r for r in train) else "samples_per_s"
    speeds = sorted(r[speed] for r in train if isinstance(r.get(speed), (int, float)))
    return {
        "run_dir": run_dir,
        "steps": train[-1]["step"] if train else 0,
        "last_loss": train[-1]["loss"] if train else None,
        "best_loss": best["loss"] if best else None,
        "best_step": best["step"] if best else None,
        "last_eval": {k: v for k, v in evals[-1].items() if k.startswith("eval_") or k == "step"} if evals else None,
        f"median_{speed}": speeds[len(speeds) // 2] if speeds else None,
        "restarts": len(restarts),
        "restart_time_s": round(lost, 1),
        "best_checkpoint": _best_checkpoint(run_dir),
        "early_stop": _early_stop(run_dir),
    }


def _best_checkpoint(run_dir: str) -> dict | None:
    """{step, eval_loss, path} of the run's best checkpoint (the lowest eval loss's), or None."""
    found = early_stop.best_checkpoint(run_dir)
    return None if found is None else dict(zip(("step", "eval_loss", "path"), found))


def _early_stop(run_dir: str) -> dict | None:
    """{step, reason, best_eval_loss, best_step} where the newest checkpoint says the run stopped
    early there (what the launcher reads before a restart), else None."""
    record = layout.early_stop_record(run_dir, layout.latest_committed_step(run_dir))
    if record is None or early_stop.state_problem(record[1]):
        return None
    step, state = record
    reason = early_stop.reason_of(state)
    return {"step": step, "reason": reason, "best_eval_loss": state["best"], "best_step": state["best_step"]}


def _summary_line(s: dict) -> str:
    def num(v, fmt=".4f"):
        return "-" if v is None else format(v, fmt)

    speed = next(k for k in s if k.startswith("median_"))
    text = (
        f"{s['run_dir']}: {s['steps']} steps, loss {num(s['last_loss'])} (best {num(s['best_loss'])} at step "
        f"{s['best_step'] if s['best_step'] is not None else '-'})"
    )
    if s["last_eval"]:
        text += ", eval at step {step}: ".format(**s["last_eval"]) + ", ".join(
            f"{k} {v:.4f}" for k, v in s["last_eval"].items() if k != "step" and isinstance(v, (int, float))
        )
    if s["best_checkpoint"]:
        text += ", best checkpoint step {step} (eval_loss {eval_loss:.4f}): {path}".format(**s["best_checkpoint"])
    stop = s["early_stop"]
    if stop:
        why = (
            "eval loss not finite"
            if stop["reason"] == early_stop.NOT_FINITE
            else f"no improvement on eval_loss {num(stop['best_eval_loss'])} of step {stop['best_step']}"
        )
        text += f", stopped early at step {stop['step']} ({why})"
    text += f", median {num(s[speed], '.1f')} {speed[len('median_') :].replace('_per_s', '/s')}"
    text += f", {s['restarts']} restart(s) costing {s['restart_time_s']:.1f} s of wall time"
    return text


def plot(run_dirs: list[str], out: str) -> list[str]:
    """Loss (lines) and eval loss (dashed, dots) against step for each run, in one PNG; returns the
    labels drawn."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    labels = []
    for i, run_dir in enumerate(run_dirs):
        rows = read_rows(os.path.join(run_dir, "metrics.jsonl"))
        name = os.path.basename(os.path.normpath(run_dir))
        color = f"C{i % 10}"
        train = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float))]
        evals = [(r["step"], r["eval_loss"]) for r in rows if isinstance(r.get("eval_loss"), (int, float))]
        if train:
            ax.plot(*zip(*train), color=color, label=f"{name} loss")
            labels.append(f"{name} loss")
        if evals:
            ax.plot(*zip(*evals), color=color, linestyle="--", marker="o", label=f"{name} eval loss")
            labels.append(f"{name} eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if labels:
        ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    # Through files.py as every file the project writes: a link or FIFO planted at `out` (a run dir's
    # loss.png, `make plot`) is replaced, never written through (issue 41 item 2).
    files.write_bytes(out, png.getvalue())
    return labels


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("metrics", "Summarise runs from their metrics.jsonl, and plot them.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--plot", metavar="FILE.png", help="plot loss and eval loss against step into this PNG")
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead of a line")
    args = parser.parse_args(argv)
    try:  # an s3:// run dir: a local copy of its files (trainer/checkpoint/remote.py), named by its URL
        if any(map(objects.is_remote, args.run_dirs)):
            from trainer.checkpoint import remote  # torch: only for a run dir in a bucket

        local = {d: remote.local_copy(d, checkpoint=False) if objects.is_remote(d) else d for d in args.run_dirs}
    except objects.StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    missing = [d for d in args.run_dirs if not os.path.lexists(os.path.join(local[d], "metrics.jsonl"))]
    if missing:
        print(f"error: {missing[0]}: no metrics.jsonl (is it a run dir?)", file=sys.stderr)
        return 2
    if args.plot and not args.plot.endswith(".png"):
        print(f"error: --plot {args.plot}: name a .png file", file=sys.stderr)
        return 2
    try:
        for run_dir in args.run_dirs:
            s = {**summary(local[run_dir]), "run_dir": run_dir}
            print(json.dumps(s) if args.json else clean(_summary_line(s)))
        if args.plot:
            plot([local[d] for d in args.run_dirs], args.plot)
            print(f"plotted {len(args.run_dirs)} run(s) to {args.plot}")
    except files.UnsafeFile as e:
        print(f"error: {clean(e)}: move it away; a run dir's metrics are regular files", file=sys.stderr)
        return 2
    except OSError as e:  # the plot's own file: a folder there, a folder that cannot be written
        why = f"cannot write it ({e.strerror}); name a writable .png file"
        print(f"error: --plot {clean(args.plot)}: {why}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
