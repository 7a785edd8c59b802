"""A health check of every node before the first step: a bad node is named, not trained on.

At the start of every launch (trainer/launchers/torchrun.py), on every node, before torchrun starts the ranks:

* the GPUs torch sees are the ones Slurm assigned (judged where torch sees CUDA: on a node whose
  assigned GPUs torch cannot use at all, the ranks train on the CPU with gloo, as the launcher says);
* a short matmul on each GPU agrees with the CPU (in a child process: the launcher must not hold a
  CUDA context while its ranks train);
* the run dir takes a write of a few MB, with fsync, at `health.min_write_mbps` or faster;
* the site's own check, `health.command`, exits 0 within `health.command_timeout_s`.

Then, in the ranks, right after the process group starts: one short timed all-reduce across the
allocation, whose bus bandwidth must reach `health.min_busbw_gbps` on GPUs (on the CPU it is
measured and printed, not judged); rank 0 says it in one line.

A node that fails says so in one line (what failed, the measurement) and its launcher exits with
HEALTH_FAILED. Under Slurm it first leaves a record, <run_dir>/slurm/health/<job>.<node>.json, from
which the requeue check (trainer/launchers/requeue.py) requeues the job without that node. Nothing here
imports torch until a check runs: the config imports HealthArgs.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Annotated

from trainer.ranges import NOT_NEGATIVE, TIMEOUT_S, Range
from trainer.resilience import outcomes
from trainer.rundir import files, objects
from trainer.rundir.layout import HEALTH_RECORDS

HEALTH_FAILED = outcomes.HEALTH_FAILED.code

__all__ = ["HEALTH_FAILED", "HealthArgs", "HealthError", "NodeCheck"]


@dataclass
class HealthArgs:
    # Run the health check at every start (on every node, before the first step); false skips it all.
    # On by default: it costs well under a second on the CPU and a few seconds on a GPU node, and a
    # bad node found before the first step costs one requeue instead of a crashed or slow run.
    enabled: bool = True
    # A site's own node check, run by `bash -c` on every node (the usual place for a node health
    # check script, e.g. `/etc/nhc/nhc` or `nvidia-smi -q -d ECC | ...`); it must exit 0. Its
    # environment holds HEALTH_NODE, this node's name (Slurm's SLURMD_NODENAME where set). "": none.
    command: str = ""
    # Seconds health.command may run before the node fails the check: a hung command (nvidia-smi on a
    # GPU that fell off the bus is the classic one) fails the node instead of the job waiting on it.
    # 60: site checks take seconds; this leaves room for a slow one.
    command_timeout_s: Annotated[int, TIMEOUT_S] = 60
    # Floor of the all-reduce's bus bandwidth across the allocation, in GB/s (1e9 bytes) as nccl-tests
    # define it: bytes x 2 (n - 1) / n / time, for n ranks. Judged on GPUs only; 0 measures and prints
    # it without judging. The default is 0 because the right floor depends on the fabric (hundreds of
    # GB/s within an NVLink node, tens across InfiniBand, a few over Ethernet): set it to about 80% of
    # what the line `health: all-reduce ...` says on healthy nodes.
    min_busbw_gbps: Annotated[float, Range(0, note=" (GB/s; 0: not judged)")] = 0.0
    # Floor of the run dir's write speed on each node, in MB/s (1e6 bytes): 8 MiB written and
    # fsync'ed to a temporary file there, then removed. 10: every shared filesystem in service
    # writes far faster; below it a checkpoint of a few GB would take minutes, a sign of a degraded
    # mount on that node.
    min_write_mbps: Annotated[float, Range(0, note=" (MB/s; 0: not judged)")] = 10.0
    # Nodes a Slurm job may exclude over its whole life after they failed the check (each one costs
    # a requeue); one more failing node and the job is not requeued, and says so. 2: a bad node or
    # two are routine on a large allocation; more usually means a broken check or a systemic
    # problem (the fabric, the filesystem) that excluding nodes will not fix.
    max_excluded: Annotated[int, NOT_NEGATIVE] = 2


class HealthError(Exception):
    """A node, or the allocation's fabric, failed the health check; the message is one line."""


