"""The best checkpoint (issue 42 items 9, 3, 10): with evaluation on, the checkpoint of the lowest eval
loss is saved at that evaluation and kept beside the newest ones (Lightning's ModelCheckpoint(
monitor="val_loss", save_top_k=1)); the newest checkpoint names it; export, evaluate and generate
take --best; trainer.metrics names it. A language model family of the user's own (tests/
toy_lm_family.py) is sampled by trainer.generate; a NaN eval loss stops the run at once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer import early_stop
from trainer.checkpoint import manager
from trainer.commands import generate as gen
from trainer.commands.export import main as export
from trainer.observe import metrics as metrics_cli
from trainer.rundir import layout

# -- in this process: a process group of one, a real Checkpointer --------------------------------


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
