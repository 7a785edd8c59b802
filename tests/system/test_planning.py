"""The system tier of tests/unit/test_planning.py, whose docstring says what both halves test."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers.run import ROOT, python


def run_check(*args) -> subprocess.CompletedProcess:
    return python("-m", "trainer.check", *map(str, args), timeout=300)


@pytest.mark.slow
def test_planning_an_8_gpu_node_from_a_laptop_warns_about_what_only_the_target_has():
    """The report: `make check CONFIG=configs/llama-8b.yaml NPROC=8 GPU_MEM_GB=80` stopped on the
    machine's 2 cores and, before that, on the data file only the cluster has."""
    proc = run_check("--config", ROOT / "configs" / "llama-8b.yaml", "--nproc", 8, "--gpu-mem-gb", 80)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert (
        lines[0]
        == "config OK: "
        + str(ROOT / "configs" / "llama-8b.yaml")
        + ": transformer on 8 processes (NPROC=8 x NODES=1), run_dir /shared/runs/llama-8b"
    )
    if len(os.sched_getaffinity(0)) < 8:  # more processes than cores, no GPU: a warning, not a refusal (#42 item 7)
        assert any(line.startswith("warning: 8 processes on ") and "CPU core(s)" in line for line in lines), proc.stdout
    assert any(
        line.startswith("warning: ") and "data.path: token file /shared/data/tokens/train.bin does not exist" in line
        for line in lines
    ), proc.stdout
    memory = [line for line in lines if line.startswith("memory: about ")]
    assert memory and "per GPU estimated for NPROC=8 x NODES=1, of the 80.0 GB of GPU_MEM_GB=80" in memory[0], (
        proc.stdout
    )


@pytest.mark.slow  # three interpreters of trainer.check
def test_without_a_target_the_machine_is_the_target():
    proc = run_check("--config", ROOT / "configs" / "default.yaml", "--nproc", 2, "run_dir=/nonexistent/x/y")
    assert proc.returncode == 0, proc.stderr
    assert (
        "memory: about " in proc.stdout and "per process estimated on the CPU" in proc.stdout
    )  # printed nothing before
    proc = run_check("--config", ROOT / "configs" / "default.yaml", "--nproc", 64, "train.global_batch_size=64")
    # more processes than cores is a warning on a machine without GPUs (#42 item 7); its memory still refuses 64
    assert proc.returncode == 2 and "for 64 rank(s), but this machine has" in proc.stderr, proc.stderr
