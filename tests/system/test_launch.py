"""The launcher every path uses (python -m trainer.launch): validation first, torchrun in-process,
stop signals sent to the launcher alone (as proctrack/cgroup delivers them), documented exit codes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.outputs import rows
from tests.helpers.run import ROOT, TINY, launch, run_command, wait_for
from trainer.launchers.torchrun import interface_address
from trainer.resilience import signals
from trainer.rundir import layout

pytestmark = pytest.mark.slow  # every test starts the launcher with 2 ranks


def test_bad_input_is_one_line_and_exit_2_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "optim.lr=-1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("error: ") and "optim.lr: is -1.0; it must be positive" in lines[0]
    ), err
    assert not run_dir.exists()


def test_signal_to_the_launcher_alone_saves_exits_0_and_resumes(tmp_path):
    """Under proctrack/cgroup Slurm signals the step's task, here the launcher, and nothing else:
    it must forward the signal to every rank, which save; the exit code is 0 and a restart resumes."""
    run_dir = tmp_path / "run"
    # GPUs assigned by Slurm but no CUDA usable (the local cluster's nodes): said explicitly.
    proc = launch(run_dir, "train.steps=100000", "log.interval=1", extra_env={"CUDA_VISIBLE_DEVICES": "0,1"})
    wait_for(lambda: len(rows(run_dir)) >= 3, 120, "training to start")
    proc.send_signal(signal.SIGUSR1)  # the launcher's pid only: its ranks are in sessions of their own
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    status = layout.read_status(run_dir)
    assert status["state"] == "stopped" and status["steps"] == 100000
    stopped = status["step"]
    assert layout.latest_committed_step(run_dir) == stopped
    assert f"launch: stopped by SIGUSR1 after step {stopped}; the checkpoint is saved" in err
    assert re.search(
        r"2 rank\(s\) on the CPU with gloo: GPUs 0,1 are assigned \(CUDA_VISIBLE_DEVICES\) but torch .* "
        r"finds no usable CUDA device",
        err,
    ), err
    # The health check, on stdout: the node's line (no GPU judged: torch sees none), rank 0's all-reduce.
    assert re.search(
        r"^health: \S+: passed in [\d.]+ s: no GPU used \(trains on the CPU\), run dir write \d+ MB/s$", out, re.M
    ), out
    assert re.search(
        r"^health: all-reduce of 4\.2 MB across 2 ranks on 1 node\(s\) \(gloo\): [\d.]+ GB/s bus bandwidth "
        r"\(measured, not judged on the CPU\)$",
        out,
        re.M,
    ), out
    assert "health:" not in err
    # A restart resumes where it stopped and finishes; every step is logged once.
    proc = launch(run_dir, f"train.steps={stopped + 3}", "log.interval=1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert f"at step {stopped}" in out + err
    steps = [r["step"] for r in rows(run_dir)]
    assert steps == list(range(1, stopped + 4))
    assert layout.read_status(run_dir)["state"] == "finished"


# A real SIGTERM, sent by one rank to itself the moment its first evaluation ends.
SIGNAL_DURING_EVAL = """
import os, runpy, signal
import trainer.train

evaluate = trainer.train.evaluate

def evaluate_then_signal(*args):
    result = evaluate(*args)
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGTERM)
    return result

trainer.train.evaluate = evaluate_then_signal
runpy.run_module("trainer", run_name="__main__")
"""


def test_a_signal_during_an_evaluation_stops_every_rank_at_that_step(tmp_path):
    """At a logged step the stop flag travels in the loss's all-reduce, before the evaluation: a
    signal that comes during it must still stop the run at that step, not one step later."""
    script = tmp_path / "signal_during_eval.py"
    script.write_text(SIGNAL_DURING_EVAL)
    run_dir = tmp_path / "run"
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        "--config",
        str(ROOT / "configs/default.yaml"),
        f"run_dir={run_dir}",
        *TINY,
        "train.steps=10",
        "log.interval=1",
        "eval.interval=3",
        "eval.batches=1",
    ]
    proc = run_command(cmd, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped by signal after step 3; the checkpoint is saved" in proc.stdout + proc.stderr
    assert layout.read_status(run_dir)["step"] == 3 and layout.latest_committed_step(run_dir) == 3
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3]


# Run at each rank's interpreter start (a sitecustomize on PYTHONPATH): rank 1 exits 1 at once, while
# rank 0 is still starting (a sleep, with Python's default SIGTERM action) until torchrun stops it.
RANK_1_FAILS = """
import os, time
if os.environ.get("RANK") == "1":
    print("rank 1 fails on purpose", flush=True)
    os._exit(1)
