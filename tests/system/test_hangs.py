"""The system tier of tests/unit/test_hangs.py, whose docstring says what both halves test."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.helpers.outputs import rows
from tests.helpers.run import ROOT, launch, wait_for
from trainer.resilience import hangs

TIMEOUT = ["parallel.timeout_s=10"]  # the smallest that lets a step finish on a loaded 2-core machine
# The hang's evidence and exit, not the restart that follows (tests/system/test_restart.py).
HANG = [*TIMEOUT, "launch.max_restarts=0"]
GRACE = ["--grace-seconds=25"]  # the launcher's: torchrun kills a stopped rank 5 s after the first exit


def ranks_of(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the launcher's ranks, as its hang monitor finds them."""
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher_pid:
            rank = [v for v in environ if v.startswith(b"RANK=")]
            if rank:
                out[int(rank[0][5:])] = int(entry)
    return out


def hang_folder(run_dir) -> Path:
    folders = list((Path(run_dir) / "hangs").iterdir())
    assert len(folders) == 1, folders
    return folders[0]


@pytest.mark.slow  # trains on two ranks until a rank is stopped or slow (about 20 s each)
def test_a_stopped_rank_is_named_in_the_report_with_its_stack_taken_from_outside(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *HANG, "train.steps=100000", options=GRACE)
    ranks = {}
    try:
        wait_for(lambda: len(rows(run_dir)) >= 3, 120, "training to start")
        ranks = ranks_of(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
    finally:
        for pid in ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    folder = hang_folder(run_dir)
    assert f"launch: a rank stopped answering: see {folder}/report.txt" in err
    logged = rows(run_dir)[-1]["step"]
    # rank 0 waited in a collective of the step (FSDP's, or the log step's): the call is in its file
    rank0 = (folder / "rank_0.txt").read_text()
    assert f"pid: {ranks[0]}\n" in rank0 and "\nCall that timed out (most recent call last):\n" in rank0, rank0
    assert re.search(r"^Call that timed out .*?, in _train\n", rank0, re.S | re.M), rank0
    assert f"silent: rank 1: node {hangs.node()}, pid {ranks[1]}, last step " in rank0, rank0
    # rank 1 could not write: the launcher read its stack with py-spy, without waking it
    rank1 = (folder / "rank_1.txt").read_text()
    assert f"pid: {ranks[1]}\nwhy: did not write its own stack (process state: T (stopped)); " in rank1, rank1
    if hangs.py_spy():
        assert f"taken from outside with dump --pid {ranks[1]} --nonblocking" in rank1
        assert re.search(r"^\s+_train \(.*trainer/train.py:\d+\)$", rank1, re.M), rank1
    else:
        assert "py-spy is not installed" in rank1
    report = (folder / "report.txt").read_text()
    last = re.search(rf"^  rank 1: node {re.escape(hangs.node())}, pid {ranks[1]}, last step (\d+)$", report, re.M)
    assert "stopped answering: rank 1\n" in report and last, report
    assert int(last.group(1)) in (logged, logged + 1), (logged, report)  # the step it finished or started
    assert re.search(
        rf"^  rank 0 \(node \S+, pid {ranks[0]}, step \d+\): a collective timed out after 10 s "
        rf"\(parallel.timeout_s\): .*; in File \".*/trainer/[\w/]+\.py\", line \d+, in \w+ ",
        report,
        re.M,
    ), report
    if hangs.py_spy():
        assert re.search(
            rf"^  rank 1 \(node \S+, pid {ranks[1]}\): did not write .*; in [\w.]+ \(trainer/", report, re.M
        ), report


# Rank 1 burns 0.3 s of CPU in each of its first 6 steps (a straggler), then sleeps inside step 9.
# The training loss (trainer/train.py _loss_fn) is computed once a step: no accumulation in TINY.
SLOW_THEN_ASLEEP = """
import os, time
if os.environ.get("RANK") == "1":
    import trainer.train
    training_loss, calls = trainer.train._loss_fn, [0]

    def slow_then_asleep(logits, y):
        calls[0] += 1
        started = time.process_time()
        while calls[0] <= 6 and time.process_time() - started < 0.3:
            pass
        if calls[0] == 9:
            time.sleep(3600)
        return loss_fn(logits, y)

    def _loss_fn(cfg):
        global loss_fn
        loss_fn = training_loss(cfg)
        return slow_then_asleep

    trainer.train._loss_fn = _loss_fn
"""


@pytest.mark.slow  # trains on two ranks until a rank is stopped or slow (about 20 s each)
def test_a_slow_rank_is_named_a_straggler_and_a_rank_asleep_in_a_step_writes_its_stack(tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(SLOW_THEN_ASLEEP)  # imported first by every rank
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir,
        *HANG,
        "train.steps=100000",
        options=GRACE,
        extra_env={"PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{ROOT}"},
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    # stragglers: every row has the spread; rank 1 named once, after 3 slow windows (steps 2-4: the
    # first window is warm-up and never counts)
    logged = {r["step"]: r for r in rows(run_dir)}
    assert sorted(logged) == list(range(1, 9)), err[-3000:]
    for step in range(2, 7):  # the first step's time is the start-up's as well
        r = logged[step]
        assert r["slowest_rank"] == 1 and r["compute_s_max"] >= 0.3 > 3 * r["compute_s_min"], r
        assert r["compute_s_median"] == pytest.approx((r["compute_s_min"] + r["compute_s_max"]) / 2)
    named = [line for line in (out + err).splitlines() if "straggler at step" in line]
    assert len(named) == 1 and re.search(
        rf"straggler at step 4: rank 1 on node {re.escape(hangs.node())} needed 0.\d+ s of compute "
        rf"per step, more than 1.5 x the median [\d.]+ s \(log.straggler_factor\) for 3 "
        rf"logged windows in a row$",
        named[0],
    ), named
    # the sleeping rank wrote its own stack: the sleep inside the loss, inside the step
    folder = hang_folder(run_dir)
    rank1 = (folder / "rank_1.txt").read_text()
    assert "step: 9\nwhy: no step completed within 10 s (parallel.timeout_s): in step 9 for " in rank1, rank1
    assert "in slow_then_asleep\n    time.sleep(3600)" in rank1 and "in _train\n" in rank1, rank1
    report = (folder / "report.txt").read_text()
    pids = re.search(r"^  rank 1: node \S+, pid (\d+), last step 9$", report, re.M)
    assert "stopped answering: rank 1\n" in report and pids, report
    assert f"rank 1 (node {hangs.node()}, pid {pids.group(1)}, step 9): no step completed" in report
    assert re.search(r"sitecustomize.py\", line \d+, in slow_then_asleep time.sleep\(3600\)$", report, re.M), report
