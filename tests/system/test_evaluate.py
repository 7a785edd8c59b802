"""`trainer.evaluate` evaluates a checkpoint as the training loop did, writes one metrics row and
nothing else; `trainer.generate` on a run on generated data prints token ids. One run serves all:
the tiny transformer on generated data, 2 steps on 2 processes, evaluated at step 2."""

import hashlib
import json
import subprocess
import time

import pytest
import torch

from tests.helpers.outputs import metrics
from tests.helpers.run import TINY, python, train
from trainer.commands import generate as gen

pytestmark = pytest.mark.slow  # a module fixture trains a run

STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    train(run_dir, 2, *TINY, f"train.steps={STEPS}", f"eval.interval={STEPS}", "eval.batches=2")
    return run_dir


def evaluate(run_dir, *args) -> subprocess.CompletedProcess:
    return python("-m", "trainer.evaluate", str(run_dir), *map(str, args), timeout=300)


def snapshot(run_dir) -> dict[str, str]:
    """Every file of the run dir but metrics.jsonl: its path, mode and content hash."""
    return {
        str(p.relative_to(run_dir)): f"{p.stat().st_mode:o} {hashlib.sha256(p.read_bytes()).hexdigest()}"
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != "metrics.jsonl"
    }


def test_evaluate_gives_the_training_loops_eval_loss_and_writes_one_row_only(run):
    before, rows_before = snapshot(run), metrics(run)
    trained = next(r["eval_loss"] for r in rows_before if "eval_loss" in r and r["step"] == STEPS)
    proc = evaluate(run)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    row = json.loads(lines[0])
    # 1 process here, 2 in training: the same samples, summed in another order
    assert row["eval_loss"] == pytest.approx(trained, rel=1e-6)
    assert row["step"] == STEPS and row["source"] == "trainer.evaluate" and row["eval_batches"] == 2
    assert "eval_accuracy" not in row and abs(row["time"] - time.time()) < 300
    assert metrics(run) == [*rows_before, row]  # appended, nothing else changed
    assert snapshot(run) == before  # the checkpoints byte for byte, config.yaml, status.json

    proc = evaluate(run, "--step", STEPS, "eval.batches=5")
    assert proc.returncode == 0, proc.stderr
    more = json.loads(proc.stdout)
    assert more["eval_batches"] == 5 and more["eval_loss"] != row["eval_loss"]
    assert metrics(run)[-1] == more and snapshot(run) == before


def test_evaluate_bad_input_is_one_line_and_writes_nothing(run, capsys):
    """In this process: bad input is refused before a process group exists."""
    from trainer.commands.evaluate import main

    before, rows_before = snapshot(run), metrics(run)
    for args, message in [
        (
            ["model.dim=8"],
            "error: override 'model.dim=8': trainer.evaluate changes eval.*, data.*, parallel.* keys only",
        ),
        (["eval.batches=0"], "error: eval.batches is 0; give 1 or more"),
        (["eval.bathces=3"], "error: override 'eval.bathces=3': unknown key 'eval.bathces'"),
        (["--step", "1"], f"error: {run} has no complete checkpoint for step 1"),
    ]:
        assert main([str(run), *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(message) and len(err.splitlines()) == 1, err
    assert metrics(run) == rows_before and snapshot(run) == before


def test_generate_on_generated_data_takes_and_prints_ids(run, capsys):
    assert gen.main([str(run), "--prompt", "3 17 42", "--max-new-tokens", "8", "--greedy"]) == 0
    out = capsys.readouterr().out
    ids = list(map(int, out.split()))
    model, _ = gen.load(str(run), None, torch.device("cpu"))
    assert ids == gen.sample(model, [3, 17, 42], 8) and all(0 <= i < 256 for i in ids)
    assert gen.main([str(run), "--prompt", "3 17 42", "--max-new-tokens", "8", "--seed", "1"]) == 0
    assert len(capsys.readouterr().out.split()) == 8
