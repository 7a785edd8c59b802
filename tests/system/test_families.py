"""The system tier of tests/unit/test_families.py, whose docstring says what both halves test."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers.outputs import rows, weights
from tests.helpers.run import TINY, train
from tests.toy_family import FAMILY
from tests.toy_family_net import TinyMLP
from tests.unit.test_families import TOY
from trainer import models
from trainer.config import ConfigError, load
from trainer.preflight.check import validate


@pytest.mark.slow
def test_a_family_added_as_a_spec_a_network_and_one_line_checks_and_trains(tmp_path, monkeypatch):
    monkeypatch.setitem(models.FAMILIES, "toy_mlp", FAMILY)  # the one line (the run below has it too)
    # the config check asks the family, and lists it among the names there are
    with pytest.raises(ConfigError) as e:
        validate(load(None, [*TOY, "data.name=synthetic"]), 1)
    assert str(e.value) == "config: data.name: is 'synthetic'; toy_mlp trains on synthetic_images"
    with pytest.raises(ConfigError) as e:
        validate(load(None, ["model.name=gpt5"]), 1)
    assert str(e.value) == (
        "config: model.name: is 'gpt5'; use mnist_cnn, transformer, toy_mlp or a torchvision "
        "classification model (e.g. resnet18)"
    )

    # two steps with the real trainer: its loss, its accuracy (a classifier), its trained weights
    train(tmp_path, 1, *TINY, *TOY, "train.steps=2", "eval.interval=2", "eval.batches=1", module="tests.toy_family")
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [1, 2] and all(math.isfinite(r["loss"]) for r in logged)
    assert "tokens_per_s" not in logged[-1]  # no FLOPs per token given: no MFU either
    evaluated = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [2] and 0 <= evaluated[0]["eval_accuracy"] <= 1
    torch.manual_seed(load(None, []).train.seed)  # the trainer's start: the seed, then build
    start = TinyMLP(8, 3).state_dict()
    trained = weights(tmp_path)  # the checkpoint's model, built by export through the family
    assert trained.keys() == start.keys()
    assert all(not torch.equal(trained[k], start[k]) for k in start)
