"""Issue #33 item 5: bench/run.py's GPU runs (--only gpu). No GPU here: torch.cuda and the runs are
mocked; the micro-batch comes from the memory estimate, a pure computation."""

from __future__ import annotations

import json
import types

import pytest

from bench import run as bench

H100, H200 = 81559 * 2**20, 143771 * 2**20  # total_memory as torch reports them


def test_the_micro_batch_is_the_largest_the_estimate_fits_in_85_percent_of_the_gpu():
    # Measured: 8 sequences compiled peak at 36.8 GB on an H100, 16 at 60.0 GB on an H200; eager more.
    assert bench.gpu_micro_batch(H100, 1) == 8
    assert bench.gpu_micro_batch(H200, 1) == 16
    assert bench.gpu_micro_batch(20 * 10**9, 1) == 1  # nothing fits: the least


@pytest.fixture
def one_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(total_memory=H100))


def test_a_run_that_finished_is_reported_when_the_next_does_not_fit_the_budget(one_gpu, monkeypatch, tmp_path):
    """`bench/run.py --only gpu --budget 220` reported nothing although the compiled run had finished."""
    launched = []

    def launch(nproc, args, log, timeout):
        label = "eager" if "parallel.compile=false" in args else "compiled"
        launched.append((label, next(a for a in args if a.startswith("train.micro_batch_size="))))
        if label == "eager":
            raise bench.Failed("skipped: 70s of the time budget left, the eager GPU run needs about 150s")
        run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run_dir="))
        rows = [{"step": 5 * i, "tokens_per_s": 1e5, "mfu": 0.5 + i / 100, "peak_mem_gb": 36.8} for i in range(1, 5)]
        (tmp_path / "gpu").mkdir(exist_ok=True)
        (tmp_path / "gpu" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert run_dir == str(tmp_path / "gpu")
        return [], ""

    monkeypatch.setattr(bench, "launch", launch)
    ctx = types.SimpleNamespace(scratch=tmp_path, args=types.SimpleNamespace(gpu_steps=20), budget=bench.Budget(1000))
    values, notes, _ = bench.gpu(ctx)
    assert launched == [("compiled", "train.micro_batch_size=8"), ("eager", "train.micro_batch_size=8")]
    assert values["gpu_mfu"] is not None and values["gpu_peak_mem_gb"] is not None
    assert values["gpu_mfu_eager"] is None and "the eager run: skipped" in notes["gpu_mfu_eager"]
    assert "8 sequences per GPU" in notes["gpu_mfu"]
    assert not (tmp_path / "gpu").exists()
