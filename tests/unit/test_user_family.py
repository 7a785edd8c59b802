"""A model family from the user's own package, without a fork: `model.family: my_pkg.family` names a
module on the Python path that defines a FAMILY, and the run gets every feature a built-in family has
(FSDP units, activation checkpointing, compile, the memory estimate, export). Importing it runs its
code, so a config that names it must be the user's own: a run dir's config.yaml (or a checkpoint's
meta.json) that someone else could have written is refused in one line, and nothing is imported."""

from __future__ import annotations

import textwrap

import pytest

from trainer.config import ConfigError, load
from trainer.preflight.check import validate

FAMILY = "my_pkg.family"
MINE = [
    f"model.family={FAMILY}",
    "model.name=mine",
    "data.name=synthetic_images",
    "model.image_size=8",
    "model.num_classes=3",
]


SPEC = '''
"""The user's family spec. Every import appends this process's id to `imported` beside it."""
import os

with open(os.path.join(os.path.dirname(__file__), "imported"), "a") as f:
    f.write(f"{os.getpid()}\\n")

from trainer.models.family import Family


def build(args):
    from my_pkg.net import Net  # torch only when a model is built, as a family of the trainer

    return Net(args.image_size, args.num_classes)


def check(args, data, fail, resolved):
    if data.name != "synthetic_images":
        fail("data.name", f"is {data.name!r}; mine trains on synthetic_images")


FAMILY = Family(
    build=build,
    blocks=lambda model: list(model.layers),
    check=check,
    input_shape=lambda args: (3, args.image_size, args.image_size),
    kind="classifier",
)
'''
NET = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, side, classes):
        super().__init__()
        self.stem = nn.Linear(3 * side * side, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        h = self.stem(x.flatten(1))
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """The folder that holds my_pkg (the family's spec and network), on the Python path of this
    process and of the processes the tests start (user_env)."""
    root = tmp_path / "site"
    (root / "my_pkg").mkdir(parents=True)
    (root / "my_pkg" / "__init__.py").write_text("")
    (root / "my_pkg" / "family.py").write_text(textwrap.dedent(SPEC))
    (root / "my_pkg" / "net.py").write_text(textwrap.dedent(NET))
    monkeypatch.syspath_prepend(str(root))
    return root


def test_a_missing_module_or_one_without_a_family_is_one_line(package):
    with pytest.raises(ConfigError) as e:
        validate(load(None, [*MINE, "model.family=no_such_pkg.family"]), 1)
    assert str(e.value) == (
        "config: model.family: no module 'no_such_pkg.family' on the Python path; put its package's folder on "
        "PYTHONPATH (or pip install it)"
    )
    with pytest.raises(ConfigError) as e:
        validate(load(None, [*MINE, "model.family=my_pkg.net"]), 1)
    assert str(e.value) == (
        f"config: model.family: my_pkg.net ({package}/my_pkg/net.py) defines no FAMILY = "
        f"trainer.models.family.Family(...); define one (docs/extending.md, 'Adding a model family')"
    )
    with pytest.raises(ConfigError, match=r"model.family: is '\.\./evil'; give a module's dotted name"):
        validate(load(None, [*MINE, "model.family=../evil"]), 1)
    # the family's own check speaks, as a built-in family's does
    with pytest.raises(ConfigError) as e:
        validate(load(None, [*MINE, "data.name=synthetic"]), 1)
    assert str(e.value) == "config: data.name: is 'synthetic'; mine trains on synthetic_images"
