"""A model family is a spec (no torch), its network and one line in trainer.models.FAMILIES, and
nothing outside trainer/models asks which family a run uses."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, python, rows, train, weights
from tests.toy_family_net import TinyMLP
from toy_family import FAMILY
from trainer import models
from trainer.config import ConfigError, load
from trainer.preflight.check import validate

TOY = ["model.name=toy_mlp", "data.name=synthetic_images", "model.image_size=8", "model.num_classes=3"]


def family_questions(folder: Path) -> list[str]:
    """Lines of the modules in `folder` that ask which family a run uses: a model.name compared, or
    a family's name (or a torchvision one's) in quotes."""
    asks = re.compile(
        r"""model\.name\s*(==|!=|\bin\b|\.startswith)|\bm\.name\s*(==|!=|\bin\b)"""
        r"""|["'](transformer|mnist_cnn|vit_|resnet\d*|inception_v3)["']"""
    )
    return [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(folder.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]


def test_nothing_outside_the_models_package_asks_the_family():
    assert family_questions(ROOT / "trainer") == []


def test_the_family_specs_need_no_torch(tmp_path):
    """The config check reads the families' specs where there is no torch (a login node): with torch
    unimportable, the shipped specs and the toy one (added the documented way) import, an MNIST CNN
    config and a toy one validate, and only building the toy model needs torch (its network module)."""
    code = (
        'import sys; sys.modules["torch"] = None  # any import of torch now raises ImportError\n'
        "from tests.toy_family import FAMILY\n"
        "from trainer import models\n"
        "from trainer.preflight.check import validate\n"
        "from trainer.config import load\n"
        "models.FAMILIES['toy_mlp'] = FAMILY\n"
        f"for args in ({TOY!r}, ['model.name=mnist_cnn', 'data.name=synthetic_images']):\n"
        f"    print(validate(load(None, [*args, 'run_dir={tmp_path / 'run'}']), 1))\n"
        "try:\n"
        f"    FAMILY.build(load(None, {TOY!r}).model)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    proc = python("-c", code, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "[]\n[]\nimport of torch halted; None in sys.modules\n", proc.stderr


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
