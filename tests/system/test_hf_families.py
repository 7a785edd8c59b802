"""The system tier of tests/unit/test_hf_families.py, whose docstring says what both halves test."""

import os

import pytest
import torch

from tests.helpers.outputs import weights
from tests.helpers.run import TINY, export_hf, train
from tests.unit.test_hf_families import TOKENS, hf_model, ours

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded (set before transformers is imported)
transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_a_qwen3_trains_on_2_processes_and_exports(tmp_path):
    """Start from a Qwen3 folder, train 3 steps on 2 processes with activation checkpointing, export
    with the trainer's command: transformers loads a Qwen3 with our logits."""
    hf_model(tmp_path / "start", "qwen3")
    train(
        tmp_path / "run",
        2,
        *TINY,
        "train.steps=3",
        "parallel.activation_checkpointing=true",
        f"model.init_from={tmp_path / 'start'}",
    )
    export_hf(tmp_path / "run", tmp_path / "out", "--max-shard-size", "30KB")
    trained = weights(tmp_path / "run")
    model, _ = ours(tmp_path / "start")
    assert not torch.equal(
        trained["layers.0.attention.q_norm.weight"], model.state_dict()["layers.0.attention.q_norm.weight"]
    )
    model.load_state_dict(trained)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, model(TOKENS), atol=2e-5, rtol=1e-5)
