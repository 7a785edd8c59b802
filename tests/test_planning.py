"""Planning a run for a GPU cluster from a machine without one: make check with GPU_MEM_GB."""

from __future__ import annotations

import subprocess

import pytest

from conftest import ROOT, python
from trainer import check, memory
from trainer.config import load


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
    assert any(line.startswith("warning: NPROC=8 processes but this machine has") for line in lines), proc.stdout
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
    proc = run_check("--config", ROOT / "configs" / "default.yaml", "--nproc", 64)
    assert proc.returncode == 2 and "NPROC=64 processes but this machine has" in proc.stderr


def test_an_estimate_with_less_than_10_percent_headroom_warns():
    cfg = load(str(ROOT / "configs" / "default.yaml"))
    need = memory.estimate(cfg, 2, cfg.train.global_batch_size // 2, 2, gpu=True).total
    line = check.gpu_preflight(cfg, 2, 2, 1, str(need * 1.05 / 1e9))
    assert "warning: less than 10% headroom" in line
    assert "headroom" not in check.gpu_preflight(cfg, 2, 2, 1, str(need * 1.5 / 1e9))
