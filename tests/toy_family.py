"""A toy model family, added as README's "Adding a model family" says: this one file, and one line in
trainer.models.FAMILIES. A test does not edit the trainer's source, so `python -m tests.toy_family
...` is `python -m trainer ...` with that line run first, and tests put it in with monkeypatch."""

from __future__ import annotations

import torch
import torch.nn as nn

from trainer.models.family import Family


class TinyMLP(nn.Module):
    """Two linear layers over the flattened image."""

    def __init__(self, side: int, num_classes: int):
        super().__init__()
        self.fc1 = nn.Linear(3 * side * side, 16)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def check(args, data, fail, resolved) -> None:
    if data.name != "synthetic_images":
        fail("data.name", f"is {data.name!r}; toy_mlp trains on synthetic_images")


FAMILY = Family(
    build=lambda args: TinyMLP(args.image_size, args.num_classes),
    blocks=lambda model: [model.fc1, model.fc2],
    check=check,
    input_shape=lambda args: (3, args.image_size, args.image_size),
    kind="classifier",
)

if __name__ == "__main__":
    from trainer import models

    models.FAMILIES["toy_mlp"] = FAMILY  # the one line: "toy_mlp": toy_family.FAMILY in FAMILIES
    from trainer.__main__ import main
    from trainer.dist import exit_process

    exit_process(main())
