"""`make bench`: a side-by-side performance report of the trainer.

    .venv/bin/python bench/run.py [--budget 1000] [--scratch runs/bench] [--only checkpoint_io ...]

Every figure is measured in rounds, each round timing the two things it compares side by side
(A B A B ...), because the machines are shared and noisy. A figure keeps every round, their median
and a 95% interval (bench/stats.py: percentile bootstrap of the median, fixed seed); its goal is
"met" only when the whole interval clears it, "missed" when the whole interval fails it, and
"within noise" otherwise. Each measurement runs in its own torchrun (gloo on CPU, NCCL on GPUs)
under a share of the time budget; one that fails or runs out of time is reported as null with the
reason, and the rounds it had finished are kept. Prints a table and writes
bench/results/<date>-<host>.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
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
sys.path.insert(0, str(ROOT))

from bench import stats

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
CONFIG = "configs/default.yaml"

# key: (what it compares, "<=" or ">=", goal)
GOALS = {
    "dcp_save_vs_disk": (
        "DCP save throughput / the disk's at the same concurrency: one raw writer per rank, one file "
        "each holding that rank's shard bytes, all at once, fsync'd",
        ">=",
        0.9,
    ),
    "dcp_load_vs_disk": (
        "DCP load throughput / the disk's at the same concurrency: one raw reader per rank, caches dropped before each",
        ">=",
        0.9,
    ),
    "checksum_load_overhead": ("DCP load time checking the shard files' checksums / the same load without", "<=", 1.1),
    "checksum_load_overhead_cached": (
        "the same two loads timed again right after, their files cached: the hashing's "
        "cost where no disk wait hides it",
        None,
        None,
    ),
    "dcp_vs_rank0_save_time": ("DCP save time / full state dict gathered and torch.save'd on rank 0", "<=", 0.5),
    "dcp_vs_rank0_peak_mem": (
        "rank 0 memory added by the save (VmHWM, fresh process per save): DCP / full state dict on rank 0",
        "<=",
        0.5,
    ),
    "async_cost_vs_sync": (
        "seconds an async save costs the training loop (blocked + slowdown of the steps that overlap "
        "it) / a synchronous save of the same state",
        "<=",
        0.1,
    ),
    "async_blocked_vs_sync": (
        "seconds an async save blocks the training loop (save(), wait_staged() and poll() timed around "
        "the steps that call them) / a synchronous save of the same state",
        "<=",
        0.05,
    ),
    "async_slowdown_vs_sync": (
        "seconds the steps that overlap an async save run slower than before it (less their blocked "
        "time) / a synchronous save of the same state",
        "<=",
        0.05,
    ),
    "every_vs_last_peak_rss": (
        "each rank's peak RSS, 125m-class model, 4 micro-batches a step: parallel.grad_sync=every_micro_batch / "
        "last_micro_batch (#44), no activation checkpointing",
        None,
        None,
    ),
    "full_ac_vs_none_peak_rss": (
        "the same: activation_checkpointing=full / none (both every_micro_batch)",
        None,
        None,
    ),
    "selective_ac_vs_none_peak_rss": (
        "the same: activation_checkpointing=selective (by operator) / none (both every_micro_batch)",
        None,
        None,
    ),
    "shard_bytes_vs_ideal_n2": ("per-rank params+grads+optimizer bytes, FSDP full shard / (total/2)", "<=", 1.05),
    "shard_bytes_vs_ideal_n4": ("per-rank params+grads+optimizer bytes, FSDP full shard / (total/4)", "<=", 1.05),
    "trainer_vs_minimal_step_time": ("trainer step time / minimal hand-written FSDP2 loop", "<=", 1.02),
    "resume_startup_s": (
        "resuming: seconds from launch to the trainer's first line of Python (torchrun, interpreter)",
        None,
        None,
    ),
    "resume_imports_s": ("resuming: seconds importing the trainer and torch", None, None),
    "resume_rendezvous_s": ("resuming: seconds in trainer.dist.init (rendezvous, process group)", None, None),
    "resume_build_s": (
        "resuming: seconds from the rendezvous to the checkpoint load (data, lease, model, optimizer)",
        None,
        None,
    ),
    "resume_load_s": ("resuming: seconds of the checkpoint load (Checkpointer.load)", None, None),
    "resume_first_step_s": ("resuming: seconds from the load to the first metrics row (the first step)", None, None),
    "preempt_to_committed_s": (
        "preempted on the local Slurm cluster: seconds from the preempting job's submission to "
        "the committed checkpoint (Slurm's signal, the step in flight, the save)",
        None,
        None,
    ),
    "preempt_to_requeued_s": (
        "preempted: seconds from the committed checkpoint to the job back in the queue (the "
        "launcher's exit, the requeue check, Slurm's requeue)",
        None,
        None,
    ),
    "preempt_restart_s": (
        "preempted: seconds from the requeued job running again to its first step (batch script, "
        "srun, launcher, rendezvous, load, first step)",
        None,
        None,
    ),
    "preempt_restart_vs_load": (
        "preempted: that restart / the checkpoint load alone (its log's 'loaded in')",
        None,
        None,
    ),
    "goodput": (
        "a multi-node job on the local Slurm cluster under a failure schedule (a rank killed, a rank stopped, a "
        "preemption, a node death): the same job's wall time undisturbed / disturbed (Slurm's requeue hold left out)",
        None,
        None,
    ),
    "goodput_steps_redone": ("steps trained twice in the disturbed job (a count)", None, None),
    "recovery_crash_s": ("a killed rank: seconds from the kill to the first step again", None, None),
    "recovery_hang_s": (
        "a stopped rank: seconds from the SIGSTOP to the first step again (parallel.timeout_s of it unseen)",
        None,
        None,
    ),
    "recovery_preemption_s": (
        "a preemption: seconds from the preempting job's submission to the first step again (hold left out)",
        None,
        None,
    ),
    "recovery_node_death_s": (
        "a node death (its slurmd and the job's processes killed): seconds from the kill to the first step again on "
        "the nodes left (hold left out; Slurm's NODE_FAIL after SlurmdTimeout, 10 s here, 300 s by default)",
        None,
        None,
    ),
    "restart_vs_goal": (
        "a restart in the allocation (crash, hang): seconds from the launcher seeing the failure to the first step, "
        "over the issue's goal: 3 x the checkpoint load + the rendezvous (agents' and process group's)",
        "<=",
        1.0,
    ),
    "goodput_llama3_1024": (
        "expected goodput of a 1024-GPU job at Llama 3's interruption rate with this recovery time and the Young-Daly "
        "checkpoint interval: (1 - C/tau)(1 - (tau/2 + R)/M)",
        None,
        None,
    ),
    "gpu_mfu": ("model FLOPs utilisation of a 1B bf16 torch.compile'd run on each GPU of this machine", ">=", 0.55),
    "gpu_tokens_per_s": ("tokens per second of that run, all GPUs", None, None),
    "gpu_peak_mem_gb": ("peak GPU memory allocated by that run, per GPU", None, None),
    "gpu_mfu_eager": ("model FLOPs utilisation of the same run without torch.compile", None, None),
}
RESUME_PARTS = ["startup", "imports", "rendezvous", "build", "load", "first_step"]


def figure(key: str, rounds: list[float], exact: bool = False) -> dict:
    """`key`'s rounds as a figure with its goal and verdict (bench/stats.py)."""
    _, op, goal = GOALS[key]
    return stats.figure(rounds, op, goal, exact)


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
            raise Failed(f"timed out after {timeout:.0f}s (log: {log})") from None
    text = log.read_text(errors="replace")
    if rc != 0:
        errors = [line for line in text.splitlines() if "Error" in line or "error:" in line]
        raise Failed(f"exit status {rc}: {(errors or ['?'])[-1].strip()[:200]} (log: {log})")
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
            raise Failed(
                f"skipped: {self.left():.0f}s of the time budget left ({self.reserve:.0f}s of it kept for "
                f"the measurements after), {what} needs about {seconds:.0f}s"
            )
        return mine


