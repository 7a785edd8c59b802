"""What a run wrote, read back: its metrics rows and losses, its checkpoint's consolidated weights;
and the comparisons the tests make of two runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def metrics(run_dir) -> list[dict]:
    """The rows of metrics.jsonl but its event rows (resume, restart, node_lost: trainer/observe/metrics.py):
    training and evaluation rows; none while there is no such file."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "event" not in r]


def rows(run_dir) -> list[dict]:
    """Training rows of metrics.jsonl (evaluation rows have no 'loss')."""
    return [r for r in metrics(run_dir) if "loss" in r]


def losses(run_dir) -> dict[int, float]:
    """Loss by step; a step logged twice (redone after a crash) keeps its last value."""
    return {r["step"]: r["loss"] for r in rows(run_dir)}


def weights(run_dir, step: int | None = None) -> dict[str, torch.Tensor]:
    """The consolidated model weights of a run's checkpoint, through the export tool's code."""
    from trainer.commands.export import consolidate

    return consolidate(str(run_dir), step)[0]


def assert_same_weights(a: dict, b: dict, exact: bool = False, atol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), f"{key} differs"
        else:
            torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def assert_same_losses(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), f"steps differ: {sorted(a)} vs {sorted(b)}"
    for step in a:
        assert abs(a[step] - b[step]) <= rtol * abs(b[step]) + 1e-6, f"step {step}: loss {a[step]} vs {b[step]}"


def assert_same_hf_folders(a: Path, b: Path) -> None:
    """Two Hugging Face exports hold the same files: equal tensors in each .safetensors, equal bytes
    in the others (meta.json, which names its checkpoint, aside)."""
    from safetensors.torch import load_file

    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) and "model.safetensors" in names, (names, sorted(os.listdir(b)))
    for name in names:
        if name.endswith(".safetensors"):
            x, y = load_file(Path(a) / name), load_file(Path(b) / name)
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        elif name != "meta.json":
            assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name
