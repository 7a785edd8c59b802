"""The conv LM's network (tests/toy_lm_family.py is its spec)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalConv(nn.Module):
    """A residual block: a convolution over the last `kernel` positions (none ahead), then GELU."""

    def __init__(self, width: int, kernel: int = 3):
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(width, width, kernel)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (batch, width, positions)
        return h + F.gelu(self.conv(F.pad(h, (self.kernel - 1, 0))))


class ConvLM(nn.Module):
    def __init__(self, vocab_size: int, width: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(CausalConv(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).transpose(1, 2)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h.transpose(1, 2))
        if not self.training and os.environ.get("TOY_LM_NAN_EVAL"):
            logits = logits * float("nan")
        return logits