def trainer_args(run_dir: Path, overrides: list[str], times: Path | None = None) -> list[str]:
    """torchrun's arguments for the trainer; with `times`, under bench/timed_trainer.py, which notes
    when each start-up phase ended."""
    entry = ["-m", "bench.timed_trainer", "--times", str(times)] if times else ["-m", "trainer"]
    return [*entry, "--config", CONFIG, f"run_dir={run_dir}", *overrides]


def median(values) -> float | None:
    return stats.median(list(values))


def not_measured(keys, why: str) -> tuple[dict, dict]:
    return {k: None for k in keys}, {k: f"not measured: {why}" for k in keys}


# ---------------------------------------------------------------------------------------------------
# Measurements. Each returns ({key: figure}, {key: note}, details) or raises Failed; a key it leaves
# out of the figures is reported as null with its note saying why.


def checkpoint_io(ctx) -> tuple[dict, dict, dict]:
    """bench/checkpoint_io.py on N processes at the large size, with async rounds. It rewrites its
    result file after every round, so if it fails or runs out of time, the rounds it finished count."""
    a = ctx.args
    r, stopped = ckpt_worker(
        ctx,
        a.nproc,
        a.ckpt_size,
        a.ckpt_rounds,
        a.ckpt_rounds,
        "checkpoint_io",
        shard_size=a.shard_size,
        checksum_pairs=a.checksum_pairs,
    )
    rounds, arounds, pairs = r["rounds"], r["async_rounds"], r.get("checksum_pairs", [])
    per = lambda num, den, rs=rounds: [x[num] / x[den] for x in rs if num in x and den in x]
    gb = (median(x["shard_bytes"] for x in rounds) or 0) / 1e9
    rate = lambda key, rs=rounds: gb / median(x[key] for x in rs)
    what = (
        f"{a.ckpt_size} transformer + AdamW ({r.get('params', 0) / 1e6:.0f}M params, {gb:.2f} GB of shard files), "
        f"{r['world_size']} processes, {len(rounds)} rounds; caches dropped before each by {r.get('cache_drop', '?')}"
    )
    figures = {
        # throughput ratio = (bytes / DCP time) / (bytes / raw time), per round
        "dcp_save_vs_disk": figure("dcp_save_vs_disk", per("raw_write_s", "dcp_save_s")),
        "dcp_load_vs_disk": figure("dcp_load_vs_disk", per("raw_read_s", "dcp_load_s")),
        "checksum_load_overhead": figure(
            "checksum_load_overhead", per("dcp_load_s", "unverified_load_s", rounds + pairs)
        ),
        "checksum_load_overhead_cached": figure(
            "checksum_load_overhead_cached", per("dcp_load_cached_s", "unverified_load_cached_s", rounds + pairs)
        ),
        "dcp_vs_rank0_save_time": figure("dcp_vs_rank0_save_time", per("dcp_save_s", "rank0_save_s")),
        "async_cost_vs_sync": figure("async_cost_vs_sync", per("async_cost_s", "sync_save_s", arounds)),
        "async_blocked_vs_sync": figure("async_blocked_vs_sync", per("async_blocked_s", "sync_save_s", arounds)),
        "async_slowdown_vs_sync": figure("async_slowdown_vs_sync", per("async_slowdown_s", "sync_save_s", arounds)),
    }
    figures = {k: f for k, f in figures.items() if f["rounds"]}
    notes = {}
    if rounds:
        files = rounds[0]["shard_files"]
        notes["dcp_save_vs_disk"] = (
            f"{what}; DCP {rate('dcp_save_s'):.2f} GB/s vs {r['world_size']} raw writers ({files} shard files, "
            f"{files} raw files) {rate('raw_write_s'):.2f} GB/s (medians); one writer alone: "
            f"{rate('raw_write_single_s'):.2f} GB/s"
        )
        notes["dcp_load_vs_disk"] = (
            f"{what}; DCP {rate('dcp_load_s'):.2f} GB/s vs {r['world_size']} raw readers {rate('raw_read_s'):.2f} "
            "GB/s; "
            f"one reader alone: {rate('raw_read_single_s'):.2f} GB/s; the load with the files cached (DCP's own work): "
            f"{median(x['dcp_load_cached_s'] for x in rounds):.2f}s; with DCP's stock FileSystemReader in place of the "
            f"trainer's ShardReader: {rate('stock_load_s'):.2f} GB/s"
        )
        both = rounds + pairs
        notes["checksum_load_overhead"] = (
            f"{what}; {len(rounds)} + {len(pairs)} more pairs of loads on the last round's checkpoint; "
            f"{median(x['dcp_load_s'] for x in both):.2f}s checked vs "
            f"{median(x['unverified_load_s'] for x in both):.2f}s unchecked (medians), in alternating order"
        )
        if any("unverified_load_cached_s" in x for x in both):
            notes["checksum_load_overhead_cached"] = (
                f"Each load timed once more right after, its files still cached: "
                f"{median(x['dcp_load_cached_s'] for x in both):.2f}s checked vs "
                f"{median(x['unverified_load_cached_s'] for x in both if 'unverified_load_cached_s' in x):.2f}s "
                f"unchecked (medians). Both loads' read-ahead threads make one pass over the same bytes: the checked "
                "one hashes its rank's whole shard files (XXH3, a few KB of zip headers more) from a read-only "
                "mapping "
                f"of the page cache, the unchecked one copies the tensors' bytes into a scratch block to warm the "
                f"cache. This is the check's cost where no disk wait hides it, all threads of all ranks on the "
                f"machine's cores"
            )
        notes["dcp_vs_rank0_save_time"] = (
            f"{what}; {median(x['dcp_save_s'] for x in rounds):.2f}s vs "
            f"{median(x['rank0_save_s'] for x in rounds):.2f}s "
            f"(medians), both fsync'd"
        )
    if arounds:
        part = lambda k: median(x["async_blocked_parts_s"][k] for x in arounds)
        notes["async_cost_vs_sync"] = (
            f"{a.ckpt_size} state saved by the trainer's Checkpointer (async_save, one DefaultStager for all rounds) "
            "while a "
            f"{a.step_size_async} transformer trains on the same {r['world_size']} processes, {len(arounds)} rounds; "
            "cost "
            f"{median(x['async_cost_s'] for x in arounds):.2f}s = blocked "
            f"{median(x['async_blocked_s'] for x in arounds):.2f}s "
            f"(save() {part('save'):.2f}s + wait_staged() before each optimizer step {part('wait_staged'):.2f}s + "
            "poll() "
            f"{part('poll'):.2f}s) + slowdown {median(x['async_slowdown_s'] for x in arounds):.2f}s (the "
            f"{median(len(x['steps_during_save_s']) for x in arounds):.0f} steps overlapping the save, "
            f"{median(t for x in arounds for t in x['steps_during_save_s']):.3f}s each less blocked time, vs "
            f"{median(t for x in arounds for t in x['steps_before_save_s']):.3f}s before it), vs a "
            f"{median(x['sync_save_s'] for x in arounds):.2f}s synchronous save; in flight "
            f"{median(x['async_in_flight_s'] for x in arounds):.1f}s (medians)"
        )
        how = arounds[0].get("async_path", "thread")
        notes["async_blocked_vs_sync"] = (
            f"{a.ckpt_size} state, async save in DCP's {how}, {len(arounds)} rounds: blocked "
            f"{median(x['async_blocked_s'] for x in arounds):.3f}s per save (save() {part('save'):.3f}s, "
            f"wait_staged() {part('wait_staged'):.3f}s, poll() {part('poll'):.3f}s) vs a "
            f"{median(x['sync_save_s'] for x in arounds):.2f}s synchronous save (medians)"
        )
        notes["async_slowdown_vs_sync"] = (
            f"{a.ckpt_size} state, async save in DCP's {how}, {len(arounds)} rounds: the "
            f"{median(len(x['steps_during_save_s']) for x in arounds):.0f} steps overlapping it ran "
            f"{median(x['async_slowdown_s'] for x in arounds):.2f}s slower in all than the steps before it "
            f"({median(t for x in arounds for t in x['steps_during_save_s']):.3f}s vs "
            f"{median(t for x in arounds for t in x['steps_before_save_s']):.3f}s a step; the first round's save "
            f"also starts the save process); on a CPU the copy and the write share the cores with the training"
        )
    for key in figures:
        if stopped:
            notes[key] += f"; the run stopped early ({stopped})"
    details = {"checkpoint_io": r}
    if "shard_bytes" in r:
        f, n, d = shard_values(r["shard_bytes"])
        figures, notes, details = {**figures, **f}, {**notes, **n}, {**details, **d}
    return figures, notes, details


