"""`make bench`: a side-by-side performance report of the trainer.

    .venv/bin/python bench/run.py [--budget 560] [--scratch runs/bench]

Every figure is a ratio of two things measured in the same run, interleaved where they are
repeated (A B A B, medians), because the machines are shared and noisy. Each measurement runs in
its own torchrun (gloo on CPU, NCCL on GPUs) under a share of the time budget; one that fails or
runs out of time is reported as null with the reason, and what its group had already finished is
kept. Each measurement gets the time left minus what the ones after it need at least, so a slow one
cannot crowd out the others. Prints a table and writes bench/results/<date>-<host>.md and .json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
CONFIG = "configs/default.yaml"

# key: (what it compares, "<=" or ">=", goal)
GOALS = {
    "dcp_save_vs_disk": ("DCP save throughput / raw sequential write, fsync'd", ">=", 0.8),
    "dcp_load_vs_disk": ("DCP load throughput / raw sequential read, cache dropped", ">=", 0.8),
    "checksum_load_overhead": ("DCP load time checking the shard files' checksums / the same load without", "<=", 1.1),
    "async_stall_vs_sync": ("loop blocked by an async save / a synchronous save", "<=", 0.05),
    "shard_bytes_vs_ideal_n2": ("per-rank params+grads+optimizer bytes, FSDP full shard / (total/2)", "<=", 1.05),
    "shard_bytes_vs_ideal_n4": ("per-rank params+grads+optimizer bytes, FSDP full shard / (total/4)", "<=", 1.05),
    "trainer_vs_minimal_step_time": ("trainer step time / minimal hand-written FSDP2 loop", "<=", 1.03),
    "dcp_vs_rank0_save_time": ("DCP save time / full state dict gathered and torch.save'd on rank 0", "<=", 0.5),
    "dcp_vs_rank0_peak_mem": ("rank 0 memory added by the save: DCP / full state dict on rank 0", "<=", 0.5),
    "resume_start_overhead": ("start->first step resuming / (start->first step fresh + load time)", "<=", 1.1),
    "gpu_mfu": ("model FLOPs utilisation of a 1B bf16 torch.compile'd run on each GPU of this machine", ">=", 0.5),
    "gpu_tokens_per_s": ("tokens per second of that run, all GPUs", None, None),
    "gpu_peak_mem_gb": ("peak GPU memory allocated by that run, per GPU", None, None),
    "gpu_mfu_eager": ("model FLOPs utilisation of the same run without torch.compile", None, None),
}


class Failed(Exception):
    """A measurement that did not produce its numbers; the message says why."""


# ---------------------------------------------------------------------------------------------------
# Launching


def threads_per_process(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


class RowClock(threading.Thread):
    """Notes when each line of a JSONL file appears, polling its size (the same clock for the trainer
    and the minimal loop, so both are timed from the outside the same way)."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.sizes, self.done = path, [], threading.Event()

    def run(self) -> None:
        last = -1
        while not self.done.is_set():
            size = self.path.stat().st_size if self.path.exists() else 0
            if size != last:
                self.sizes.append((time.perf_counter(), size))
                last = size
            time.sleep(0.002)

    def rows(self) -> list[tuple[float, dict]]:
        """(time it appeared, row) for every complete line."""
        self.done.set()
        self.join()
        out, end = [], 0
        for line in self.path.read_bytes().splitlines(keepends=True) if self.path.exists() else []:
            end += len(line)
            seen = next(t for t, size in self.sizes if size >= end) if self.sizes[-1][1] >= end else None
            out.append((seen, json.loads(line)))
        return out


