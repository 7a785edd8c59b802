"""bench/checkpoint_io.py runs to its end: its unchecked load leaves the checkpoint whole (it once
moved the .xxh3 records aside, which the manifest reports as missing, and the rounds after it never
ran), and every round of it, the extra checked/unchecked pairs and the async rounds are measured."""

from __future__ import annotations

import json

import pytest

from tests.helpers.run import TORCHRUN, run_command


@pytest.mark.slow
def test_the_checkpoint_io_bench_completes_all_its_rounds_on_the_tiny_model(tmp_path):
    out = tmp_path / "result.json"
    args = ["--dir", tmp_path / "scratch", "--out", out, "--size", "tiny", "--step-size", "tiny", "--rounds", "1"]
    args += ["--async-rounds", "1", "--checksum-pairs", "1", "--no-system-drop"]
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "bench.checkpoint_io", *map(str, args)]
    proc = run_command(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 1 and len(result["checksum_pairs"]) == 1 and len(result["async_rounds"]) == 1
    loads = ("dcp_load_s", "unverified_load_s", "dcp_load_cached_s", "unverified_load_cached_s", "stock_load_s")
    assert all(result["rounds"][0][k] > 0 for k in loads)
    assert result["async_rounds"][0]["async_in_flight_s"] > 0