def ckpt_worker(
    ctx,
    nproc: int,
    size: str,
    rounds: int,
    async_rounds: int,
    name: str,
    shard_size: str | None = None,
    warmup: bool = False,
    checksum_pairs: int = 0,
):
    """One run of bench/checkpoint_io.py: (its result, why it stopped early or None)."""
    a = ctx.args
    folder, out = ctx.scratch / name, ctx.scratch / f"{name}.json"
    shutil.rmtree(folder, ignore_errors=True)
    out.unlink(missing_ok=True)
    args = [
        "-m",
        "bench.checkpoint_io",
        "--dir",
        str(folder),
        "--out",
        str(out),
        "--size",
        size,
        "--rounds",
        str(rounds),
        "--async-rounds",
        str(async_rounds),
        "--step-size",
        a.step_size_async,
        "--checksum-pairs",
        str(checksum_pairs),
    ]
    if shard_size:
        args += ["--shard-size", shard_size]
    if a.no_system_drop:
        args.append("--no-system-drop")
    if warmup:
        args.append("--warmup")
    stopped = None
    try:
        launch(nproc, args, ctx.scratch / f"{name}.log", ctx.budget.need(60, f"checkpoint I/O ({name})"))
    except Failed as e:
        if not out.exists() or not json.loads(out.read_text())["rounds"]:
            raise
        stopped = str(e)
        print(f"bench: {name}: stopped early, keeping what finished: {e}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return json.loads(out.read_text()), stopped


def checkpoint_scaling(ctx) -> tuple[dict, dict, dict]:
    """Save and load seconds and GB/s against the state's size (2 processes) and against the number
    of processes (1, 2, 4, at the middle size): DCP, the raw disk at the same concurrency and alone,
    the rank-0 full-state save, our loader (ShardReader) and DCP's stock reader. The large size's
    point at 2 processes is checkpoint_io's. A curve, no goal: medians of --scaling-rounds rounds,
    after one untimed save and load (a process's first DCP save pays one-time costs: 9.4 s against
    4-6 s for the 4.5 GB state on the 2-core VM; checkpoint_io's five rounds count it, in round 1)."""
    a = ctx.args
    points = [(a.nproc, size) for size in a.scaling_sizes] + [(n, a.scaling_sizes[1]) for n in (1, 4)]
    curve, stopped = [], None
    for nproc, size in points:
        if size == a.ckpt_size and nproc == a.nproc and "checkpoint_io" in ctx.details:
            r = ctx.details["checkpoint_io"]  # measured already, with more rounds
        else:
            try:
                r, _ = ckpt_worker(ctx, nproc, size, a.scaling_rounds, 0, f"scaling_{size}_n{nproc}", warmup=True)
            except Failed as e:
                stopped = f"{size} on {nproc} processes: {e}"
                print(f"bench: checkpoint_scaling: stopped, keeping what finished: {stopped}", flush=True)
                break
        rs = r["rounds"]
        gb = median(x["shard_bytes"] for x in rs) / 1e9
        point = {"size": size, "processes": nproc, "gb": gb, "rounds": len(rs)}
        for key in (
            "dcp_save_s",
            "raw_write_s",
            "raw_write_single_s",
            "rank0_save_s",
            "dcp_load_s",
            "stock_load_s",
            "raw_read_s",
            "raw_read_single_s",
        ):
            point[key] = median(x[key] for x in rs)
            point[key[:-2] + "_gb_per_s"] = gb / point[key]
        curve.append(point)
    return {}, {}, {"checkpoint_scaling": {"points": curve, "stopped": stopped}}


def save_memory(ctx) -> tuple[dict, dict, dict]:
    """Rank 0's memory high-water mark during a save, each contender in a fresh process
    (bench/save_memory.py), interleaved: DCP, rank 0, DCP, rank 0 ... One round: one launch of each."""
    a = ctx.args
    added = {"dcp": [], "rank0": []}
    peaks = {"dcp": [], "rank0": []}
    stopped = None
    for i in range(a.memory_rounds):
        try:
            for who in ("dcp", "rank0") if i % 2 == 0 else ("rank0", "dcp"):
                folder, out = ctx.scratch / "save_memory", ctx.scratch / "save_memory.json"
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                out.unlink(missing_ok=True)
                try:
                    launch(
                        a.nproc,
                        [
                            "-m",
                            "bench.save_memory",
                            "--contender",
                            who,
                            "--dir",
                            str(folder),
                            "--out",
                            str(out),
                            "--size",
                            a.memory_size,
                        ],
                        ctx.scratch / f"save_memory_{who}_{i}.log",
                        ctx.budget.need(20, f"a {who} save in a fresh process"),
                    )
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
                r = json.loads(out.read_text())
                added[who].append(r["added"])
                peaks[who].append(r["peak_rss"])
        except Failed as e:
            stopped = str(e)
            break
    n = min(len(added["dcp"]), len(added["rank0"]))
    key = "dcp_vs_rank0_peak_mem"
    if not n:
        return *not_measured([key], stopped), {}
    note = (
        f"{a.memory_size} transformer + AdamW, {a.nproc} processes, {n} rounds, each save in a fresh process after one "
        f"training step; rank 0's VmHWM during the save minus its RSS before: {median(added['dcp']) / 1e9:.2f} GB vs "
        f"{median(added['rank0']) / 1e9:.2f} GB (medians; absolute peaks {median(peaks['dcp']) / 1e9:.2f} vs "
        f"{median(peaks['rank0']) / 1e9:.2f} GB)" + (f"; stopped early ({stopped})" if stopped else "")
    )
    rounds = [d / r for d, r in zip(added["dcp"][:n], added["rank0"][:n])]
    return {key: figure(key, rounds)}, {key: note}, {"save_memory": {"added": added, "peak_rss": peaks}}


def memory_modes(ctx) -> tuple[dict, dict, dict]:
    """Each rank's peak RSS under the memory modes of bench/memory_modes.py (gradients reduced at the
    last or every micro-batch, activations kept, recomputed in full or by operator), each mode in a
    fresh launch, the modes interleaved (a round: one launch of each, the order turned every round).
    A round's figure is a ratio of two modes' peaks, rank by rank (each rank's ratio is one value);
    the estimate's terms (trainer.preflight.memory on the CPU) beside them. glibc is told to give freed blocks
    back (MALLOC_MMAP_THRESHOLD_, as bench/memory_calibration.py), so the RSS follows what is allocated."""
    from bench.common import size_overrides  # imports torch: not before a measurement needs it
    from bench.memory_modes import MODES, RATIOS

    a = ctx.args
    n = a.nproc
    train = [
        *size_overrides(a.modes_size),
        f"model.seq_len={a.modes_seq_len}",
        f"train.global_batch_size={4 * n}",  # 4 micro-batches of 1 sequence on each rank
        "train.micro_batch_size=1",
        "train.steps=2",
        "log.interval=1",
        "log.progress=false",
        "checkpoint.interval=0",
        "optim.warmup_steps=1",
    ]
    peaks = {name: [] for name, _ in MODES}
    estimates, stopped = {}, None
    threshold = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    for i in range(a.modes_rounds):
        try:
            order = MODES if i % 2 == 0 else MODES[::-1]
            got = {}
            for name, overrides in order:
                run_dir, out = ctx.scratch / "memory_modes", ctx.scratch / "memory_modes.json"
                shutil.rmtree(run_dir, ignore_errors=True)
                for old in ctx.scratch.glob("memory_modes.json.rank*"):
                    old.unlink()
                with _environ(threshold):
                    launch(
                        n,
                        ["-m", "bench.memory_modes", "--out", str(out), "--config", CONFIG, f"run_dir={run_dir}"]
                        + train
                        + overrides,
                        ctx.scratch / f"memory_modes_{name}_{i}.log",
                        ctx.budget.need(30, f"the {name} mode's run"),
                    )
                ranks = [json.loads((ctx.scratch / f"memory_modes.json.rank{r}").read_text()) for r in range(n)]
                got[name] = [r["peak_rss"] for r in ranks]
                estimates[name] = ranks[0]["estimate"]
            for name in peaks:
                peaks[name].append(got[name])
        except Failed as e:
            stopped = str(e)
            break
    keys = [key for key, _, _, _ in RATIOS]
    rounds = len(peaks["last"])
    if not rounds:
        return *not_measured(keys, stopped), {}
    figures, notes = {}, {}
    for key, top, bottom, _ in RATIOS:
        values = [t / b for i in range(rounds) for t, b in zip(peaks[top][i], peaks[bottom][i])]
        figures[key] = figure(key, values)
        est = estimates[top]["total"] / estimates[bottom]["total"]
        differences = [t - b for i in range(rounds) for t, b in zip(peaks[top][i], peaks[bottom][i])]
        terms = ", ".join(
            f"{term} {estimates[top][term] / 1e9:.3f} vs {estimates[bottom][term] / 1e9:.3f}"
            for term in ("gradients", "activations")
        )
        notes[key] = (
            f"{a.modes_size}, seq {a.modes_seq_len}, {n} processes, 4 micro-batches of 1 a step; {rounds} rounds x "
            f"{n} ranks; medians {statistics.median(sum(peaks[top], [])) / 1e9:.3f} / "
            f"{statistics.median(sum(peaks[bottom], [])) / 1e9:.3f} GB, difference "
            f"{statistics.median(differences) / 1e9:+.3f} GB; the estimate's totals "
            f"{estimates[top]['total'] / 1e9:.3f} / {estimates[bottom]['total'] / 1e9:.3f} GB ({est:.3f}, difference "
            f"{(estimates[top]['total'] - estimates[bottom]['total']) / 1e9:+.3f} GB; {terms} GB)"
            + (f"; stopped: {stopped}" if stopped else "")
        )
    details = {
        "memory_modes": {
            "peak_rss_by_round_and_rank": peaks,
            "estimate": {name: {k: v for k, v in e.items() if k != "notes"} for name, e in estimates.items()},
            "estimate_notes": {name: e["notes"] for name, e in estimates.items()},
        }
    }
    return figures, notes, details


@contextlib.contextmanager
def _environ(values: dict):
    """os.environ with `values` set (launch passes os.environ on), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def shard_bytes(ctx) -> tuple[dict, dict, dict]:
    """On 4 processes; the checkpoint worker measures the same on its N processes."""
    out = ctx.scratch / "shard_bytes_n4.json"
    launch(
        4,
        ["-m", "bench.shard_bytes", "--out", str(out), "--size", ctx.args.shard_size],
        ctx.scratch / "shard_bytes_n4.log",
        ctx.budget.need(40, "shard bytes on 4 processes"),
    )
    return shard_values(json.loads(out.read_text()))


def shard_values(r: dict) -> tuple[dict, dict, dict]:
    key = f"shard_bytes_vs_ideal_n{r['world_size']}"
    note = (
        f"{r['size']} transformer + AdamW, {r['fsdp']['total_bytes'] / 1e6:.1f} MB unsharded, after one step, "
        f"largest rank, storages incl. padding (to_local numel: {r['fsdp']['vs_ideal']:.4f}); DDP: "
        f"{r['ddp']['storage_vs_ideal']:.2f}; a count, the same every time: one round"
    )
    return {key: figure(key, [r["fsdp"]["storage_vs_ideal"]], exact=True)}, {key: note}, {key: r}


def trainer_runs(ctx) -> tuple[dict, dict, dict]:
    """The real trainer against bench/minimal_loop.py (same model, batch, processes and steps), in
    rounds T M (R): a round's figure is the trainer's median step over the minimal loop's. In the
    first --resume-rounds rounds, the trainer then resumes from the checkpoint its run just wrote,
    under bench/timed_trainer.py, which notes when each start-up phase ends (the fresh run's too).
    A round whose launch fails is left out (its log stays in the scratch folder); a second
    failure, or no time left, ends the series. The rounds that finished count.

    Step time: seconds between consecutive metrics rows, seen from outside (the same clock for both)."""
    a = ctx.args
    n, steps, skip = a.nproc, a.steps, 5
    overrides = [
        *common_size(a.step_size),
        f"model.seq_len={a.seq_len}",
        f"train.global_batch_size={a.batch}",
        "log.interval=1",
        "checkpoint.interval=0",
        "log.progress=false",
    ]
    minimal = [
        "-m",
        "bench.minimal_loop",
        "--size",
        a.step_size,
        "--seq-len",
        str(a.seq_len),
        "--batch",
        str(a.batch),
        "--steps",
        str(steps),
    ]
    per_run = {"trainer": [], "minimal": []}  # each run's median interval between metrics rows
    parts = {"fresh": [], "resumed": []}  # each run's start-up phases, seconds
    stopped, failed = None, []  # why the series ended early; the rounds left out, and why
    for i in range(a.pairs):
        order = ("trainer", "minimal") if i % 2 == 0 else ("minimal", "trainer")
        if i < a.resume_rounds:
            order += ("resume",)
        done = {}
        for who in order:
            run_dir = ctx.scratch / f"{'minimal' if who == 'minimal' else 'trainer'}_{i}"
            if who != "resume":
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir(parents=True)
            metrics, times = run_dir / "metrics.jsonl", run_dir / f"times_{who}.json"
            metrics.unlink(missing_ok=True)
            args = {
                "trainer": trainer_args(run_dir, [*overrides, f"train.steps={steps}"], times),
                "minimal": [*minimal, "--out", str(metrics)],
                "resume": trainer_args(run_dir, [*overrides, f"train.steps={steps + 1}"], times),
            }[who]
            try:
                launched = time.time()
                rows, text = launch(
                    n, args, ctx.scratch / f"{who}_{i}.log", ctx.budget.need(30, f"a {who} run"), watch=metrics
                )
                rows = [(t, r) for t, r in rows if t is not None and "step_time_s" in r]
                if who == "resume" and not re.search(r"loaded in ([0-9.]+)s", text):
                    raise Failed("the resumed run did not log 'loaded in ...s'; did it resume?")
                if not rows:
                    raise Failed(f"the {who} run wrote no metrics rows ({metrics})")
            except Failed as e:
                failed.append(f"{who} run {i + 1}: {e}")
                if len(failed) > 1 or str(e).startswith("skipped"):
                    stopped = failed[-1]
                break
            if who != "minimal":
                parts["resumed" if who == "resume" else "fresh"].append(phases(launched, json.loads(times.read_text())))
            if who != "resume":
                rows = rows[skip:]  # warm-up steps left out
                done[who] = median(b[0] - a_[0] for a_, b in zip(rows, rows[1:]))
        if len(done) == 2:
            for who in done:
                per_run[who].append(done[who])
        for who in ("trainer", "minimal"):
            shutil.rmtree(ctx.scratch / f"{who}_{i}", ignore_errors=True)
        if stopped:
            print(f"bench: trainer_runs: stopped early, keeping what finished: {stopped}", flush=True)
            break
    what = f"{a.step_size} transformer, seq {a.seq_len}, global batch {a.batch}, {n} processes"
    figures, notes = {}, {}
    key = "trainer_vs_minimal_step_time"
    if per_run["trainer"]:
        figures[key] = figure(key, [t / m for t, m in zip(per_run["trainer"], per_run["minimal"])])
        notes[key] = (
            f"{what}, {len(per_run['trainer'])} rounds of one trainer and one minimal-loop run ({steps} steps each, "
            f"{skip} "
            f"warm-up left out, order alternating), a round's value: the ratio of the two runs' median seconds between "
            f"metrics rows; medians {median(per_run['trainer']) * 1e3:.1f} vs {median(per_run['minimal']) * 1e3:.1f} "
            "ms. "
            "Same work in both: model, fully_shard per block and root, AdamW, clipping, LambdaLR schedule, one "
            "all-reduce and metrics row per step. The trainer's own per-step work is kept, as what the goal bounds: "
            "its "
            "all-reduce also carries the stop flag (a signal stops every rank at the same step) and the non-finite "
            "check, one store write of its step (names a stuck rank), the full gradient norm in its row, and its data "
            "path (a DataLoader over indexed samples, resumable at any sample) where the minimal loop draws random "
            "tokens"
        )
    else:
        notes[key] = f"not measured: {stopped or '; '.join(failed)}"
    if parts["resumed"]:
        for part in RESUME_PARTS:
            figures[f"resume_{part}_s"] = figure(f"resume_{part}_s", [p[part] for p in parts["resumed"]])
            fresh = median(p[part] for p in parts["fresh"]) if parts["fresh"] else None
            notes[f"resume_{part}_s"] = (
                f"{what}, {len(parts['resumed'])} resumed runs (bench/timed_trainer.py, rank 0); "
                + (f"the fresh runs': {fresh:.2f}s (median)" if fresh is not None else "")
            )
    else:
        why = stopped or "; ".join(failed) or f"--resume-rounds {a.resume_rounds}"
        notes.update({f"resume_{p}_s": f"not measured: {why}" for p in RESUME_PARTS})
    for k in figures:
        if failed:
            notes[k] += f"; rounds left out: {'; '.join(failed)}"
        if stopped:
            notes[k] += f"; the series stopped early ({stopped})"
    return (
        figures,
        notes,
        {"trainer_runs": {"per_run_step_s": per_run, "start_up_phases_s": parts, "stopped": stopped, "failed": failed}},
    )


def common_size(size: str) -> list[str]:
    from bench.common import size_overrides  # imports torch: not before a measurement needs it

    return size_overrides(size)


def phases(launched: float, t: dict) -> dict:
    """Seconds of each start-up phase from bench/timed_trainer.py's time stamps."""
    return {
        "startup": t["started"] - launched,
        "imports": t["imported"] - t["started"],
        "rendezvous": t["rendezvous_end"] - t["rendezvous_start"],
        "build": t["load_start"] - t["rendezvous_end"],
        "load": t["load_end"] - t["load_start"],
        "first_step": t["first_row"] - t["load_end"],
    }


def throughput_scaling(ctx) -> tuple[dict, dict, dict]:
    """Training throughput per process of the trainer on 1, 2 and 4 processes, the same batch per
    process (weak scaling): tokens/s from its metrics rows, warm-up rows left out. A curve, no goal."""
    a = ctx.args
    curve = []
    for nproc in (1, 2, 4):
        run_dir = ctx.scratch / f"throughput_n{nproc}"
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [
            *common_size(a.step_size),
            f"model.seq_len={a.seq_len}",
            f"train.global_batch_size={a.batch // a.nproc * nproc}",
            "log.interval=5",
            "checkpoint.interval=0",
            "log.progress=false",
            f"train.steps={a.throughput_steps}",
        ]
        try:
            launch(
                nproc,
                trainer_args(run_dir, overrides),
                ctx.scratch / f"throughput_n{nproc}.log",
                ctx.budget.need(30, f"the trainer on {nproc} processes"),
            )
        except Failed as e:
            print(f"bench: throughput_scaling: stopped, keeping what finished: {e}", flush=True)
            break
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        windows = [r["tokens_per_s"] / nproc for r in rows if "tokens_per_s" in r][1:]  # the first: warm-up
        shutil.rmtree(run_dir, ignore_errors=True)
        curve.append(
            {
                "processes": nproc,
                "threads_per_process": threads_per_process(nproc),
                "tokens_per_s_per_process": stats.figure(windows),
            }
        )
    return {}, {}, {"throughput_scaling": curve}


def preemption(ctx) -> tuple[dict, dict, dict]:
    """bench/preemption.py on the local Slurm cluster (make slurm-up); not measured without it."""
    from bench import preemption as worker

    keys = MEASURED_BY[preemption]
    if not worker.cluster_up():
        return (*not_measured(keys, "the local Slurm cluster is not up (make slurm-up)"), {})
    timeout = ctx.budget.need(60, "one preemption round")
    rounds = rounds_of(ctx, "preemption", ctx.args.preempt_rounds, timeout, "--size", ctx.args.step_size)["rounds"]
    part = lambda key: [r[key] for r in rounds]
    figures = {
        "preempt_to_committed_s": figure("preempt_to_committed_s", part("request_to_committed_s")),
        "preempt_to_requeued_s": figure("preempt_to_requeued_s", part("committed_to_requeued_s")),
        "preempt_restart_s": figure("preempt_restart_s", part("running_to_first_step_s")),
        "preempt_restart_vs_load": figure(
            "preempt_restart_vs_load", [r["running_to_first_step_s"] / r["load_s"] for r in rounds]
        ),
    }
    what = (
        f"{ctx.args.step_size} transformer, 2 nodes of the local cluster x 1 rank, preempted by an exclusive job of "
        f"the urgent partition (GraceTime 15 s), {len(rounds)} round(s); Slurm's hold on a requeued job (~120 s) "
        f"is cut to 2 s by the bench and not counted"
    )
    notes = {key: what for key in figures}
    notes["preempt_to_committed_s"] += f"; the save itself (status.json save_s): median {median(part('save_s')):.2f}s"
    notes["preempt_restart_vs_load"] += (
        f"; load {median(part('load_s')):.2f}s and first step "
        f"{median(part('first_step_s')):.2f}s of the restart's {median(part('running_to_first_step_s')):.1f}s"
    )
    return figures, notes, {"preemption": rounds}


def rounds_of(ctx, name: str, rounds: int, timeout: float, *args: str) -> dict:
    """Run bench/<name>.py (with `args`) for `rounds` rounds within `timeout` seconds (its log in
    the scratch folder) and return the JSON it wrote; it writes after each round, so the rounds
    that finished count when time runs out."""
    out, log = ctx.scratch / f"{name}.json", ctx.scratch / f"{name}.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", f"bench.{name}", "--out", str(out), "--rounds", str(rounds), *args]
    with open(log, "w") as f:
        try:
            subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"bench: {name}: timed out after {timeout:.0f}s, keeping the rounds that finished", flush=True)
    if not out.exists():
        raise Failed(f"no round finished (log: {log.relative_to(ROOT)})")
    return json.loads(out.read_text())