def launch(nproc: int, args: list[str], log: Path, timeout: float, watch: Path | None = None):
    """Run `torchrun ... args` from the repository root; returns (seconds since launch at which each
    row of `watch` appeared with the row, the log text). Raises Failed on an error or a timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_process(nproc)), "PYTHONUNBUFFERED": "1"}
    if nproc > gpu_count():
        env["CUDA_VISIBLE_DEVICES"] = ""  # more processes than GPUs: measure on the CPU (gloo) instead
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *args]
    clock = RowClock(watch) if watch else None
    with open(log, "w") as out:
        started = time.perf_counter()
        if clock:
            clock.start()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the group we started
            proc.wait()
            raise Failed(f"timed out after {timeout:.0f}s (log: {log.relative_to(ROOT)})") from None
    text = log.read_text(errors="replace")
    if rc != 0:
        errors = [line for line in text.splitlines() if "Error" in line or "error:" in line]
        raise Failed(f"exit status {rc}: {(errors or ['?'])[-1].strip()[:200]} (log: {log.relative_to(ROOT)})")
    rows = [(t - started if t else None, row) for t, row in clock.rows()] if clock else []
    return rows, text


@functools.cache
def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds
        self.reserve = 0.0  # seconds kept for the measurements after the running one

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def need(self, seconds: float, what: str) -> float:
        """The time this measurement may still use, or Failed if less than `seconds`."""
        mine = self.left() - self.reserve
        if mine < seconds:
            raise Failed(f"skipped: {self.left():.0f}s of the time budget left ({self.reserve:.0f}s of it kept for "
                         f"the measurements after), {what} needs about {seconds:.0f}s")
        return mine


def trainer_args(run_dir: Path, overrides: list[str]) -> list[str]:
    return ["-m", "trainer", "--config", CONFIG, f"run_dir={run_dir}", *overrides]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------------
# Measurements. Each returns ({key: value}, {key: note}, details) or raises Failed; a key it leaves
# out of the values is reported as null with its note saying why.


def shard_bytes(ctx) -> tuple[dict, dict, dict]:
    """On 4 processes; the checkpoint worker measures the same on its N processes."""
    out = ctx.scratch / "shard_bytes_n4.json"
    launch(4, ["-m", "bench.shard_bytes", "--out", str(out), "--size", ctx.args.shard_size],
           ctx.scratch / "shard_bytes_n4.log", ctx.budget.need(40, "shard bytes on 4 processes"))
    return shard_values(json.loads(out.read_text()))


def shard_values(r: dict) -> tuple[dict, dict, dict]:
    key = f"shard_bytes_vs_ideal_n{r['world_size']}"
    note = (f"{r['size']} transformer + AdamW, {r['fsdp']['total_bytes'] / 1e6:.1f} MB unsharded, after one step, "
            f"largest rank, storages incl. padding (to_local numel: {r['fsdp']['vs_ideal']:.4f}); DDP: {r['ddp']['storage_vs_ideal']:.2f}")
    return {key: r["fsdp"]["storage_vs_ideal"]}, {key: note}, {key: r}


def trainer_runs(ctx) -> tuple[dict, dict, dict]:
    """The real trainer against bench/minimal_loop.py (same model, batch and processes), and the
    trainer resuming from the checkpoint its run just wrote, interleaved: T M R T M R. A launch that
    fails or finds no time left ends the series; the runs before it still count.

    Step time: seconds between consecutive metrics rows, seen from outside (the same clock for
    both). Resume: launch -> first metrics row, against the fresh trainer run's, plus the load time
    the resumed run logs."""
    a = ctx.args
    n, steps, skip = a.nproc, a.steps, 3
    overrides = [f"model.size={a.step_size}", f"model.seq_len={a.seq_len}", f"train.global_batch_size={a.batch}",
                 "log.interval=1", "checkpoint.interval=0", "log.progress=false"]
    minimal = ["-m", "bench.minimal_loop", "--size", a.step_size, "--seq-len", str(a.seq_len),
               "--batch", str(a.batch), "--steps", str(steps)]
    intervals = {"trainer": [], "minimal": []}
    reported = {"trainer": [], "minimal": []}  # the runs' own step_time_s
    runs = {"trainer": 0, "minimal": 0}
    per_run = {"trainer": [], "minimal": []}  # each run's median step: how far runs of one program spread
    fresh, resumed, loads = [], [], []
    stopped = None  # why the series ended early
    for pair in range(a.pairs):
        for who in ("trainer", "minimal", "resume"):
            if who == "resume" and len(fresh) <= len(resumed):
                continue  # its trainer run did not finish: nothing to resume
            run_dir = ctx.scratch / f"trainer_{pair}" if who != "minimal" else ctx.scratch / f"minimal_{pair}"
            if who != "resume":
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir(parents=True)
            metrics = run_dir / "metrics.jsonl"
            metrics.unlink(missing_ok=True)
            args = {"trainer": trainer_args(run_dir, [*overrides, f"train.steps={steps}"]),
                    "minimal": [*minimal, "--out", str(metrics)],
                    "resume": trainer_args(run_dir, [*overrides, f"train.steps={steps + 1}"])}[who]
            try:
                rows, text = launch(n, args, ctx.scratch / f"{who}_{pair}.log", ctx.budget.need(40, f"a {who} run"), watch=metrics)
                rows = [(t, r) for t, r in rows if t is not None and "step_time_s" in r]
                found = re.search(r"loaded in ([0-9.]+)s", text)
                if who == "resume" and not found:
                    raise Failed("the resumed run did not log 'loaded in ...s'; did it resume?")
                if not rows:
                    raise Failed(f"the {who} run wrote no metrics rows ({metrics})")
            except Failed as e:
                stopped = f"{who} run {pair + 1}: {e}"
                break
            if who == "resume":
                resumed.append(rows[0][0])
                loads.append(float(found.group(1)))
                shutil.rmtree(run_dir, ignore_errors=True)
                continue
            if who == "trainer":
                fresh.append(rows[0][0])
            rows = rows[skip:]  # warm-up steps left out
            intervals[who] += [b[0] - a_[0] for a_, b in zip(rows, rows[1:])]
            reported[who] += [r["step_time_s"] for _, r in rows]
            per_run[who].append(median([r["step_time_s"] for _, r in rows]))
            runs[who] += 1
            if who == "minimal":
                shutil.rmtree(run_dir, ignore_errors=True)
        if stopped:
            print(f"bench: trainer_runs: stopped early, keeping what finished: {stopped}", flush=True)
            break
    med = {who: median(v) for who, v in intervals.items()}
    own = {who: median(v) for who, v in reported.items()}
    what = f"{a.step_size} transformer, seq {a.seq_len}, global batch {a.batch}, {n} processes"
    values, notes = {}, {}
    if med["trainer"] and med["minimal"]:
        values["trainer_vs_minimal_step_time"] = med["trainer"] / med["minimal"]
        notes["trainer_vs_minimal_step_time"] = (
            f"{what}, {runs['trainer']} + {runs['minimal']} runs of {steps} steps each ({skip} warm-up left out); median step "
            f"{med['trainer']:.3f}s vs {med['minimal']:.3f}s between metrics rows; the runs' own step_time_s give "
            f"{own['trainer'] / own['minimal']:.3f}; each run's median step (ms): trainer "
            f"{', '.join(f'{t * 1e3:.0f}' for t in per_run['trainer'])}, minimal "
            f"{', '.join(f'{t * 1e3:.0f}' for t in per_run['minimal'])}")
    else:
        notes["trainer_vs_minimal_step_time"] = f"not measured: {stopped}"
    if fresh and resumed:
        values["resume_start_overhead"] = median(resumed) / (median(fresh) + median(loads))
        notes["resume_start_overhead"] = (
            f"{what}, {len(fresh)} fresh and {len(resumed)} resumed runs; launch->first step {median(resumed):.2f}s resuming vs "
            f"{median(fresh):.2f}s fresh + {median(loads):.2f}s load")
    else:
        notes["resume_start_overhead"] = f"not measured: {stopped}"
    if stopped and values:
        for key in values:
            notes[key] += f"; the series stopped early ({stopped})"
    details = {"step_time": {"intervals": intervals, "reported": reported},
               "resume": {"fresh_s": fresh, "resumed_s": resumed, "load_s": loads}, "stopped": stopped}
    return values, notes, details


def checkpoint_io(ctx) -> tuple[dict, dict, dict]:
    """bench/checkpoint_io.py on N processes. It rewrites its result file after every phase, so
    if it fails or runs out of time, the figures of the phases it finished are still reported."""
    a = ctx.args
    folder = ctx.scratch / "checkpoint_io"
    shutil.rmtree(folder, ignore_errors=True)
    out = ctx.scratch / "checkpoint_io.json"
    out.unlink(missing_ok=True)
    stopped = None
    try:
        launch(a.nproc, ["-m", "bench.checkpoint_io", "--dir", str(folder), "--out", str(out), "--size", a.ckpt_size,
                         "--rounds", str(a.ckpt_rounds), "--async-rounds", str(a.ckpt_rounds), "--shard-size", a.shard_size],
               ctx.scratch / "checkpoint_io.log", ctx.budget.need(150, "the checkpoint measurements"))
    except Failed as e:
        if not out.exists():
            raise
        stopped = str(e)
        print(f"bench: checkpoint_io: stopped early, keeping what finished: {e}", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    r = json.loads(out.read_text())
    rounds, arounds = r["rounds"], r["async_rounds"]

    def med(key, rs=rounds):
        return median(x[key] for x in rs if key in x)

    gb = (med("checkpoint_bytes") or 0) / 1e9
    what = f"{a.ckpt_size} transformer + AdamW, {gb:.2f} GB checkpoint, {r['world_size']} processes"
    what_io = f"{what}, {sum('raw_read_s' in x for x in rounds)} round(s)"
    added = lambda kind: median(x[f"{kind}_peak_rss"] - x[f"{kind}_rss_before"] for x in rounds if f"{kind}_peak_rss" in x)  # noqa: E731
    values = {
        # throughput ratio = (bytes / DCP time) / (bytes / raw time)
        "dcp_save_vs_disk": ratio(med("raw_write_s"), med("dcp_save_s")),
        "dcp_load_vs_disk": ratio(med("raw_read_s"), med("dcp_load_s")),
        "checksum_load_overhead": ratio(med("dcp_load_s"), med("unverified_load_s")),
        "dcp_vs_rank0_save_time": ratio(med("dcp_save_s"), med("rank0_save_s")),
        "dcp_vs_rank0_peak_mem": ratio(added("dcp_save"), added("rank0_save")),
        "async_stall_vs_sync": ratio(med("async_stall_s", arounds), med("sync_save_s", arounds)),
    }
    values = {k: v for k, v in values.items() if v is not None}
    notes = {k: f"not measured: {stopped}" for k in GOALS if k not in values}
    if "dcp_save_vs_disk" in values:
        notes["dcp_save_vs_disk"] = f"{what_io}; DCP {gb / med('dcp_save_s'):.2f} GB/s vs one fsync'd sequential writer {gb / med('raw_write_s'):.2f} GB/s"
    if "dcp_load_vs_disk" in values:
        notes["dcp_load_vs_disk"] = (f"{what_io}; DCP {gb / med('dcp_load_s'):.2f} GB/s vs one sequential reader {gb / med('raw_read_s'):.2f} GB/s; "
                                     "the files' pages evicted (fsync + posix_fadvise DONTNEED) before each"
                                     + (f"; the load with the files cached: {med('dcp_load_cached_s'):.2f}s (its own work: "
                                        "planning, state dicts, the reads from the page cache)" if med("dcp_load_cached_s") else "")
                                     + (f"; the same load with DCP's stock FileSystemReader in place of the trainer's "
                                        f"ShardReader: {med('stock_load_s'):.2f}s, {ratio(med('raw_read_s'), med('stock_load_s')):.2f} "
                                        "of the disk" if med("stock_load_s") else ""))
    if "checksum_load_overhead" in values:
        notes["checksum_load_overhead"] = (f"{what_io}; {med('dcp_load_s'):.2f}s checked vs {med('unverified_load_s'):.2f}s "
                                           "unchecked, the files' pages evicted before each")
    if "dcp_vs_rank0_save_time" in values:
        notes["dcp_vs_rank0_save_time"] = f"{what_io}; {med('dcp_save_s'):.2f}s vs {med('rank0_save_s'):.2f}s, both fsync'd"
    if "dcp_vs_rank0_peak_mem" in values:
        notes["dcp_vs_rank0_peak_mem"] = (f"{what_io}; rank 0 peak RSS minus RSS before: {added('dcp_save') / 1e9:.2f} GB vs "
                                          f"{added('rank0_save') / 1e9:.2f} GB (absolute peaks "
                                          f"{med('dcp_save_peak_rss') / 1e9:.2f} vs {med('rank0_save_peak_rss') / 1e9:.2f} GB)")
    if "async_stall_vs_sync" in values:
        done = [x for x in arounds if "async_stall_s" in x]
        part = lambda k: median(x["async_blocked_s"][k] for x in done)  # noqa: E731
        during = median(t for x in done for t in x["steps_during_save_s"])
        before = median(t for x in done for t in x["steps_before_save_s"])
        notes["async_stall_vs_sync"] = (
            f"{what}, {len(done)} round(s), the trainer's Checkpointer as trainer.train uses it (one DefaultStager, "
            f"staging in the background; the first save of its stager in round 1); blocked {med('async_stall_s', arounds):.2f}s = "
            f"save() {part('save'):.2f}s + wait_staged() before the optimizer step {part('wait_staged'):.2f}s + "
            f"poll() committing {part('poll'):.2f}s, vs {med('sync_save_s', arounds):.2f}s synchronous; the save was in "
            f"flight {med('async_in_flight_s', arounds):.1f}s over {median(len(x['steps_during_save_s']) for x in done):.0f} "
            f"training steps of {during:.2f}s (median) against {before:.2f}s without a save in flight")
    for key in values:
        if stopped:
            notes[key] += f"; the run stopped early ({stopped})"
    details = {"checkpoint_io": r}
    if "shard_bytes" in r:
        v, n, d = shard_values(r["shard_bytes"])
        values, notes, details = {**values, **v}, {**notes, **n}, {**details, **d}
    return values, {k: n for k, n in notes.items() if k in MEASURED_BY[checkpoint_io]}, details


def gpu(ctx) -> tuple[dict, dict, dict]:
    """MFU, tokens/s and peak memory of short bf16 runs of the 1b transformer on all local GPUs, with
    and without torch.compile; one micro-batch per step, as large as the GPU's memory comfortably takes."""
    import torch

    keys = MEASURED_BY[gpu]
    if not torch.cuda.is_available():
        return {k: None for k in keys}, {k: "no GPU here (torch.cuda.is_available() is False)" for k in keys}, {}
    n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    micro = 16 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 8  # 16 peaks at ~72 GB
    run_dir = ctx.scratch / "gpu"
    results = {}
    for compiled in (True, False):
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = ["model.size=1b", "model.seq_len=2048", f"train.global_batch_size={micro * n}",
                     f"train.micro_batch_size={micro}", f"train.steps={ctx.args.gpu_steps}", "log.interval=5",
                     "log.progress=false", "checkpoint.interval=0", "parallel.param_dtype=bfloat16",
                     f"parallel.compile={str(compiled).lower()}", "data.num_workers=2", "optim.lr=3e-4"]
        label = "compiled" if compiled else "eager"
        launch(n, trainer_args(run_dir, overrides), ctx.scratch / f"gpu-{label}.log", ctx.budget.need(150, f"the {label} GPU run"))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results[label] = [r for r in rows if "tokens_per_s" in r][1:]  # the first window holds compilation/warm-up
        shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint too: ~13 GB
    med = lambda label, key: statistics.median(r[key] for r in results[label]) if results[label] and key in results[label][0] else None  # noqa: E731
    values = {"gpu_mfu": med("compiled", "mfu"), "gpu_tokens_per_s": med("compiled", "tokens_per_s"),
              "gpu_peak_mem_gb": max(r["peak_mem_gb"] for r in results["compiled"]), "gpu_mfu_eager": med("eager", "mfu")}
    what = (f"1b transformer ({n} x {name}), bf16 params, float32 reduction, seq 2048, {micro} sequences per GPU per "
            f"step, no activation checkpointing; median of {len(results['compiled'])} windows of 5 steps after the first")
    no_peak = "the GPU's peak FLOP/s is unknown to trainer.metrics"
    return values, {"gpu_mfu": what if values["gpu_mfu"] is not None else no_peak, "gpu_tokens_per_s": what,
                    "gpu_peak_mem_gb": what, "gpu_mfu_eager": what if values["gpu_mfu_eager"] is not None else no_peak}, {}