# What a matmul may differ from float64 on the CPU, as the normwise relative error
# ||C - C_ref||_F / ||C_ref||_F of N(0, 1) inputs of MATMUL_N x MATMUL_N. float32 on a GPU may be
# TF32 (10-bit mantissa; a site may force it with NVIDIA_TF32_OVERRIDE): about 3e-4 measured at this
# size, so 2e-3 allows 7x that. bfloat16 (8 bits): about 3e-3, so 1e-2 allows 3x. A faulty GPU
# (a stuck bit, a bad SM, a corrupted kernel) gives errors of order 1, or NaN.
MATMUL_N = 512
MATMUL_TOLERANCE = {"float32": 2e-3, "bfloat16": 1e-2}
WRITE_BYTES = 8 << 20  # written and fsync'ed into the run dir by each node
# The all-reduce of the ranks: a buffer of this size, once untimed, then ALLREDUCE_ITERS times timed.
ALLREDUCE_BYTES = {"cuda": 64 << 20, "cpu": 4 << 20}
ALLREDUCE_ITERS = 5
GPU_CHECK_TIMEOUT_S = 120  # the child process that runs the GPUs' matmul (starting CUDA on 8 GPUs)
NODE_ENV = "HEALTH_NODE"


@functools.lru_cache(maxsize=1)
def matmul_reference():
    """(a, b, a @ b in float64 on the CPU): the inputs and the reference every GPU is judged against,
    computed once per process however many GPUs it checks."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(MATMUL_N, MATMUL_N, generator=g), torch.randn(MATMUL_N, MATMUL_N, generator=g)
    return a, b, a.double() @ b.double()


def matmul_errors(matmul) -> dict[str, float]:
    """{dtype: normwise relative error} of matmul(a, b, dtype) against float64 on the CPU, for each
    dtype of MATMUL_TOLERANCE; `matmul` returns the product on the CPU."""
    import torch

    a, b, ref = matmul_reference()
    errors = {}
    for name in MATMUL_TOLERANCE:
        dtype = getattr(torch, name)
        got = matmul(a.to(dtype, copy=True), b.to(dtype, copy=True), dtype).double()  # the cached inputs stay
        errors[name] = ((got - ref).norm() / ref.norm()).item()
    return errors


def judge_matmul(device: str, errors: dict[str, float]) -> str | None:
    """What is wrong with a device's matmul errors (matmul_errors), or None."""
    for name, error in errors.items():
        if not error <= MATMUL_TOLERANCE[name]:  # NaN fails too
            return (
                f"a {MATMUL_N}x{MATMUL_N} {name} matmul on {device} differs from the CPU's by {error:.2e} "
                f"(normwise relative error; at most {MATMUL_TOLERANCE[name]:.0e} allowed)"
            )
    return None