def goodput(ctx) -> tuple[dict, dict, dict]:
    """bench/goodput.py on the local Slurm cluster (make slurm-up); not measured without it."""
    from bench import goodput as worker
    from bench import preemption as cluster

    keys = MEASURED_BY[goodput]
    if not cluster.cluster_up():
        return (*not_measured(keys, "the local Slurm cluster is not up (make slurm-up)"), {})
    r = rounds_of(ctx, "goodput", ctx.args.goodput_rounds, ctx.budget.need(150, "one goodput round"))
    summary = worker.summarise(r)
    figures = {
        "goodput": figure("goodput", summary["goodput"]),
        "goodput_steps_redone": figure("goodput_steps_redone", summary["steps_redone"], exact=True),
        "recovery_crash_s": figure("recovery_crash_s", summary["total_s"]["crash"]),
        "recovery_hang_s": figure("recovery_hang_s", summary["total_s"]["hang"]),
        "recovery_preemption_s": figure("recovery_preemption_s", summary["total_s"]["preemption"]),
        "recovery_node_death_s": figure("recovery_node_death_s", summary["total_s"]["node_death"]),
        "restart_vs_goal": figure("restart_vs_goal", summary["restart_vs_goal"]),
        "goodput_llama3_1024": figure("goodput_llama3_1024", summary["llama3"]),
    }
    notes = {key: summary["note"] for key in figures}
    return figures, notes, {"goodput": {**r, "summary": summary}}


