"""The system tier of tests/unit/test_best.py, whose docstring says what both halves test."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.outputs import metrics, weights
from tests.helpers.run import TINY, command, python, run_command, train
from tests.unit.test_best import FAMILY, steps
from trainer import early_stop
from trainer.commands import generate as gen
from trainer.commands.export import main as export
from trainer.observe import metrics as metrics_cli
from trainer.rundir import layout

BASE = [*TINY, *FAMILY, "eval.interval=2", "eval.batches=1", "checkpoint.interval=5", "checkpoint.keep=1"]
NAN = {"TOY_LM_NAN_EVAL": "1"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """5 steps, then 5 more at optim.lr=1 (from step 5: the eval loss rises), evaluated every 2 steps,
    a checkpoint every 5, one kept."""
    run_dir = tmp_path_factory.mktemp("best") / "run"
    train(run_dir, 1, *BASE, "train.steps=5")
    train(run_dir, 1, *BASE, "train.steps=10", "optim.lr=1")
    return run_dir


def eval_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in metrics(run_dir) if "eval_loss" in r and "source" not in r}


@pytest.mark.slow
def test_the_best_checkpoint_is_saved_at_its_evaluation_kept_and_named(run):
    losses = eval_losses(run)
    assert sorted(losses) == [2, 4, 6, 8, 10]
    best = min(losses, key=losses.get)
    # the premise: the best evaluation is at no checkpoint step (5, 10), the lr of 1 made it worse after
    assert best in (2, 4) and all(losses[s] > losses[best] for s in (6, 8, 10)), losses
    assert steps(run) == [best, 10]  # keep=1: the newest, and the best, saved at its evaluation
    assert layout.read_meta(layout.step_path(run, 10))[early_stop.BEST] == {"step": best, "loss": losses[best]}

    proc = python("-m", "trainer.metrics", run)
    assert proc.returncode == 0, proc.stderr
    assert f"best checkpoint step {best} (eval_loss {losses[best]:.4f}): {layout.step_path(run, best)}" in proc.stdout


@pytest.mark.slow
def test_export_evaluate_and_generate_take_best(run, tmp_path, capsys):
    best = min(eval_losses(run), key=eval_losses(run).get)
    assert export([str(run), "--best", "--out", str(tmp_path / "best.pt")]) == 0
    exported = torch.load(tmp_path / "best.pt", weights_only=True)
    saved, newest = weights(run, best), weights(run, 10)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert any(not torch.equal(exported[k], newest[k]) for k in saved)
    with pytest.raises(SystemExit) as e:  # one or the other
        export([str(run), "--best", "--step", "10", "--out", str(tmp_path / "x.pt")])
    assert e.value.code == 2 and "argument --step: not allowed with argument --best" in capsys.readouterr().err

    proc = python("-m", "trainer.evaluate", run, "--best", timeout=300)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["step"] == best and row["eval_loss"] == pytest.approx(eval_losses(run)[best], rel=1e-6)

    assert gen.main([str(run), "--best", "--prompt", "3 17 42", "--max-new-tokens", "40", "--greedy"]) == 0
    assert list(map(int, capsys.readouterr().out.split())) == greedy(exported, [3, 17, 42], 40)


def greedy(state: dict, prompt: list[int], n: int) -> list[int]:
    """The greedy continuation by the conv LM of weights `state`, computed here with its network."""
    from tests.toy_lm_family_net import ConvLM

    model = ConvLM(64, width=32, layers=2)
    model.load_state_dict(state)
    model.eval()
    tokens = list(prompt)
    for _ in range(n):  # past model.seq_len=32: the context is the last 32 tokens
        with torch.no_grad():
            tokens.append(int(model(torch.tensor([tokens[-32:]]))[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.slow
def test_generate_samples_a_users_own_language_model_family(run, capsys):
    """Item 3: generate read model.shape.vocab_size and model.seq_len, which the family contract never
    asks for: AttributeError: 'ConvLM' object has no attribute 'shape'. Now the context length comes
    from the family's input_shape and the vocabulary from model.vocab_size (the data's)."""
    assert gen.main([str(run), "--prompt", "3 17 42", "--max-new-tokens", "40", "--greedy"]) == 0
    assert list(map(int, capsys.readouterr().out.split())) == greedy(weights(run), [3, 17, 42], 40)
    assert gen.main([str(run), "--prompt", "3 64", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == "error: --prompt: token id 64 is not in the vocabulary 0..63\n"


@pytest.mark.slow
def test_a_nan_eval_loss_stops_at_once_and_a_restart_has_nothing_to_do(run, tmp_path):
    """Item 10: a NaN eval loss counted as one evaluation without an improvement: the run trained on
    (here to its end) with patience 3. Now it stops at that evaluation, as Lightning's check_finite,
    with the usual record: a restart has nothing to do, trainer.metrics says it stopped early."""
    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir)
    overrides = [*BASE, "train.steps=16", "train.early_stop_patience=3"]
    proc = run_command(command(run_dir, 1, overrides), timeout=300, extra_env=NAN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = (
        "early stop at step 12: eval loss nan is not finite; the run stops at once; lower optim.lr or look at "
        "the evaluation data, then restart with train.early_stop_patience=0 to train on"
    )
    assert proc.stdout.count("early stop at") == 1 and line in proc.stdout, proc.stdout[-3000:]
    assert layout.latest_committed_step(run_dir) == 12
    record = layout.read_meta(layout.step_path(run_dir, 12))[early_stop.PART]
    assert record["stopped"] == 12 and record["reason"] == "not_finite"
    logged = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    (row,) = [r for r in logged if r.get("event") == "early_stop"]
    assert row["step"] == 12 and row["reason"] == "not_finite"

    summary = metrics_cli.summary(str(run_dir))
    assert summary["early_stop"] == {"step": 12, "reason": "not_finite", "best_eval_loss": None, "best_step": None}
    assert "stopped early at step 12 (eval loss not finite)" in metrics_cli._summary_line(summary)
    said = (
        "nothing to do: the run stopped early at step 12, whose eval loss was not finite "
        "(train.early_stop_patience=3); to train on, restart with train.early_stop_patience=0"
    )
    proc = run_command(command(run_dir, 1, [*overrides, "train.early_stop_patience=30"]), timeout=300)
    assert proc.returncode == 0 and said.replace("=3)", "=30)") in proc.stdout, proc.stderr
