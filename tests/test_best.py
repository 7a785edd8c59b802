"""The best checkpoint (issue 42 items 9, 3, 10): with evaluation on, the checkpoint of the lowest eval
loss is saved at that evaluation and kept beside the newest ones (Lightning's ModelCheckpoint(
monitor="val_loss", save_top_k=1)); the newest checkpoint names it; export, evaluate and generate
take --best; trainer.metrics names it. A language model family of the user's own (tests/
toy_lm_family.py) is sampled by trainer.generate; a NaN eval loss stops the run at once."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.distributed as dist

from conftest import TINY, command, metrics, python, run_command, train, weights
from trainer import early_stop
from trainer.checkpoint import manager
from trainer.commands import generate as gen
from trainer.commands.export import main as export
from trainer.observe import metrics as metrics_cli
from trainer.rundir import layout

# -- in this process: a process group of one, a real Checkpointer --------------------------------


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def checkpointer(run_dir, group, keep: int):
    """A Checkpointer of a tiny model that keeps `keep` newest, with the best part; (it, the part)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    best = early_stop.Best()
    parts = {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), early_stop.BEST: best}
    ckpt = manager.Checkpointer(manager.CheckpointArgs(keep=keep), str(run_dir), 0, 1, group, model, optimizer, parts)
    return ckpt, best


def steps(run_dir) -> list[int]:
    return [s for s, _ in manager.complete(str(run_dir))]


def test_retention_never_deletes_the_best_checkpoint(tmp_path, group):
    """keep=1 kept the newest only: the best eval loss's checkpoint went with the next save. Now the
    step the newest checkpoint records as the best stays, until a better one replaces it."""
    ckpt, best = checkpointer(tmp_path, group, keep=1)
    progress = {"samples": 0, "config": {"eval": {"interval": 2}}}
    for step, loss in [(2, 3.0), (4, 3.5), (6, 3.1)]:
        best.update(step, loss)
        ckpt.save(step, progress, blocking=True)
    assert steps(tmp_path) == [2, 6]
    assert layout.read_meta(layout.step_path(tmp_path, 6))[early_stop.BEST] == {"step": 2, "loss": 3.0}
    summary = metrics_cli.summary(str(tmp_path))
    assert summary["best_checkpoint"] == {"step": 2, "eval_loss": 3.0, "path": layout.step_path(tmp_path, 2)}
    assert summary["early_stop"] is None
    assert f"best checkpoint step 2 (eval_loss 3.0000): {layout.step_path(tmp_path, 2)}" in metrics_cli._summary_line(
        summary
    )
    best.update(8, 2.5)  # a better one: the old best is an old checkpoint like any other
    ckpt.save(8, progress, blocking=True)
    assert steps(tmp_path) == [8]
    assert early_stop.best_step(str(tmp_path), (8, layout.step_path(tmp_path, 8))) == 8


def test_best_without_an_evaluation_is_one_line(tmp_path, group, capsys):
    ckpt, _ = checkpointer(tmp_path, group, keep=0)
    ckpt.save(2, {"samples": 0, "config": {"eval": {"interval": 0}}}, blocking=True)
    assert export([str(tmp_path), "--best", "--out", str(tmp_path / "model.pt")]) == 2
    assert capsys.readouterr().err == (
        f"error: --best: {tmp_path} has no best checkpoint: the run has no evaluation (eval.interval=0) to choose "
        f"one by (newest checkpoint: step 2); give --step N, or neither for the newest\n"
    )
    assert not (tmp_path / "model.pt").exists()


def test_the_best_part_refuses_a_state_not_of_its_kind():
    for bad, why in [
        ({"step": 2}, "not the keys step, loss"),
        ({"step": 2, "loss": None}, "step and loss are not both set or both null"),
        ({"step": -1, "loss": 1.0}, "step is -1, not a step"),
        ({"step": 2, "loss": float("nan")}, "loss is nan, not a loss"),
    ]:
        assert early_stop.best_problem(bad) == why
        with pytest.raises(ValueError, match=f"meta.json's best_eval: {why}"):
            early_stop.Best().load_state_dict(bad)
        assert early_stop.Best.pinned(bad) == []
    best = early_stop.Best()
    assert best.update(2, 3.0) and not best.update(4, 3.0) and not best.update(6, float("nan"))
    assert not best.update(8, float("inf")) and best.update(10, 2.0) and best.state_dict() == {"step": 10, "loss": 2.0}


# -- a run of a user's language model family ------------------------------------------------------

FAMILY = ["model.family=tests.toy_lm_family", "model.name=convlm", "model.vocab_size=64"]
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


def test_a_language_model_family_without_a_context_length_is_one_line(monkeypatch):
    from tests import toy_lm_family
    from trainer.config import ConfigError, load

    cfg = load(None, [*FAMILY, "model.seq_len=32"])
    assert gen.context_length(cfg) == 32
    flat = dataclasses.replace(toy_lm_family.FAMILY, input_shape=lambda args: (args.seq_len, 8))
    monkeypatch.setattr(toy_lm_family, "FAMILY", flat)
    with pytest.raises(ConfigError) as e:
        gen.context_length(cfg)
    assert str(e.value) == (
        "model family tests.toy_lm_family is of kind 'lm' but its input_shape gives (32, 8), not (seq_len,): "
        "trainer.generate needs the context length from it; make input_shape return (args.seq_len,)"
    )


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
