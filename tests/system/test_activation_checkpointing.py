"""The system tier of tests/unit/test_activation_checkpointing.py, whose docstring says what both halves test."""

import pytest
import torch

from tests.unit.test_activation_checkpointing import _backward_ops


def _loss_and_grads(*overrides: str):
    loss, grads, _, _ = _backward_ops(*overrides)
    return loss, grads


@pytest.mark.slow  # compile: inductor builds the blocks' kernels
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["parallel.compile=true"], id="compile"),
        pytest.param(["parallel.float8=tensorwise", "parallel.float8_emulate=true"], id="float8-emulated"),
    ],
)
def test_selective_composes_with_compile_and_float8(overrides):
    """The blocks compiled (after checkpointing, as the plan orders them), or their linear layers
    float8 (before it): selective checkpointing gives the loss and gradients of none."""
    if "parallel.float8=tensorwise" in overrides:
        pytest.importorskip("torchao")
    loss, grads = _loss_and_grads(*overrides, "parallel.activation_checkpointing=none")
    got_loss, got_grads = _loss_and_grads(*overrides, "parallel.activation_checkpointing=selective")
    assert got_loss == pytest.approx(loss, rel=1e-5)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
