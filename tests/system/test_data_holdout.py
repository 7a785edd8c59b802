"""The system tier of tests/unit/test_data_holdout.py, whose docstring says what both halves test."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers.outputs import rows
from tests.helpers.run import TINY, python, train
from tests.unit.test_data_holdout import TOKENS, token_file
from trainer.data import StreamOrder


@pytest.mark.slow
def test_a_run_never_trains_on_its_held_out_part_and_a_resume_keeps_it(capsys, tmp_path):
    """2 processes, a 40-window file, evaluation every 2 steps: config.yaml records 0.01 (1 window
    held out), the sample trace never reaches window 39, a resume without evaluation keeps the split
    (its epochs count 39 windows), and trainer.evaluate reads the same held-out window as the loop."""
    path = token_file(tmp_path / "t.bin", 40, 7)
    run_dir = tmp_path / "run"
    common = [*TINY, *TOKENS, f"data.path={path}", "data.trace=true", "checkpoint.interval=2"]
    train(run_dir, 2, *common, "train.steps=4", "eval.interval=2", "eval.batches=1")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["eval_fraction"] == 0.01
    out = train(run_dir, 2, *common, "train.steps=8", "eval.interval=0").stdout
    assert "data.eval_fraction" not in out  # nothing changed: no stream-change line
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["eval_fraction"] == 0.01
    assert {r["step"]: r["epoch"] for r in rows(run_dir)} == {s: s * 12 / 39 for s in range(1, 9)}
    order = StreamOrder(39, 0)
    read = set()
    for trace in (run_dir / "trace").iterdir():
        for line in trace.read_text().splitlines():
            read |= {order(int(i)) for i in line.split()[1:]}
    assert read and max(read) < 39 and len(read) == 39  # every training window, never the held-out one
    evals = {r["step"]: r["eval_loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in r}  # fmt: skip
    assert sorted(evals) == [2, 4]
    proc = python("-m", "trainer.evaluate", run_dir, "--step", "4", "eval.batches=1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(evals[4], rel=1e-5)
    # another fraction is data the run trained on: refused in one line (before any process group)
    from trainer.commands.evaluate import main as evaluate

    assert evaluate([str(run_dir), "data.eval_fraction=0.5"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: data.eval_fraction=0.5: what the run held out for evaluation is its own (0.01); another fraction "
        "is data it trained on: give data.eval_path instead"
    ]