def assigned_gpus(environ=os.environ) -> tuple[int, str] | None:
    """(GPUs Slurm (or the site) assigned to this node, the variables that say so), or None if none say."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    on_node = environ.get("SLURM_GPUS_ON_NODE")
    keys = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")
    said = [f"{k}={environ[k]}" for k in keys if k in environ]
    if on_node and on_node.isdigit():
        return int(on_node), ", ".join(said)
    if visible is not None and visible.strip() and visible.strip() != "NoDevFiles":
        return len([d for d in visible.split(",") if d.strip()]), ", ".join(said)
    return None


def judge_visible(seen: int, environ=os.environ) -> str | None:
    """What is wrong when torch sees `seen` GPUs (it sees CUDA) on a node assigned assigned_gpus(), or None."""
    assigned = assigned_gpus(environ)
    if assigned is None or assigned[0] == seen:
        return None
    count, said = assigned
    return f"torch sees {seen} GPU(s) but {count} are assigned ({said}): a GPU is missing or unusable"


def write_speed(folder: str, nbytes: int = WRITE_BYTES) -> float:
    """MB/s (1e6 bytes) of writing `nbytes` and fsync'ing them into a fresh temporary file in `folder`,
    which is removed."""
    chunk = os.urandom(1 << 20)
    fd, path = tempfile.mkstemp(prefix=".health-", dir=folder)
    try:
        started = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, chunk[: min(len(chunk), nbytes - written)])
        os.fsync(fd)
        elapsed = time.perf_counter() - started
    finally:
        os.close(fd)
        os.remove(path)
    return nbytes / 1e6 / max(elapsed, 1e-9)


def run_command(command: str, timeout_s: float, node: str) -> tuple[str | None, float]:
    """(what is wrong with health.command on this node, or None; its seconds)."""
    started = time.perf_counter()
    shown = f"health.command `{command}`"
    try:
        done = subprocess.run(
            ["bash", "-c", command],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            env={**os.environ, NODE_ENV: node},
        )
    except subprocess.TimeoutExpired:
        return f"{shown} did not end within {timeout_s:g} s (health.command_timeout_s)", timeout_s
    elapsed = time.perf_counter() - started
    if done.returncode == 0:
        return None, elapsed
    lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    said = f"{'stderr' if done.stderr.strip() else 'stdout'}'s last line: {lines[-1].strip()}" if lines else "no output"
    how = f"was killed by signal {-done.returncode}" if done.returncode < 0 else f"exited {done.returncode}"
    return f"{shown} {how} ({said})", elapsed


def nearest_folder(path: str) -> str:
    """`path`, or the nearest folder above it that exists (the run dir may not exist yet: the ranks
    make it once the start is accepted)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


@dataclass
class NodeCheck:
    """The outcome on one node: `summary` (one line, what passed with its measurements) or `failure`."""

    node: str
    summary: str = ""
    failure: str = ""

    def line(self) -> str:
        return f"health: {self.node}: {self.failure or self.summary}"


def check_node(args: HealthArgs, run_dir: str, node: str, gpu_check=None) -> NodeCheck:
    """Run this node's checks in order, stopping at the first that fails. `gpu_check`: a function
    returning (GPUs torch sees, {device: matmul errors}) or None without CUDA; by default the child
    process `python -m trainer.resilience.health --gpus`."""
    started = time.perf_counter()
    passed = []
    result = NodeCheck(node)
    gpus = (gpu_check or _gpus_in_child)()
    if gpus is None:
        passed.append("no GPU used (trains on the CPU)")
    else:
        seen, errors = gpus
        problem = judge_visible(seen)
        for device, device_errors in errors.items():
            problem = problem or judge_matmul(device, device_errors)
        if problem:
            result.failure = problem
            return result
        worst = {name: max((e[name] for e in errors.values()), default=0.0) for name in MATMUL_TOLERANCE}
        passed.append(
            f"{seen} GPU(s){' as assigned' if assigned_gpus() else ''}, matmul agrees with the CPU ("
            + ", ".join(f"{name} {error:.1e}" for name, error in worst.items())
            + ")"
        )
    try:  # an s3:// run dir's files are written in this node's staging copy, and uploaded from there
        folder = nearest_folder(objects.staging_dir(run_dir) if objects.is_remote(run_dir) else run_dir)
    except (OSError, objects.StoreError) as e:
        result.failure = f"cannot write to the run dir's staging copy: {e}"
        return result
    try:
        mbps = write_speed(folder)
    except OSError as e:
        result.failure = f"cannot write to the run dir ({folder}): {e.strerror or e}"
        return result
    if mbps < args.min_write_mbps:
        result.failure = (
            f"the run dir ({folder}) takes writes at {mbps:.1f} MB/s (8 MiB with fsync), below "
            f"health.min_write_mbps={args.min_write_mbps:g}"
        )
        return result
    passed.append(f"run dir write {mbps:.0f} MB/s")
    if args.command:
        problem, seconds = run_command(args.command, args.command_timeout_s, node)
        if problem:
            result.failure = problem
            return result
        passed.append(f"health.command passed in {seconds:.2f} s")
    result.summary = f"passed in {time.perf_counter() - started:.2f} s: " + ", ".join(passed)
    return result


