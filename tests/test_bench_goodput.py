"""bench/goodput.py's arithmetic on a fixed metrics file: a recovery's parts, the steps redone, the
estimate at Llama 3's failure rate (pure functions; nothing runs)."""

import json
import math

import pytest

from bench import goodput

# A run killed at t=100.0 (rank 2), restarted in the allocation from step 5, and its moments.
START = {
    "launcher": 50.0,
    "stopped": 100.5,
    "rendezvous": 101.0,
    "process": 101.1,
    "imported": 103.0,
    "process_group": 103.2,
    "load_start": 103.5,
    "loaded": 104.0,
}
ROWS = [
    {"step": 5, "loss": 2.0, "time": 99.0},
    {"event": "restart", "step": 5, "rank": 2, "time": 100.25},
    {"event": "restart", "step": 5, "rank": 0, "time": 100.4},  # another node's launcher, later
    {"event": "resume", "step": 5, "world_size": 4, "start": START, "time": 104.1},
    {"step": 6, "loss": 1.9, "time": 104.75},
]


def test_a_restarts_parts_add_up_to_its_total():
    r = goodput.recovery(ROWS, {"caused": 100.0})
    assert r["parts"] == pytest.approx(
        {
            "detection": 0.25,
            "exit": 0.25,
            "rendezvous": 0.5,
            "start_up": 2.0,
            "process_group": 0.2,
            "build": 0.3,
            "load": 0.5,
            "first_step": 0.75,
        }
    )
    assert r["total_s"] == pytest.approx(4.75) == pytest.approx(sum(r["parts"].values()))
    assert r["detection_to_first_step_s"] == pytest.approx(4.5)
    assert r["goal_s"] == pytest.approx(3 * 0.5 + 0.5 + 0.2)
    assert r["resumed_at"] == 5


def test_a_preemptions_parts_leave_the_hold_out_of_its_total():
    start = {**START, "launcher": 110.0, "rendezvous": 112.0}
    start.pop("stopped")
    start.update(imported=114.0, process_group=114.2, load_start=114.5, loaded=115.0)
    rows = [
        {"step": 7, "loss": 2.0, "time": 100.5},
        {"event": "resume", "step": 7, "world_size": 4, "start": start, "time": 115.1},
        {"step": 8, "loss": 1.9, "time": 115.5},
    ]
    event = {"caused": 100.0, "saved": 101.0, "requeued": 102.0, "released": 104.0, "running": 109.0}
    r = goodput.recovery(rows, event)
    assert r["parts"] == pytest.approx(
        {
            "stop_and_save": 1.0,
            "requeue": 1.0,
            "held": 2.0,
            "schedule": 5.0,
            "batch_and_srun": 1.0,
            "launcher_and_rendezvous": 2.0,
            "start_up": 2.0,
            "process_group": 0.2,
            "build": 0.3,
            "load": 0.5,
            "first_step": 0.5,
        }
    )
    assert r["total_s"] == pytest.approx(15.5 - 2.0)
    assert r["detection_to_first_step_s"] == pytest.approx(115.5 - 109.0)


def test_steps_redone_count_the_rows_logged_twice(tmp_path):
    rows = lambda steps: "".join(json.dumps({"step": s, "loss": 1.0, "time": 0.0}) + "\n" for s in steps)
    (tmp_path / "metrics.jsonl").write_text(rows(range(1, 21)) + '{"event": "resume", "step": 5, "time": 0}\n')
    (tmp_path / "metrics.superseded.jsonl").write_text(rows([6, 7, 8]) + rows([11]))
    assert goodput.steps_redone(tmp_path) == 4


def test_goodput_at_llama3s_rate_follows_the_young_daly_formula():
    est = goodput.at_scale(recovery_s=60.0, save_s=10.0, step_s=2.0, gpus=1024)
    mtbf = 54 * 86400 * 16384 / 466 / 1024  # 44.5 hours
    tau = math.sqrt(2 * 10.0 * mtbf)
    assert est["mtbf_s"] == pytest.approx(mtbf) and est["interval_s"] == pytest.approx(tau)
    assert est["interval_steps"] == round(tau / 2.0)
    assert est["goodput"] == pytest.approx((1 - 10.0 / tau) * (1 - (tau / 2 + 60.0) / mtbf))
    assert 0.98 < est["goodput"] < 0.99