if os.environ.get("RANK") == "0":
    time.sleep(120)
"""


def test_a_failing_rank_is_one_launcher_line_and_exit_1(tmp_path):
    """Rank 1 fails; rank 0, still starting, is then stopped by torchrun (SIGTERM, -15). The lines name
    rank 1 and its own exit code, not rank 0, the first rank reaped: once for the restart
    (launch.max_restarts=1), once when the restarts ran out."""
    (tmp_path / "sitecustomize.py").write_text(RANK_1_FAILS)
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "launch.max_restarts=1", extra_env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert re.search(r"^launch: rank \d failed with exit code 1 \(see its error above\)$", err, re.M), err[-2000:]
    assert re.search(
        r"^launch: rank 1 on \S+ failed with exit code 1 \(see its error above\); restart 1 of 1: every rank "
        r"starts again from the start \(no checkpoint yet\)$",
        err,
        re.M,
    ), err[-2000:]
    assert err.strip().splitlines()[-1] == "launch: rank 1 failed with exit code 1 (see its error above)", err[-2000:]


def test_bad_input_found_by_the_ranks_stays_exit_2_when_the_launcher_is_then_signalled(tmp_path):
    """Under Slurm, `srun --kill-on-bad-exit=1` terminates every node's task as soon as the first one
    exits 2: a launcher whose own ranks just stopped on the same bad input gets SIGTERM while it
    maps their outcome or exits. It still exits 2, so the requeue check does not requeue bad input."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(["sleep", "300"])  # a live run holds the run dir: the ranks refuse it (exit 2)
    try:
        lease = {"host": socket.gethostname(), "pid": holder.pid, "slurm_job": "", "token": "x", "renewed": time.time()}
        (run_dir / "lease.json").write_text(json.dumps(lease))
        proc = launch(run_dir)
        err = []
        for line in proc.stderr:  # signal the launcher the moment its rank says what is wrong
            err.append(line)
            if line.startswith("error: "):
                proc.send_signal(signal.SIGTERM)
                break
        err += proc.stderr.readlines()
        proc.wait(timeout=120)
    finally:
        holder.kill()
    assert proc.returncode == 2, "".join(err)[-3000:]
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and f"run_dir {run_dir} is in use by process {holder.pid}" in errors[0], "".join(err)


def test_compose_grace_period_is_the_launchers():
    """One source for the grace time: compose's stop_grace_period is signals.DEFAULT_GRACE_S."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    periods = {s.get("stop_grace_period") for s in compose["services"].values()}
    assert periods == {f"{signals.DEFAULT_GRACE_S}s"}
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in (ROOT / "compose.yaml").read_text()


def test_interface_address():
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(OSError, match="'nosuch0'"):
        interface_address("nosuch0")


def test_more_ranks_than_cpu_cores_warn_and_train(tmp_path):
    """2 ranks on 1 CPU core (the launcher's affinity, as a Slurm cpuset gives it): it was refused
    (`this machine has 1 CPU cores; use NPROC=1 or fewer`); torchrun and gloo run it, so the
    launcher warns in one line and trains."""
    from tests.helpers.run import launch_command

    run_dir = tmp_path / "run"
    core = min(os.sched_getaffinity(0))
    proc = run_command(
        launch_command(run_dir, "train.steps=2"), timeout=300, preexec_fn=lambda: os.sched_setaffinity(0, {core})
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launch: warning: 2 processes on 1 CPU core(s) (no GPU found): the ranks share the cores" in proc.stderr
    assert [r["step"] for r in rows(run_dir)] == [1, 2]