def _gpus_in_child() -> tuple[int, dict] | None:
    """(GPUs torch sees, {device: matmul errors}) from a child process, or None without CUDA.
    Raises HealthError when the child fails (a CUDA error on a GPU is a failed check)."""
    import torch

    if not torch.cuda.is_available():  # no context made: the launcher asks only the driver's count
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-m", "trainer.resilience.health", "--gpus"],
            capture_output=True,
            text=True,
            timeout=GPU_CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise HealthError(f"the GPU matmul check did not end within {GPU_CHECK_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()] or ["no output"]
        raise HealthError(f"the GPU matmul check failed with exit code {done.returncode} ({lines[-1].strip()})")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["seen"], report["errors"]


def gpu_report() -> dict:
    """In the child process: every visible GPU's matmul errors (the GPUs' count first)."""
    import torch

    seen = torch.cuda.device_count()
    errors = {}
    for index in range(seen):
        device = torch.device("cuda", index)

        def on_gpu(a, b, dtype, device=device):
            product = a.to(device) @ b.to(device)
            return product.cpu()

        errors[f"GPU {index} ({torch.cuda.get_device_name(index)})"] = matmul_errors(on_gpu)
    return {"seen": seen, "errors": errors}


def record(run_dir: str, job_id: str, node: str, failure: str, max_excluded: int) -> str:
    """Leave this node's failure for the requeue check of job `job_id` (trainer/launchers/requeue.py)."""
    folder = os.path.join(run_dir, *HEALTH_RECORDS)
    if os.path.islink(folder):  # the run dir is shared: a link there is not ours to follow
        os.unlink(folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{job_id}.{node}.json")
    found = {"job": job_id, "node": node, "reason": failure, "max_excluded": max_excluded, "time": time.time()}
    files.write_json(path, found, indent=None)  # a link or FIFO planted at the name is replaced
    return path


def busbw_line(seconds: float, nbytes: int, world: int, backend: str, nodes: int, floor: float) -> tuple[str, bool]:
    """(rank 0's line about one all-reduce of `nbytes` over `world` ranks taking `seconds`, whether
    it failed the floor). Judged on GPUs (nccl) only, and only with a floor above 0."""
    busbw = nbytes * 2 * (world - 1) / world / seconds / 1e9
    what = (
        f"health: all-reduce of {nbytes / 1e6:.1f} MB across {world} ranks on {nodes} node(s) ({backend}): "
        f"{busbw:.2f} GB/s bus bandwidth"
    )
    if backend != "nccl":
        return f"{what} (measured, not judged on the CPU)", False
    if floor <= 0:
        return f"{what} (not judged: health.min_busbw_gbps is 0)", False
    if busbw < floor:
        return f"{what}, below health.min_busbw_gbps={floor:g}: the fabric between these nodes is slow", True
    return f"{what}, floor {floor:g} met", False


def check_allreduce(args: HealthArgs, env, node: str) -> None:
    """In every rank, right after the process group starts: one short timed all-reduce on the default
    group (NCCL on GPUs, gloo on the CPU). Rank 0 prints one line; every rank raises HealthError
    (with that line) below the floor. The time is the slowest rank's mean per all-reduce."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return
    nbytes = ALLREDUCE_BYTES["cuda" if env.device.type == "cuda" else "cpu"]
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=env.device)

    def sync():
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)

    dist.all_reduce(buffer)  # untimed: connections and buffers set up
    sync()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(ALLREDUCE_ITERS):
        dist.all_reduce(buffer)
    sync()
    seconds = torch.tensor([(time.perf_counter() - started) / ALLREDUCE_ITERS], dtype=torch.float64)
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node)
    seconds = seconds.to(env.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    line, failed = busbw_line(seconds.item(), nbytes, world, backend, len(set(nodes)), args.min_busbw_gbps)
    if env.rank == 0 and not failed:
        print(line, flush=True)  # on stdout, as the launcher's line of a node that passed
    if failed:
        raise HealthError(line)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.resilience.health --gpus`: the launcher's child process; prints gpu_report() as JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--gpus"]:
        print(
            "usage: python -m trainer.resilience.health --gpus  (run by trainer.launch on each node)", file=sys.stderr
        )
        return 2
    print(json.dumps(gpu_report()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