# In this order: the keys each measures and about the least time it needs to measure them (its
# first launch, or one round). That of the later ones is kept from each measurement's time.
MEASUREMENTS = [
    (checkpoint_io, ["dcp_save_vs_disk", "dcp_load_vs_disk", "checksum_load_overhead", "async_stall_vs_sync", "dcp_vs_rank0_save_time",
                     "dcp_vs_rank0_peak_mem", "shard_bytes_vs_ideal_n2"], 150),
    (shard_bytes, ["shard_bytes_vs_ideal_n4"], 45),
    (trainer_runs, ["trainer_vs_minimal_step_time", "resume_start_overhead"], 3 * 45),  # trainer, minimal, resume
    (gpu, ["gpu_mfu", "gpu_tokens_per_s", "gpu_peak_mem_gb", "gpu_mfu_eager"], 2 * 150),  # 0 without a GPU
]
MEASURED_BY = {measure: keys for measure, keys, _ in MEASUREMENTS}


def least_time(chosen: list, index: int) -> float:
    """Seconds the measurements after chosen[index] need at least."""
    return sum(need for measure, _, need in chosen[index + 1:] if measure is not gpu or gpu_count())


# ---------------------------------------------------------------------------------------------------
# Report


def machine() -> dict:
    import torch

    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": time.strftime("%Y-%m-%d"),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "drop_caches_writable": os.access("/proc/sys/vm/drop_caches", os.W_OK),
        "load_average_at_start": os.getloadavg()[0],
    }


