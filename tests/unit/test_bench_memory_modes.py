"""#44 item 4: bench/run.py's memory_modes measurement, its arithmetic and what it reports. The
launches are replaced by one that writes each rank's peak as bench/memory_modes.py does (the real
runs take minutes each; bench/results/ holds a real one): the modes run interleaved, every ratio is
one value per rank and round, its interval from them, the estimate's terms beside them, and a launch
that fails ends the series with the rounds that finished."""

from __future__ import annotations

import json
import types

import pytest

from bench import memory_modes
from bench import run as bench

# each mode's peak RSS in GB on ranks 0 and 1 (rank 1 a little higher), and the estimate's total
PEAK = {"last": 3.0, "every": 2.5, "every+full": 2.0, "every+selective": 2.2}


def _ctx(tmp_path, rounds: int):
    args = types.SimpleNamespace(nproc=2, modes_size="125m", modes_seq_len=256, modes_rounds=rounds)
    return types.SimpleNamespace(args=args, scratch=tmp_path, budget=bench.Budget(10_000))


def _fake_launch(ran: list, fail_at: int | None = None):
    def launch(nproc, argv, log, timeout, watch=None):
        mode = next(name for name, overrides in memory_modes.MODES if argv[-len(overrides) :] == overrides)
        ran.append(mode)
        if fail_at is not None and len(ran) == fail_at:
            raise bench.Failed("timed out after 1s")
        out = argv[argv.index("--out") + 1]
        for rank in range(nproc):
            result = {"peak_rss": (PEAK[mode] + 0.1 * rank) * 1e9}
            if rank == 0:
                estimate = {"gradients": 1e8, "activations": 2e8, "total": PEAK[mode] * 1.05e9, "notes": {}}
                result["estimate"] = estimate
            with open(f"{out}.rank{rank}", "w") as f:
                json.dump(result, f)

    return launch


def test_the_ratios_are_one_value_per_rank_and_round_with_the_estimate_beside(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(bench, "launch", _fake_launch(ran))
    figures, notes, details = bench.memory_modes(_ctx(tmp_path, 2))
    names = [name for name, _ in memory_modes.MODES]
    assert ran == names + names[::-1]  # interleaved: the order turns every round
    every = figures["every_vs_last_peak_rss"]
    assert every["rounds"] == pytest.approx([2.5 / 3.0, 2.6 / 3.1] * 2)
    assert every["ci95"] is not None and every["median"] == pytest.approx((2.5 / 3.0 + 2.6 / 3.1) / 2)
    assert figures["selective_ac_vs_none_peak_rss"]["rounds"][0] == pytest.approx(2.2 / 2.5)
    assert "2 rounds x 2 ranks" in notes["full_ac_vs_none_peak_rss"]
    assert "the estimate's totals 2.100 / 2.625 GB (0.800" in notes["full_ac_vs_none_peak_rss"], notes
    assert details["memory_modes"]["peak_rss_by_round_and_rank"]["last"] == [[3e9, 3.1e9]] * 2


def test_a_failed_launch_keeps_the_rounds_that_finished(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(bench, "launch", _fake_launch(ran, fail_at=6))  # in the second round
    figures, notes, _ = bench.memory_modes(_ctx(tmp_path, 3))
    assert len(ran) == 6
    assert figures["every_vs_last_peak_rss"]["rounds"] == pytest.approx([2.5 / 3.0, 2.6 / 3.1])
    assert "stopped: timed out after 1s" in notes["every_vs_last_peak_rss"]