def scale(ctx) -> tuple[dict, dict, dict]:
    """bench/scale.py: DCP's planning, the checkpoint's metadata and manifest for 1k to 16k ranks
    (synthetic plans, no processes), and the rendezvous of 2 to 16 local ranks. Curves, no goal; the
    rounds that finished count if it runs out of time."""
    timeout = ctx.budget.need(120, "one round of the scale measurements")
    return {}, {}, {"scale": rounds_of(ctx, "scale", ctx.args.scale_rounds, timeout)}


def scale_tables(r: dict) -> list[str]:
    """The markdown of bench/scale.py's result: medians [95% interval] of each point."""

    def cell(f: dict, unit: float = 1.0) -> str:
        short = lambda x: f"{x:,.0f}" if abs(x) >= 1000 else number(x)
        ci = f" [{short(f['ci95'][0] / unit)}-{short(f['ci95'][1] / unit)}]" if f["ci95"] else ""
        return short(f["median"] / unit) + ci

    lines = []
    if r.get("layout"):
        lines += [
            "",
            "The first save planned from the layout and a resume from its chunk index "
            "(trainer/checkpoint/save_plan.py), "
            "the whole Llama-3.1-8B state (model + AdamW, FSDP2 Shard(0) over N ranks, 1164 items a rank), "
            f"planning simulated per rank (bench/scale.py); the finish (.metadata for stock DCP) on the slice x "
            f"{r['slice_to_whole']:.2f}. Seconds unless said:",
            "",
            "| ranks | first save: rank 0's planning | a rank's planning | rank 0 peak MB | plans in / out MB "
            "| finish: chunk index | finish: .metadata | .metadata MB | chunks.npz MB | resume: rank 0 "
            "| resume: a rank | rank 0 resume peak MB | a rank's slice KB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n, p in sorted(r["layout"].items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {n} | {cell(p['layout_planning_s'])} | {cell(p['layout_rank_planning_s'])} | "
                f"{cell(p['layout_peak_bytes'], 1e6)} | {number(p['layout_gather_bytes']['median'] / 1e6)} / "
                f"{number(p['layout_scatter_bytes']['median'] / 1e6)} | {cell(p['index_finish_s'])} | "
                f"{cell(p['layout_finish_s'])} | {cell(p['layout_metadata_bytes'], 1e6)} | "
                f"{cell(p['index_bytes'], 1e6)} | {cell(p['index_rank0_s'])} | {cell(p['index_rank_s'])} | "
                f"{cell(p['index_resume_peak_bytes'], 1e6)} | {cell(p['index_slice_bytes'], 1e3)} |"
            )
    if r.get("layout") and "commit_delay_s" in next(iter(r["layout"].values())):
        lines += [
            "",
            "The commit's delay after the last byte is written (trainer/checkpoint/save_plan.py's finish on rank 0), "
            "with .metadata built and pickled before the commit (DCP's way, what a save of at most "
            "save_plan.METADATA_BEFORE_COMMIT chunk records still does) and without it (past that: .metadata "
            "written after the commit from chunks.npz by a background process, trainer/checkpoint/stock.py, "
            f"measured on the slice x {r['slice_to_whole']:.2f}). Seconds unless said:",
            "",
            "| ranks | commit delay with .metadata | without (chunk index only) "
            "| background .metadata after the commit "
            "| its .metadata MB | the process holds GB |",
            "|---|---|---|---|---|---|",
        ]
        for n, p in sorted(r["layout"].items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {n} | {cell(p['commit_delay_with_metadata_s'])} | {cell(p['commit_delay_s'])} | "
                f"{cell(p['layout_stock_s'])} | {cell(p['layout_stock_bytes'], 1e6)} | "
                + (f"{cell(p['layout_stock_held_bytes'], 1e9)} |" if "layout_stock_held_bytes" in p else "- |")
            )
    if r.get("reshard"):
        lines += [
            "",
            "A resume on another number of ranks (the whole state saved by SAVED ranks, FSDP2 Shard(0), resumed "
            "on NOW): rank 0 reads, hashes, checks and parses chunks.npz, makes every rank's part (the saved "
            "chunks overlapping its own, save_plan.slices) and pickles them; a rank (the middle one) unpickles "
            "its part, makes DCP's metadata of it and its load plan. Seconds unless said:",
            "",
            "| saved -> now | rank 0 | of it: the slices | a rank | rank 0 peak MB | a rank's slice KB "
            "| the largest slice KB | records in a rank's slice | its read items | common part KB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for pair, p in r["reshard"].items():
            lines.append(
                f"| {pair.replace(':', ' -> ')} | {cell(p['reshard_rank0_s'])} | {cell(p['reshard_slices_s'])} | "
                f"{cell(p['reshard_rank_s'])} | {cell(p['reshard_rank0_peak_bytes'], 1e6)} | "
                f"{cell(p['reshard_slice_bytes'], 1e3)} | {cell(p['reshard_slice_max_bytes'], 1e3)} | "
                f"{number(p['reshard_slice_records']['median'])} | {number(p['reshard_rank_read_items']['median'])} | "
                f"{cell(p['reshard_header_bytes'], 1e3)} |"
            )
    if not r.get("planning"):
        return lines + _rendezvous_lines(r, cell)
    lines += [
        "",
        f"DCP planning for the Llama-3.1-8B state (model + AdamW, FSDP2 Shard(0) over N ranks), the "
        f"coordinator's (rank 0's) work at a save and one rank's at a load; measured on a slice of 48 items "
        f"per rank, x {r['slice_to_whole']:.2f} for the whole state (bench/scale.py). Seconds unless said:",
        "",
        "| ranks | gather plans | global plan | scatter | finish | rank 0 peak GB | .metadata MB | plans MB to rank 0 "
        "| unpickle .metadata | restricted unpickle | rank 0 indexes its chunks | load local plan | DCP's load plan "
        "| manifest.json MB | read manifest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, p in sorted(r.get("planning", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"| {n} | {cell(p['gather_s'])} | {cell(p['global_plan_s'])} | {cell(p['scatter_s'])} | "
            f"{cell(p['finish_s'])} | {cell(p['coordinator_peak_bytes'], 1e9)} | {cell(p['metadata_bytes'], 1e6)} | "
            f"{cell(p['plans_bytes'], 1e6)} | {cell(p['metadata_unpickle_s'])} | "
            f"{cell(p['metadata_restricted_unpickle_s'])} | {cell(p['load_index_s'])} | "
            f"{cell(p['load_local_plan_s'])} | {cell(p['dcp_load_local_plan_s'])} | "
            f"{cell(p['manifest_bytes'], 1e6)} | {cell(p['manifest_read_s'])} |"
        )
    for n, w in r.get("whole", {}).items():
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in w["measured_vs_extrapolated"].items())
        lines += ["", f"The whole state planned at {n} ranks / the slice x factor: {ratios}."]
    return lines + _rendezvous_lines(r, cell)