def met(key: str, value) -> bool | None:
    _, op, goal = GOALS[key]
    if value is None or goal is None:
        return None
    return value <= goal if op == "<=" else value >= goal


def markdown(info: dict, values: dict, notes: dict, sizes: str) -> str:
    lines = [
        f"# Bench {info['date']} on {info['host']}",
        "",
        f"torch {info['torch']}, {info['cpu']} ({info['cpu_cores']} cores), "
        f"{', '.join(info['gpus']) or 'no GPU'}; load average {info['load_average_at_start']:.1f} at the start. {sizes}",
        "",
        "| key | value | goal | met? |",
        "|---|---|---|---|",
    ]
    for key, (_, op, goal) in GOALS.items():
        value = values.get(key)
        shown = "null" if value is None else f"{value:.3g}" if abs(value) < 1e4 else f"{value:.4g}"
        ok = met(key, value)
        lines.append(f"| `{key}` | {shown} | {f'{op} {goal}' if goal is not None else '-'} | "
                     f"{'-' if ok is None else 'yes' if ok else '**no**'} |")
    lines += ["", "What each figure compares, and how it was measured:", ""]
    for key, (what, _, _) in GOALS.items():
        lines.append(f"- `{key}`: {what}. {notes.get(key, '')}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=560, help="seconds for all measurements")
    parser.add_argument("--scratch", default="runs/bench", help="scratch folder, on the filesystem checkpoints go to")
    parser.add_argument("--results", default="bench/results")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the step-time, checkpoint and resume runs")
    parser.add_argument("--pairs", type=int, default=3, help="rounds of trainer, minimal loop, resumed trainer launches")
    parser.add_argument("--steps", type=int, default=10, help="steps of each step-time run")
    parser.add_argument("--step-size", default="small", help="transformer size of the step-time runs")
    parser.add_argument("--seq-len", type=int, default=64, help="sequence length of the step-time runs")
    parser.add_argument("--batch", type=int, default=8, help="global batch of the step-time runs")
    parser.add_argument("--shard-size", default="small", help="transformer size of the shard-bytes measurements")
    parser.add_argument("--ckpt-size", default="125m", help="transformer size of the checkpoint runs")
    parser.add_argument("--ckpt-rounds", type=int, default=3, help="interleaved rounds of each checkpoint comparison")
    parser.add_argument("--gpu-steps", type=int, default=30, help="steps of each GPU run")
    parser.add_argument("--only", nargs="+", choices=[m.__name__ for m, _, _ in MEASUREMENTS],
                        help="run only these measurements (the others are reported as not measured)")
    args = parser.parse_args()
    started = time.perf_counter()

    class ctx:  # what every measurement gets
        pass

    ctx.args, ctx.budget, ctx.scratch = args, Budget(args.budget), (ROOT / args.scratch).resolve()
    ctx.scratch.mkdir(parents=True, exist_ok=True)
    info = machine()
    values, notes, details = {}, {}, {}
    chosen = [m for m in MEASUREMENTS if not args.only or m[0].__name__ in args.only]
    ran = {measure for measure, _, _ in chosen}
    for index, (measure, keys, _) in enumerate(chosen):
        ctx.budget.reserve = least_time(chosen, index)
        print(f"bench: {measure.__name__} ({ctx.budget.left():.0f}s of the budget left, "
              f"{ctx.budget.reserve:.0f}s of it kept for the rest)", flush=True)
        began = time.perf_counter()
        try:
            v, n, d = measure(ctx)
            values.update({k: v.get(k) for k in keys}), notes.update(n), details.update(d)
        except Failed as e:
            print(f"bench: {measure.__name__}: {e}", flush=True)
            values.update({k: None for k in keys}), notes.update({k: str(e) for k in keys})
        details.setdefault("seconds", {})[measure.__name__] = time.perf_counter() - began
    for measure, keys, _ in MEASUREMENTS:
        if measure not in ran:
            notes.update({k: f"not measured in this run (--only {' '.join(args.only)})" for k in keys})

    sizes = (f"{args.nproc} processes (shard bytes: 2 and 4); models: step time and resume {args.step_size}, shard bytes "
             f"{args.shard_size}, checkpoints {args.ckpt_size}; ") if ran - {gpu} else ""
    sizes += f"{time.perf_counter() - started:.0f}s in all."
    text = markdown(info, values, notes, sizes)
    results = ROOT / args.results
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"{info['date']}-{info['host']}"
    if gpu in ran and info["gpus"]:  # GPU figures: named after the GPU, beside the CPU's
        stem = Path(f"{stem}-{info['gpus'][0].split()[-1].lower()}")
    Path(f"{stem}.md").write_text(text)
    report = {**values, "machine": info, "sizes": sizes, "goals": {k: {"op": op, "value": g} for k, (_, op, g) in GOALS.items()},
              "met": {k: met(k, values.get(k)) for k in GOALS}, "notes": notes, "details": details,
              "seconds": time.perf_counter() - started}
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(text)
    print(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
