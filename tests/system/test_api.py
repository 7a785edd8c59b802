"""The system tier of tests/unit/test_api.py, whose docstring says what both halves test."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess

import pytest

from tests.helpers.outputs import metrics
from tests.helpers.pages import block
from tests.helpers.run import PYTHON, ROOT, TINY, env, python, train, wait_for
from tests.unit.test_api import DEFAULT
from trainer.rundir.layout import latest_committed_step


def readme_block() -> str:
    return block("README.md", "Python API", "python")


@pytest.mark.slow
def test_the_readme_block_as_written(tmp_path):
    """One rank in the test's process, then the run continued by the launcher with 2 processes."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    proc = subprocess.run(
        [PYTHON, "-c", readme_block()], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "nb"
    printed = proc.stdout.strip().splitlines()[-1]
    trained = [r for r in metrics(run_dir) if "loss" in r]
    assert printed == str([(r["step"], round(r["loss"], 4)) for r in trained])
    assert [r["step"] for r in trained] == list(range(1, 9))  # each step once
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in events if r.get("event") == "resume"]
    assert [r["step"] for r in resumed] == [6] and "launcher" in resumed[0]["start"]  # the launch continued
    assert re.search(r"^launch: \S+: 2 rank\(s\) on ", proc.stderr, re.M), proc.stderr  # with 2 processes


# A program's use: the config from a file, its overrides from the command line, trained twice in one
# process (the second continues the run), and the rows as metrics() returns them.
PROGRAM = """
import json, sys
from trainer import api

config, run_dir, *overrides = sys.argv[1:]
api.train(api.config(config, overrides, run_dir=run_dir))
api.train(api.config(config, ["train.steps=8"], run_dir=run_dir))
print(json.dumps(api.metrics(run_dir)))
"""


@pytest.mark.slow
def test_train_in_process_writes_what_the_command_line_writes(tmp_path):
    train(tmp_path / "cli", 1, *TINY)
    proc = python("-c", PROGRAM, DEFAULT, tmp_path / "api", *TINY, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    returned = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r for r in returned if "event" not in r] == metrics(tmp_path / "api")
    cli = {r["step"]: r["loss"] for r in metrics(tmp_path / "cli") if "loss" in r}
    mine = {r["step"]: r["loss"] for r in returned if "loss" in r}
    assert list(cli) == list(range(1, 7)) and list(mine) == list(range(1, 9))
    assert {step: mine[step] for step in cli} == cli  # the same losses, bit for bit
    assert [(r["step"], r["world_size"]) for r in returned if r.get("event") == "resume"] == [(6, 1)]


STOPPED = """
import sys
from trainer import api

cfg = api.config(sys.argv[1], sys.argv[3:], run_dir=sys.argv[2])
try:
    api.launch(cfg, nproc=2)
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.slow
def test_ctrl_c_in_launch_stops_the_ranks_which_save(tmp_path):
    """A notebook's interrupt reaches the caller only: launch() stops its launcher as Ctrl-C at make
    run would (the ranks save at the step they reached), waits for it, and raises the interrupt."""
    run_dir = tmp_path / "run"
    program = subprocess.Popen(
        [PYTHON, "-c", STOPPED, DEFAULT, str(run_dir), *TINY, "train.steps=100000"],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: metrics(run_dir), timeout=300, what="the first row")
        program.send_signal(signal.SIGINT)
        out, err = program.communicate(timeout=120)
    finally:
        program.kill()
    assert out.strip().splitlines()[-1] == "interrupted", out[-3000:] + err[-3000:]
    saved = latest_committed_step(str(run_dir))
    assert saved is not None and 0 < saved < 100000, err[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
