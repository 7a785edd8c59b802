"""The system tier of tests/unit/test_user_wording.py, whose docstring says what both halves test."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.helpers.run import PYTHON, ROOT, TINY, env, train


@pytest.mark.slow
def test_a_family_of_one_s_own_exports_into_new_folders_and_is_named_when_hf_is_asked(tmp_path):
    """A family without a Hugging Face adapter was refused as `... holds a transformer` (model.name's
    default); an export into a/b/ made the folders."""
    run_dir = tmp_path / "run"
    toy = ["model.family=tests.toy_family", "data.name=synthetic_images", "model.image_size=8", "model.num_classes=3"]
    train(run_dir, 1, *TINY, *toy, "train.steps=1")
    proc = subprocess.run(
        [PYTHON, "-m", "trainer.export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    step = run_dir / "checkpoints" / "step_00000001"
    assert (proc.returncode, proc.stderr.splitlines()) == (
        2,
        [
            f"error: {step} holds model.family tests.toy_family, which has no Hugging Face adapter; --format hf "
            f"exports the transformer (a Llama, Mistral, Qwen2 or Qwen3) and families with one (docs/extending.md, "
            f'"Adding a model family"); export a file instead: --out model.pt or model.safetensors'
        ],
    )
    assert not (tmp_path / "hf").exists()
    out = tmp_path / "a" / "b" / "model.pt"
    proc = subprocess.run(
        [PYTHON, "-m", "trainer.export", str(run_dir), "--out", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(torch.load(out, weights_only=True)) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
