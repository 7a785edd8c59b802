"""A model family is a spec (no torch), its network and one line in trainer.models.FAMILIES, and
nothing outside trainer/models asks which family a run uses."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.run import ROOT, python

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