def _rendezvous_lines(r: dict, cell) -> list[str]:
    """scale_tables' rendezvous and store lines."""
    lines: list[str] = []
    if r.get("rendezvous"):
        lines += [
            "",
            "Rendezvous on this host (torchrun --standalone, trainer.dist.init + a barrier, gloo), seconds:",
            "",
            "| ranks | from the last rank's arrival to all past the barrier | rank 0's init | launch to the last "
            "arrival |",
            "|---|---|---|---|",
        ]
        for n, p in sorted(r["rendezvous"].items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {n} | {cell(p['from_last_arrival_s'])} | {cell(p['rank0_init_s'])} | "
                f"{cell(p['launch_to_last_arrival_s'])} |"
            )
    for n, p in sorted(r.get("store", {}).items(), key=lambda kv: int(kv[0])):
        lines += ["", f"One TCPStore, {n} process(es) writing: {cell(p['writes_per_s'])} writes/s."]
    return lines


# The GPU runs' micro-batch is the largest power of two whose estimated peak (trainer.preflight.memory, GPU
# estimate, eager: the larger of the two runs) stays within this share of one GPU's memory.
GPU_MEMORY_SHARE = 0.85
# The least time a GPU run is started with: the start and compilation of the 1b model take about a
# minute on an H100 (a shorter run still gives its windows; one cut off is reported as not measured).
GPU_RUN_MIN_S = 60


