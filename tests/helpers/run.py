"""Run the real trainer in real processes (torchrun, gloo, CPU), the launcher and the commands, and
wait for what they do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def env(gpu: bool = False) -> dict:
    """The trainer's environment; the CPU (gloo) unless `gpu`, also on a machine with GPUs."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if not gpu:
        e["CUDA_VISIBLE_DEVICES"] = ""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(name, None)
    # A command typed at a shell, not inside make test's make: a make it starts would print
    # "make[1]: Entering directory ..." into what the command prints (a manifest, a config)
    for name in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS"):
        e.pop(name, None)
    return e


def run_command(
    cmd: list, timeout: float | None = 120, extra_env: dict | None = None, gpu: bool = False, **kw
) -> subprocess.CompletedProcess:
    """`cmd` in the repository with the trainer's environment (env(gpu), then `extra_env`), to its end;
    its output captured as text. `kw`: more of subprocess.run's arguments (umask)."""
    return subprocess.run(
        cmd, cwd=ROOT, env={**env(gpu), **(extra_env or {})}, capture_output=True, text=True, timeout=timeout, **kw
    )


def python(*args, timeout: float | None = 120, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`python *args` (a `-m trainer.x ...` or a `-c` script) as run_command runs it."""
    return run_command([PYTHON, *map(str, args)], timeout=timeout, extra_env=extra_env)


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
    proc = run_command(command(run_dir, nproc, overrides, config, module), timeout=timeout, gpu=gpu)
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


def launch_command(run_dir, *overrides: str, options=(), config: str = str(ROOT / "configs" / "default.yaml")) -> list:
    """`python -m trainer.launch` with 2 ranks (what make run does) on the tiny run: `options` for the
    launcher, `overrides` for the trainer."""
    return [
        PYTHON,
        "-m",
        "trainer.launch",
        "--nproc-per-node=2",
        *options,
        "--config",
        config,
        f"run_dir={run_dir}",
        *TINY,
        *overrides,
    ]


def launch(run_dir, *overrides: str, options=(), extra_env: dict | None = None, **kw) -> subprocess.Popen:
    """Start launch_command's launcher; its stdout and stderr are pipes. `kw`: more of Popen's arguments."""
    return subprocess.Popen(
        launch_command(run_dir, *overrides, options=options),
        cwd=ROOT,
        env={**env(), **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def launched(
    run_dir,
    *overrides: str,
    config: str = str(ROOT / "configs" / "default.yaml"),
    extra_env: dict | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess:
    """launch_command's launcher to its end; its output captured as text."""
    return run_command(launch_command(run_dir, *overrides, config=config), timeout=timeout, extra_env=extra_env)


def wait_for(predicate, timeout: float = 120, what: str = "condition", interval: float = 0.02):
    """The first true value of `predicate()`, asked every `interval` s; fails the test after `timeout` s."""
    deadline = time.time() + timeout
    while not (value := predicate()):
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return value


def kill_group(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def export_hf(run_dir, out, *options: str, umask: int = -1) -> subprocess.CompletedProcess:
    """`python -m trainer.export RUN_DIR --format hf --out OUT *options` under `umask` (-1: this
    process's); fails the test unless it exits 0."""
    proc = run_command(
        [PYTHON, "-m", "trainer.export", str(run_dir), "--format", "hf", "--out", str(out), *options],
        timeout=300,
        umask=umask,
    )
    assert proc.returncode == 0, proc.stderr
    return proc
