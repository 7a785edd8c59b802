"""python -m trainer.metrics: a summary per run and a plot of several runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import python
from trainer import metrics


def _write(run_dir, rows, superseded=()):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if superseded:
        (run_dir / "metrics.superseded.jsonl").write_text("".join(json.dumps(r) + "\n" for r in superseded))


def _run(tmp_path):
    """Steps 1-4 at one second each, a crash after step 5 (its row superseded), 30 s down, resumed
    from step 4; an eval at 4 and 6."""
    rows = [{"step": s, "loss": 5.0 - s * 0.5, "samples_per_s": 100.0 + s, "time": 1000.0 + s} for s in range(1, 5)]
    rows.append({"step": 4, "eval_loss": 3.5, "time": 1004.5})
    rows.append({"event": "resume", "step": 4, "world_size": 2, "checkpoint": "x", "time": 1035.0})
    rows += [{"step": s, "loss": 5.0 - s * 0.5 - 0.1, "samples_per_s": 90.0, "time": 1036.0 + s} for s in (5, 6)]
    rows.append({"step": 6, "eval_loss": 2.25, "eval_accuracy": 0.5, "time": 1043.0})
    _write(tmp_path / "a", rows, superseded=[{"step": 5, "loss": 2.6, "samples_per_s": 99.0, "time": 1005.0}])
    _write(tmp_path / "b", [{"step": s, "loss": 4.0 / s, "samples_per_s": 50.0, "time": 2000.0 + s} for s in (1, 2, 3)])
    return tmp_path / "a", tmp_path / "b"


def test_the_summary_matches_the_file(tmp_path):
    a, b = _run(tmp_path)
    s = metrics.summary(str(a))
    assert s["steps"] == 6 and s["last_loss"] == 5.0 - 3.0 - 0.1 and s["best_loss"] == s["last_loss"]
    assert s["last_eval"] == {"step": 6, "eval_loss": 2.25, "eval_accuracy": 0.5}
    assert s["median_samples_per_s"] == sorted([101.0, 102.0, 103.0, 104.0, 90.0, 90.0])[3]
    # from the last row before the crash (the superseded step 5 at 1005) to step 5 redone at 1041
    assert s["restarts"] == 1 and s["restart_time_s"] == 36.0
    assert metrics.summary(str(b))["restarts"] == 0


@pytest.mark.slow  # an interpreter of trainer.metrics
def test_the_command_prints_a_line_per_run_and_plots_each_run(tmp_path):
    a, b = _run(tmp_path)
    png = tmp_path / "loss.png"
    proc = python("-m", "trainer.metrics", str(a), str(b), "--plot", str(png), timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{a}: 6 steps, loss 1.9000 (best 1.9000 at step 6), eval at step 6: eval_loss 2.2500")
    assert lines[0].endswith("1 restart(s) costing 36.0 s of wall time")
    assert lines[1].startswith(f"{b}: 3 steps") and lines[2] == f"plotted 2 run(s) to {png}"
    import matplotlib.image

    image = matplotlib.image.imread(png)[..., :3]
    assert image.shape[:2] == (500, 800)
    for color in ("#1f77b4", "#ff7f0e"):  # each run's colour (C0, C1) is drawn
        rgb = np.array([int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
        assert (np.abs(image - rgb).sum(-1) < 0.05).sum() > 100, color
    assert metrics.plot([str(a), str(b)], str(tmp_path / "again.png")) == ["a loss", "a eval loss", "b loss"]


@pytest.mark.slow  # an interpreter of trainer.metrics
def test_a_folder_without_metrics_is_one_line(tmp_path):
    proc = python("-m", "trainer.metrics", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"error: {tmp_path}: no metrics.jsonl (is it a run dir?)\n"


def test_escape_sequences_are_never_printed_and_a_string_step_or_time_is_skipped(tmp_path):
    """Issue 32 item 9: a row's values reached the terminal raw (a title or clear-screen sequence
    passed through), and a string `time` crashed the command. Now every control character is
    stripped and a row with a non-numeric step or time is skipped, with one warning."""
    run = tmp_path / "run"
    rows = [
        {"step": 1, "loss": 2.0, "time": 1.0},
        {"step": 2, "eval_loss": 1.5, "eval_\x1b]0;owned\x07x\x1b[2J": 1.0, "time": 2.0},
        {"step": 3, "loss": 1.0, "time": "soon"},
        {"step": "\x1b[2J4", "loss": 0.5, "time": 4.0},
    ]
    _write(run, rows)
    proc = python("-m", "trainer.metrics", str(run), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not any(c < " " for c in proc.stdout.replace("\n", "")), repr(proc.stdout)
    assert proc.stdout.startswith(f"{run}: 1 steps, loss 2.0000") and "eval_x 1.0000" in proc.stdout
    assert proc.stderr.splitlines() == [
        f"warning: {run}/metrics.jsonl: skipped 2 line(s) that are not rows (a JSON object with a numeric "
        f"step and time)"
    ]


def test_a_start_drops_lines_that_are_not_rows_and_copies_them_nowhere(tmp_path, caplog):
    from trainer.config import LogArgs

    run = tmp_path / "run"
    lines = [json.dumps({"step": s, "loss": 1.0, "time": float(s)}) for s in (1, 2, 3)]
    (run).mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join([lines[0], "echo owned >> ~/.bashrc", lines[1], '{"no": "step"}', lines[2], '{"step": 2']) + "\n"
    )
    metrics.Reporter(str(run), LogArgs(progress=False), 9, is_main=True).start(2, None)
    assert (run / "metrics.jsonl").read_text() == lines[0] + "\n" + lines[1] + "\n"
    assert (run / "metrics.superseded.jsonl").read_text() == lines[2] + "\n"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        f"{run}/metrics.jsonl: dropped 3 line(s) that are not rows of this run (not a JSON object with a "
        f"numeric step and time: a line cut short by a kill, or written by someone else)"
    ]


def test_a_restart_costs_its_own_start_up_not_the_time_nobody_ran_the_job(tmp_path):
    """`1 restart(s) costing 41.5 s` counted the time between a Ctrl-C and the next start. A new
    start (its resume row's `start` has no `stopped`) costs from its launcher's start to its first
    step; a restart inside the allocation (`stopped`: the agent stopped the ranks) from the last row
    before the failure, as before."""
    rows = [{"step": s, "loss": 1.0, "samples_per_s": 1.0, "time": 1000.0 + s} for s in (1, 2, 3, 4)]
    new_start = {"launcher": 1030.0, "process": 1031.0, "rendezvous": 1031.5}
    resume = {"event": "resume", "step": 4, "world_size": 2, "checkpoint": "x", "time": 1035.0, "start": new_start}
    after = [{"step": s, "loss": 1.0, "samples_per_s": 1.0, "time": 1036.0 + s} for s in (5, 6)]
    _write(tmp_path / "a", [*rows, resume, *after])
    assert metrics.summary(str(tmp_path / "a"))["restart_time_s"] == 11.0  # 1030 -> step 5 at 1041
    in_allocation = {**resume, "start": {**new_start, "stopped": 1029.0}}
    _write(tmp_path / "b", [*rows, in_allocation, *after])
    assert metrics.summary(str(tmp_path / "b"))["restart_time_s"] == 37.0  # step 4 at 1004 -> 1041
