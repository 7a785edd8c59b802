"""Helpers to run the real trainer in real processes (torchrun, gloo, CPU) and read what it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# Small and fast: the tiny transformer on generated data; B=12 divides over 1, 2, 3 and 4 ranks.
TINY = [
    "model.seq_len=32",
    "train.global_batch_size=12",
    "train.steps=6",
    "log.interval=1",
    "log.progress=false",
    "optim.warmup_steps=2",
    "checkpoint.interval=0",
]

# The in-process tests run on one thread, as the processes they start do (env() below): their
# tensors are small, and on a loaded 2-core machine two threads of each op wait for each other.
torch.set_num_threads(1)


def env(gpu: bool = False) -> dict:
    """The trainer's environment; the CPU (gloo) unless `gpu`, also on a machine with GPUs."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if not gpu:
        e["CUDA_VISIBLE_DEVICES"] = ""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(name, None)
    return e


def command(run_dir, nproc: int, overrides, config: str = "configs/default.yaml", module: str = "trainer") -> list[str]:
    args = ["-m", module, "--config", str(ROOT / config), f"run_dir={run_dir}", *overrides]
    if nproc == 1:
        return [PYTHON, *args]
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *args]


def train(
    run_dir,
    nproc: int = 1,
    *overrides,
    config: str = "configs/default.yaml",
    expect: int = 0,
    timeout: float = 300,
    gpu: bool = False,
    module: str = "trainer",
) -> subprocess.CompletedProcess:
    """Run the trainer to the end; fail the test with its output if the exit code is not `expect`.
    `module`: what `python -m` runs (a test's own entry point into the trainer)."""
    proc = subprocess.run(
        command(run_dir, nproc, overrides, config, module),
        cwd=ROOT,
        env=env(gpu),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != expect:
        pytest.fail(
            f"trainer exited {proc.returncode}, expected {expect}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def start(run_dir, nproc: int, *overrides, config: str = "configs/default.yaml") -> subprocess.Popen:
    """Start the trainer in its own process group (so the whole job can be signalled or killed)."""
    return subprocess.Popen(
        command(run_dir, nproc, overrides, config),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(predicate, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def kill_group(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def rows(run_dir) -> list[dict]:
    """Training rows of metrics.jsonl (evaluation rows have no 'loss')."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def losses(run_dir) -> dict[int, float]:
    """Loss by step; a step logged twice (redone after a crash) keeps its last value."""
    return {r["step"]: r["loss"] for r in rows(run_dir)}


def weights(run_dir, step: int | None = None) -> dict[str, torch.Tensor]:
    """The consolidated model weights of a run's checkpoint, through the export tool's code."""
    from trainer.export import consolidate

    return consolidate(str(run_dir), step)[0]


def assert_same_weights(a: dict, b: dict, exact: bool = False, atol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), f"{key} differs"
        else:
            torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def assert_same_losses(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), f"steps differ: {sorted(a)} vs {sorted(b)}"
    for step in a:
        assert abs(a[step] - b[step]) <= rtol * abs(b[step]) + 1e-6, f"step {step}: loss {a[step]} vs {b[step]}"
