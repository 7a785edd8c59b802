"""The toy family's network (tests/toy_family.py is its spec): what `trainer/models/<family>_net.py` is
for a family of the trainer."""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyMLP(nn.Module):
    """Two linear layers over the flattened image."""

    def __init__(self, side: int, num_classes: int):
        super().__init__()
        self.fc1 = nn.Linear(3 * side * side, 16)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))
