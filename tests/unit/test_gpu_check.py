"""Issue #33: `make gpu-check` (bench/gpu_check.py), its planning and reporting on the CPU; the GPU
steps are mocked (no GPU here)."""

from __future__ import annotations

import json
import re

import pytest

from bench import gpu_check


def test_the_dry_run_lists_every_step_in_a_time_box_within_8_minutes(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    names = [s.name for s in gpu_check.plan(gpu_check.ROOT)]
    for name in (
        "launch",
        "resume",
        "generate",
        "evaluate",
        "metrics",
        "tests/system/test_gpu.py",
        "memory calibration",
    ):
        assert name in names
    assert "activation checkpointing, bf16, compiled" in names
    assert "memory modes: grad_sync and activation checkpointing" in names  # bf16 eager, full and selective among them
    assert "1b MFU, compiled and eager" in names
    boxes = [int(m[1]) for m in re.finditer(r"^ +(\d+) s  (?!in all)", out, re.M)]
    total = int(re.search(r"^ +(\d+) s  in all \(at most 480 s\)", out, re.M)[1])
    assert len(boxes) == len(names) and sum(boxes) == total <= 480, out


def test_without_a_gpu_it_says_so_in_one_line_and_fails(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "no GPU here" in err


def test_a_step_that_times_out_is_reported_and_the_others_still_run(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "torch": "2.11.0+cu130", "python": "3.12.3"}
    monkeypatch.setattr(gpu_check, "machine", lambda: {**info, "commit": "92410ca", "date": "2026-11-26 21:00 UTC"})
    ran = []

    def run_step(step, env):
        ran.append(step.name)
        outcome = f"timed out after {step.timeout_s} s" if step.name == "tests/system/test_gpu.py" else "passed"
        return {"name": step.name, "command": "...", "timeout_s": step.timeout_s, "outcome": outcome, "seconds": 1.0}

    monkeypatch.setattr(gpu_check, "run_step", lambda step, env: {**run_step(step, env), "output_tail": "tail"})
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    assert ran == [s.name for s in gpu_check.plan(tmp_path)]
    (md,) = tmp_path.glob("*-h100-gpu-check.md")
    text = md.read_text()
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130" in text and "commit 92410ca" in text
    assert "| tests/system/test_gpu.py | timed out after 130 s |" in text
    steps = json.loads(md.with_suffix(".json").read_text())["steps"]
    assert [s["outcome"] == "passed" for s in steps].count(False) == 1
    assert "9 of 10 steps passed" in capsys.readouterr().out


def test_the_memory_modes_lines_say_memory_step_time_and_the_estimates_error():
    """#44 item 4: the GPU comparison's result of one mode from its metrics rows (peak_mem_gb is
    max_memory_allocated on a GPU; the first row's step time is warm-up), and its line beside the
    first mode's. The GPU figures themselves wait for a GPU."""
    from bench.memory_modes import MODES, gpu_line, say

    assert [name for name, _ in MODES] == ["last", "every", "every+full", "every+selective"]
    rows = [{"step": 1, "peak_mem_gb": 9.0, "step_time_s": 5.0}]
    rows += [{"step": s, "peak_mem_gb": 10.0, "step_time_s": t} for s, t in ((2, 0.30), (3, 0.32), (4, 0.31))]
    base = gpu_line("every", rows, 10.5e9)
    assert base == {
        "mode": "every",
        "measured": 10.0e9,
        "estimate": 10.5e9,
        "error": pytest.approx(0.05),
        "within_tolerance": True,
        "step_time_s": 0.31,
    }
    assert say(base, None) == ("every: max_memory_allocated 10.00 GB, estimate 10.50 GB (+5.0%), 0.310 s a step")
    full = gpu_line("every+full", [{**r, "peak_mem_gb": 4.0, "step_time_s": 0.41} for r in rows], 3.5e9)
    assert not full["within_tolerance"]
    assert say(full, base) == (
        "every+full: max_memory_allocated 4.00 GB, estimate 3.50 GB (-12.5%, outside +-10%), 0.410 s a step "
        "(0.40x the memory, 1.32x the step time of every)"
    )