def gpu_overrides(micro: int, nproc: int, compiled: bool = False) -> list[str]:
    """The trainer's overrides for a GPU run of the 1b model: `micro` sequences per GPU, one per step."""
    return [
        "model.size=1b",
        "model.seq_len=2048",
        f"train.global_batch_size={micro * nproc}",
        f"train.micro_batch_size={micro}",
        "parallel.param_dtype=bfloat16",
        f"parallel.compile={str(compiled).lower()}",
    ]


def gpu_micro_batch(total_memory: int, nproc: int) -> int:
    """The largest power-of-two micro-batch (1 to 64) whose estimated eager peak fits GPU_MEMORY_SHARE
    of `total_memory` bytes (1 if none does). Was a rule ("16 above 100 GB, else 8: 16 peaks at
    ~72 GB") that no longer held once the compiled loss kept no float32 logits (#33 item 5)."""
    from trainer.config import load
    from trainer.preflight import memory

    profile = memory.measure(load(str(ROOT / CONFIG), gpu_overrides(1, nproc)), gpu=True)
    best = 1
    for micro in (2, 4, 8, 16, 32, 64):
        cfg = load(str(ROOT / CONFIG), gpu_overrides(micro, nproc))
        if memory.estimate(cfg, nproc, micro, nproc, gpu=True, profile=profile).total > GPU_MEMORY_SHARE * total_memory:
            break
        best = micro
    return best


def gpu(ctx) -> tuple[dict, dict, dict]:
    """MFU, tokens/s and peak memory of short bf16 runs of the 1b transformer on all local GPUs, with
    and without torch.compile; one micro-batch per step, the largest the memory estimate fits in
    GPU_MEMORY_SHARE of a GPU. Each run that finished is reported, also when the other did not."""
    import torch

    keys = MEASURED_BY[gpu]
    if not torch.cuda.is_available():
        return (
            {k: None for k in keys},
            {k: "not measured: no GPU here (torch.cuda.is_available() is False)" for k in keys},
            {},
        )
    n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    micro = gpu_micro_batch(torch.cuda.get_device_properties(0).total_memory, n)
    run_dir = ctx.scratch / "gpu"
    results, failed = {}, {}
    for compiled in (True, False):
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = gpu_overrides(micro, n, compiled) + [
            f"train.steps={ctx.args.gpu_steps}",
            "log.interval=5",
            "log.progress=false",
            "checkpoint.interval=0",
            "data.num_workers=2",
            "optim.lr=3e-4",
        ]
        label = "compiled" if compiled else "eager"
        try:
            launch(
                n,
                trainer_args(run_dir, overrides),
                ctx.scratch / f"gpu-{label}.log",
                ctx.budget.need(GPU_RUN_MIN_S, f"the {label} GPU run"),
            )
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        except (Failed, OSError, ValueError) as e:
            failed[label] = f"not measured: the {label} run: {e}"
            continue
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint too: ~13 GB
        results[label] = [r for r in rows if "tokens_per_s" in r][1:]  # the first window holds compilation/warm-up
    if not results:
        raise Failed("; ".join(failed.values()))
    windows = lambda label, key: (
        [r[key] for r in results[label]] if results.get(label) and key in results[label][0] else None
    )
    values = {
        "gpu_mfu": windows("compiled", "mfu"),
        "gpu_tokens_per_s": windows("compiled", "tokens_per_s"),
        "gpu_peak_mem_gb": [max(r["peak_mem_gb"] for r in results["compiled"])] if results.get("compiled") else None,
        "gpu_mfu_eager": windows("eager", "mfu"),
    }
    values = {k: figure(k, v, exact=k == "gpu_peak_mem_gb") if v else None for k, v in values.items()}
    rounds = len(results.get("compiled") or results.get("eager") or [])
    what = (
        f"1b transformer ({n} x {name}), bf16 params, float32 reduction, seq 2048, {micro} sequences per GPU per "
        f"step (the largest the memory estimate fits in {GPU_MEMORY_SHARE:.0%} of a GPU), no activation "
        f"checkpointing; rounds: {rounds} windows of 5 steps after the first"
    )
    no_peak = "the GPU's peak FLOP/s is unknown to trainer.metrics"

    def why(key: str, label: str) -> str:
        if label in failed:
            return failed[label]
        return what if values[key] is not None or key in ("gpu_tokens_per_s", "gpu_peak_mem_gb") else no_peak

    return (
        values,
        {
            "gpu_mfu": why("gpu_mfu", "compiled"),
            "gpu_tokens_per_s": why("gpu_tokens_per_s", "compiled"),
            "gpu_peak_mem_gb": why("gpu_peak_mem_gb", "compiled"),
            "gpu_mfu_eager": why("gpu_mfu_eager", "eager"),
        },
        {},
    )


# In this order: the keys each measures and about the least time it needs to measure them (its
# first launch, or one round). That of the later ones is kept from each measurement's time.
MEASUREMENTS = [
    (
        checkpoint_io,
        [
            "dcp_save_vs_disk",
            "dcp_load_vs_disk",
            "checksum_load_overhead",
            "checksum_load_overhead_cached",
            "dcp_vs_rank0_save_time",
            "async_cost_vs_sync",
            "async_blocked_vs_sync",
            "async_slowdown_vs_sync",
            "shard_bytes_vs_ideal_n2",
        ],
        150,
    ),
    (checkpoint_scaling, [], 60),
    (save_memory, ["dcp_vs_rank0_peak_mem"], 40),
    (shard_bytes, ["shard_bytes_vs_ideal_n4"], 40),
    (memory_modes, ["every_vs_last_peak_rss", "full_ac_vs_none_peak_rss", "selective_ac_vs_none_peak_rss"], 4 * 40),
    (trainer_runs, ["trainer_vs_minimal_step_time", *[f"resume_{p}_s" for p in RESUME_PARTS]], 3 * 30),
    (throughput_scaling, [], 30),
    (
        preemption,
        ["preempt_to_committed_s", "preempt_to_requeued_s", "preempt_restart_s", "preempt_restart_vs_load"],
        60,
    ),
    (
        goodput,
        [
            "goodput",
            "goodput_steps_redone",
            "recovery_crash_s",
            "recovery_hang_s",
            "recovery_preemption_s",
            "recovery_node_death_s",
            "restart_vs_goal",
            "goodput_llama3_1024",
        ],
        150,
    ),
    (scale, [], 120),
    (gpu, ["gpu_mfu", "gpu_tokens_per_s", "gpu_peak_mem_gb", "gpu_mfu_eager"], 2 * 150),  # 0 without a GPU
]
MEASURED_BY = {measure: keys for measure, keys, _ in MEASUREMENTS}


def least_time(chosen: list, index: int) -> float:
    """Seconds the measurements after chosen[index] need at least."""
    return sum(need for measure, _, need in chosen[index + 1 :] if measure is not gpu or gpu_count())


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


def number(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:,.0f}"


