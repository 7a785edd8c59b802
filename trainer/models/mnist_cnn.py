"""The MNIST CNN family: the PyTorch FSDP tutorial's network, on MNIST or generated 28x28 images."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.models.family import Family

if TYPE_CHECKING:
    from trainer.models import ModelArgs


class MnistCNN(nn.Module):
    def __init__(self, num_classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(2 * dropout)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)

    def blocks(self) -> list[nn.Module]:
        return [self.conv1, self.conv2, self.fc1, self.fc2]


def check(args: ModelArgs, data, fail, resolved) -> None:
    """Image data of MNIST's kind, and at least two classes."""
    if data.name in ("synthetic", "tokens"):
        fail(
            "data.name",
            f"is {data.name!r} but {args.name} classifies images; use mnist, imagefolder or synthetic_images",
        )
    if args.num_classes < 2:
        fail("model.num_classes", f"is {args.num_classes}; it must be at least 2")
    if data.name not in ("mnist", "synthetic_images"):
        fail(
            "data.name",
            f"{data.name!r} does not fit model {args.name!r}: MNIST goes with mnist_cnn, imagefolder with "
            "torchvision models",
        )


FAMILY = Family(
    build=lambda args: MnistCNN(args.num_classes, args.dropout),
    blocks=MnistCNN.blocks,
    check=check,
    input_shape=lambda args: (1, 28, 28),
    kind="classifier",
)
