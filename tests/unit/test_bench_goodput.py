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


def test_a_node_deaths_parts_run_from_the_heartbeat_silence_through_slurms_requeue():
    start = {**START, "launcher": 125.0, "rendezvous": 127.0}
    start.pop("stopped")
    start.update(imported=130.0, process_group=130.5, load_start=131.5, loaded=132.0)
    rows = [
        {"step": 10, "loss": 2.0, "time": 99.5},
        {"event": "node_lost", "step": 10, "nodes": ["n3"], "node": "n1", "time": 110.5},  # heartbeat silence
        {"event": "resume", "step": 10, "world_size": 3, "start": start, "time": 132.1},
        {"step": 11, "loss": 1.9, "time": 133.0},
    ]
    event = {"caused": 100.0, "down": 111.0, "requeued": 113.0, "released": 115.0, "running": 124.0}
    r = goodput.recovery(rows, event)
    assert r["parts"] == pytest.approx(
        {
            "detection": 10.5,
            "node_fail": 0.5,
            "requeue": 2.0,
            "held": 2.0,
            "schedule": 9.0,
            "batch_and_srun": 1.0,
            "launcher_and_rendezvous": 2.0,
            "start_up": 3.0,
            "process_group": 0.5,
            "build": 1.0,
            "load": 0.5,
            "first_step": 1.0,
        }
    )
    assert r["total_s"] == pytest.approx(33.0 - 2.0) == pytest.approx(sum(r["parts"].values()) - 2.0)
    assert r["detection_to_first_step_s"] == pytest.approx(133.0 - 110.5 - 2.0)
    assert r["down_s"] == pytest.approx(11.0) and r["resumed_at"] == 10
    # Slurm ended the job before any survivor named the node: detection is the requeue, nothing before it
    r = goodput.recovery([row for row in rows if row.get("event") != "node_lost"], event)
    assert r["parts"]["detection"] == pytest.approx(13.0)
    assert r["parts"]["node_fail"] == r["parts"]["requeue"] == 0.0


def test_the_llama3_estimate_takes_a_node_deaths_recovery_also_with_real_slurms_timeout():
    death = {"name": "node_death", "total_s": 31.0, "down_s": 11.0, "parts": {"detection": 10.5}}
    crash = {"name": "crash", "total_s": 7.0, "parts": {"detection": 0.1, "exit": 0.3}}
    for e in (death, crash):
        e.update(detection_to_first_step_s=5.0, goal_s=1.0)
    disturbed = {"events": [crash, death], "save_s": 0.1, "step_s": 0.2, "steps_redone": 5}
    result = {"nodes": 4, "steps": 60, "timeout_s": 10, "rounds": [{"disturbed": disturbed, "goodput": 0.3}]}
    s = goodput.summarise(result)
    assert s["total_s"]["node_death"] == [31.0] and s["node_down_s"] == [11.0]
    assert s["restart_vs_goal"] == [5.0]  # the crash only: a node death is no restart in the allocation
    assert s["llama3"] == [pytest.approx(goodput.at_scale(7.0, 0.1, 0.2)["goodput"])]
    assert s["llama3_node_death"] == [pytest.approx(goodput.at_scale(31.0, 0.1, 0.2)["goodput"])]
    assert s["llama3_node_death_real_slurm"] == [pytest.approx(goodput.at_scale(31.0 + 290, 0.1, 0.2)["goodput"])]


def test_a_recovery_is_waited_for_until_a_step_after_the_resume_is_logged():
    """`python -m bench.goodput --rounds 3` crashed (StopIteration in `recovery`): the wait took the rows
    of steps 13 and 14, logged after the preemption was caused but before the run stopped, for the
    first step after the resume."""
    rows = [
        {"step": 12, "loss": 3.0, "time": 100.0},
        {"step": 13, "loss": 2.9, "time": 100.8},  # caused at 100.2: the run goes on to its stop
        {"step": 14, "loss": 2.8, "time": 101.4},
        {"event": "resume", "step": 14, "time": 110.0, "start": {}},
    ]
    assert not goodput.recovered(rows, caused=100.2)
    rows.append({"step": 15, "loss": 2.7, "time": 111.3})
    assert goodput.recovered(rows, caused=100.2)
    assert not goodput.recovered(rows[:3], caused=100.2)  # no resume yet