def markdown(info: dict, figures: dict, notes: dict, details: dict, sizes: str) -> str:
    lines = [
        f"# Bench {info['date']} on {info['host']}",
        "",
        f"torch {info['torch']}, {info['cpu']} ({info['cpu_cores']} cores), "
        f"{', '.join(info['gpus']) or 'no GPU'}; load average {info['load_average_at_start']:.1f} at the start. "
        f"{sizes}",
        "",
        "Median of the rounds, its 95% interval (percentile bootstrap, bench/stats.py), and the verdict: met or missed "
        "only when the whole interval is on one side of the goal, else within noise.",
        "",
        "| key | median | 95% interval | rounds | goal | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for key, (_, op, goal) in GOALS.items():
        f = figures.get(key)
        if f is None:
            lines.append(f"| `{key}` | null | - | 0 | {f'{op} {goal}' if goal is not None else '-'} | not measured |")
            continue
        ci = f"{number(f['ci95'][0])}-{number(f['ci95'][1])}" if f["ci95"] else "-"
        lines.append(
            f"| `{key}` | {number(f['median'])} | {ci} | {len(f['rounds'])} | "
            f"{f'{op} {goal}' if goal is not None else '-'} | {f['verdict'] or '-'} |"
        )
    points = details.get("checkpoint_scaling", {}).get("points")
    if points:
        lines += [
            "",
            "Checkpoint scaling (medians; GB/s of the shard files' bytes; raw: one writer/reader per process, "
            "and one alone):",
            "",
            "| size | processes | GB | DCP save s (GB/s) | raw write GB/s (alone) | rank-0 save s | DCP load s (GB/s) "
            "| stock reader load s | raw read GB/s (alone) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in points:
            lines.append(
                f"| {p['size']} | {p['processes']} | {p['gb']:.2f} | {p['dcp_save_s']:.2f} "
                f"({p['dcp_save_gb_per_s']:.2f}) | "
                f"{p['raw_write_gb_per_s']:.2f} ({p['raw_write_single_gb_per_s']:.2f}) | {p['rank0_save_s']:.2f} | "
                f"{p['dcp_load_s']:.2f} ({p['dcp_load_gb_per_s']:.2f}) | {p['stock_load_s']:.2f} | "
                f"{p['raw_read_gb_per_s']:.2f} ({p['raw_read_single_gb_per_s']:.2f}) |"
            )
    curve = details.get("throughput_scaling")
    if curve:
        lines += [
            "",
            "Training throughput per process, the same batch per process (tokens/s, median of the metrics "
            "windows after the first):",
            "",
            "| processes | threads each | tokens/s per process | 95% interval |",
            "|---|---|---|---|",
        ]
        for p in curve:
            f = p["tokens_per_s_per_process"]
            ci = f"{number(f['ci95'][0])}-{number(f['ci95'][1])}" if f["ci95"] else "-"
            lines.append(
                f"| {p['processes']} | {p['threads_per_process']} | {number(f['median']) if f['median'] else '-'} | "
                f"{ci} |"
            )
    lines += details.get("goodput", {}).get("summary", {}).get("table", [])
    if details.get("scale"):
        lines += scale_tables(details["scale"])
    lines += ["", "What each figure compares, and how it was measured:", ""]
    for key, (what, _, _) in GOALS.items():
        lines.append(f"- `{key}`: {what}. {notes.get(key, '')}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=1400, help="seconds for all measurements")
    parser.add_argument("--scratch", default="runs/bench", help="scratch folder, on the filesystem checkpoints go to")
    parser.add_argument("--results", default="bench/results")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the step-time, checkpoint and resume runs")
    parser.add_argument("--pairs", type=int, default=6, help="rounds of trainer and minimal-loop runs")
    parser.add_argument("--resume-rounds", type=int, default=5, help="of those, rounds that also resume the trainer")
    parser.add_argument("--steps", type=int, default=20, help="steps of each step-time run")
    parser.add_argument("--step-size", default="small", help="transformer size of the step-time and throughput runs")
    parser.add_argument("--seq-len", type=int, default=64, help="sequence length of the step-time runs")
    parser.add_argument("--batch", type=int, default=8, help="global batch of the step-time runs")
    parser.add_argument("--throughput-steps", type=int, default=20, help="steps of each throughput-scaling run")
    parser.add_argument("--shard-size", default="small", help="transformer size of the shard-bytes measurements")
    parser.add_argument("--ckpt-size", default="350m", help="size of the checkpoint runs (bench.common.SIZES: 4.5 GB)")
    parser.add_argument("--ckpt-rounds", type=int, default=5, help="interleaved rounds of each checkpoint comparison")
    parser.add_argument(
        "--checksum-pairs",
        type=int,
        default=10,
        help="more checked/unchecked load pairs for checksum_load_overhead (this VM's disk is bimodal)",
    )
    parser.add_argument("--step-size-async", default="small", help="the model that trains during the async save")
    parser.add_argument(
        "--scaling-sizes", nargs=3, default=["60m", "125m", "350m"], help="sizes of the checkpoint scaling curve"
    )
    parser.add_argument(
        "--scaling-rounds", type=int, default=1, help="rounds of each point of the checkpoint scaling curve"
    )
    parser.add_argument("--memory-size", default="125m", help="size of the fresh-process memory measurement")
    parser.add_argument("--memory-rounds", type=int, default=3, help="rounds (a DCP and a rank-0 launch each) of it")
    parser.add_argument("--modes-size", default="125m", help="transformer size of the memory modes' peak RSS (#44)")
    # 1024: the activations (1.2 GB a sample without checkpointing) outgrow the optimizer step's peak, so the
    # checkpointing modes' figures are of what they change (at 256 every mode's peak was the step's: ratio 0.997)
    parser.add_argument("--modes-seq-len", type=int, default=1024, help="sequence length of the memory modes' runs")
    parser.add_argument("--modes-rounds", type=int, default=3, help="rounds (a launch of each mode) of them")
    parser.add_argument(
        "--no-system-drop",
        action="store_true",
        help="evict only the bench's own files' pages, never the whole page cache (shared machines)",
    )
    parser.add_argument(
        "--preempt-rounds", type=int, default=5, help="preemptions on the local Slurm cluster (~40 s each)"
    )
    parser.add_argument(
        "--goodput-rounds", type=int, default=3, help="goodput rounds on the local Slurm cluster (~3 min each)"
    )
    parser.add_argument(
        "--scale-rounds", type=int, default=3, help="rounds of bench/scale.py (~4 min each on the 2-core VM)"
    )
    parser.add_argument("--gpu-steps", type=int, default=30, help="steps of each GPU run")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[m.__name__ for m, _, _ in MEASUREMENTS],
        help="run only these measurements (the others are reported as not measured)",
    )
    args = parser.parse_args()
    started = time.perf_counter()

    class ctx:  # what every measurement gets
        pass

    ctx.args, ctx.budget, ctx.scratch = args, Budget(args.budget), (ROOT / args.scratch).resolve()
    ctx.scratch.mkdir(parents=True, exist_ok=True)
    info = machine()
    figures, notes, details = {}, {}, {}
    ctx.details = details
    chosen = [m for m in MEASUREMENTS if not args.only or m[0].__name__ in args.only]
    ran = {measure for measure, _, _ in chosen}
    for index, (measure, keys, _) in enumerate(chosen):
        ctx.budget.reserve = least_time(chosen, index)
        print(
            f"bench: {measure.__name__} ({ctx.budget.left():.0f}s of the budget left, "
            f"{ctx.budget.reserve:.0f}s of it kept for the rest)",
            flush=True,
        )
        began = time.perf_counter()
        try:
            f, n, d = measure(ctx)
            figures.update({k: f.get(k) for k in keys}), details.update(d)
            notes.update({k: n.get(k, "not measured") for k in keys})
        except Failed as e:
            print(f"bench: {measure.__name__}: {e}", flush=True)
            figures.update({k: None for k in keys}), notes.update({k: f"not measured: {e}" for k in keys})
        details.setdefault("seconds", {})[measure.__name__] = time.perf_counter() - began
    for measure, keys, _ in MEASUREMENTS:
        if measure not in ran:
            notes.update({k: f"not measured in this run (--only {' '.join(args.only)})" for k in keys})

    sizes = (
        (
            f"{args.nproc} processes (shard bytes: 2 and 4); models: checkpoints {args.ckpt_size} (async: "
            f"{args.step_size_async} training), memory {args.memory_size}, step time and resume {args.step_size}, "
            f"shard bytes {args.shard_size}; "
        )
        if ran - {gpu}
        else ""
    )
    sizes += f"{time.perf_counter() - started:.0f}s in all."
    text = markdown(info, figures, notes, details, sizes)
    results = ROOT / args.results
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"{info['date']}-{info['host']}"
    if args.only and gpu not in ran:  # some measurements only: named after them, beside the full run's
        stem = Path(f"{stem}-{'-'.join(name.replace('_', '-') for name in args.only)}")
    if gpu in ran and info["gpus"]:  # GPU figures: named after the GPU, beside the CPU's
        stem = Path(f"{stem}-{info['gpus'][0].split()[-1].lower()}")
    elif ran == {scale}:  # the scale figures alone: beside the full report, not over it
        stem = Path(f"{stem}-scale")
    Path(f"{stem}.md").write_text(text)
    report = {
        **figures,
        "machine": info,
        "sizes": sizes,
        "notes": notes,
        "details": details,
        "seconds": time.perf_counter() - started,
    }
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(text)
    print(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
