"""What the tests feed the trainer: a corpus for a tokenizer, a small Hugging Face folder, and what an
attacker plants in a run dir (the `secret` fixture, tests/conftest.py, is the file a planted link points to)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch


def corpus(n: int, seed: int = 0) -> list[str]:
    """Sentences from a small grammar: learnable structure, for a tokenizer and a token file."""
    rng = random.Random(seed)
    subjects, verbs, objects = (
        ["the cat", "a dog", "my bird", "the fox"],
        ["sees", "eats", "likes"],
        ["the fish.", "a bone.", "some seeds."],
    )
    return [
        " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}" for _ in range(rng.randint(1, 4)))
        for _ in range(n)
    ]


SECRET = "the victim's own file\n"  # the text of the `secret` fixture's file


def plant(kind: str, path: Path, secret: Path) -> None:
    """Put at `path` what someone else could: a link to `secret`, a FIFO, or a folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        os.symlink(secret, path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)


# A Hugging Face llama config small enough for a folder in a test (hf_folder).
HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def hf_folder(tmp_path, config=HF_CONFIG, index: str | None = None) -> Path:
    """A Hugging Face folder as trainer.check reads it: config.json and a safetensors file (its header
    is read, not its names), with `index` as model.safetensors.index.json if given."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(32)}, str(folder / "model.safetensors"))
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(index)
    return folder
