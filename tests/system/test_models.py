"""The system tier of tests/unit/test_models.py, whose docstring says what both halves test."""

import struct

import pytest
import torch

from tests.unit.test_models import write_mnist
from trainer import data, models


@pytest.mark.slow  # an interpreter of trainer.data
def test_fake_mnist_is_the_idx_format_the_reader_takes(tmp_path):
    """The command a user without internet runs: its files are what torchvision's MNIST reads."""
    from tests.helpers.run import python

    proc = python("-m", "trainer.data", "fake-mnist", str(tmp_path), "--samples", "12", timeout=120)
    assert proc.returncode == 0, proc.stderr
    raw = tmp_path / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(data.MNIST_FILES)
    assert (raw / "t10k-labels-idx1-ubyte").read_bytes()[:8] == struct.pack(">II", 2049, 12)
    ds = data.mnist(str(tmp_path), train=False, download=False)
    assert len(ds) == 12 and ds[7][1] == 7
    again = python("-m", "trainer.data", "fake-mnist", str(tmp_path), timeout=120)
    assert again.returncode == 2 and "never overwrites" in again.stderr


@pytest.mark.slow
def test_trainer_on_mnist_files(tmp_path):
    """configs/mnist.yaml (the tutorial's setup) on MNIST files made here, 2 processes."""
    from tests.helpers.outputs import rows
    from tests.helpers.run import train

    write_mnist(tmp_path / "mnist", 64)
    train(
        tmp_path / "run",
        2,
        f"data.path={tmp_path / 'mnist'}",
        "data.download=false",
        "train.steps=4",
        "train.rank_batch_size=8",
        "optim.step_size=2",
        "eval.interval=4",
        "eval.batches=2",
        "log.interval=1",
        "log.progress=false",
        config="configs/mnist.yaml",
    )
    logged = rows(tmp_path / "run")
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert logged[2]["lr"] == pytest.approx(0.7)  # StepLR: gamma after step_size steps
    evals = [
        r
        for r in map(__import__("json").loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "eval_loss" in r
    ]
    assert evals and 0 <= evals[0]["eval_accuracy"] <= 1


@pytest.mark.slow
def test_trainer_on_image_folder(tmp_path):
    """A torchvision model on an ImageFolder, 2 processes, bf16."""
    from PIL import Image

    from tests.helpers.outputs import rows
    from tests.helpers.run import train

    for cls in ("a", "b", "c"):
        (tmp_path / "images" / cls).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (36, 36), (80 * i, 60, 0)).save(tmp_path / "images" / cls / f"{i}.png")
    train(
        tmp_path / "run",
        2,
        "model.name=resnet18",
        "model.num_classes=3",
        "model.image_size=32",
        "data.name=imagefolder",
        f"data.path={tmp_path / 'images'}",
        "train.steps=2",
        "train.global_batch_size=8",
        "log.interval=1",
        "parallel.param_dtype=bfloat16",
        "log.progress=false",
    )
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2]


@pytest.mark.slow
def test_mnist_config_takes_the_tutorials_step(tmp_path):
    """configs/mnist.yaml on 2 processes does what the FSDP tutorial's program does: each rank sums
    the NLL loss over its own 64 samples, the gradients are averaged over the ranks, Adadelta (lr
    1.0) steps. Computed here in one process for comparison (dropout off: its masks are random)."""
    from tests.helpers.outputs import weights
    from tests.helpers.run import ROOT, train
    from trainer.config import load

    overrides = ["data.name=synthetic_images", "model.dropout=0", "train.steps=1", "log.progress=false"]
    train(tmp_path, 2, *overrides, config="configs/mnist.yaml")
    cfg = load(str(ROOT / "configs/mnist.yaml"), overrides)
    assert cfg.train.rank_batch_size == 64 and cfg.train.loss_reduction == "sum"

    torch.manual_seed(cfg.train.seed)  # the trainer's initial weights
    model = models.build(cfg.model)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    dataset = data.build(cfg.data, cfg.model, cfg.train.seed, train=True)
    for step in range(1):
        grads = []
        for rank in range(2):  # rank r takes samples [128 s + 64 r, 128 s + 64 (r + 1))
            batch = [dataset[128 * step + 64 * rank + i] for i in range(64)]
            x, y = torch.stack([b[0] for b in batch]), torch.tensor([b[1] for b in batch])
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2  # what FSDP's reduce-scatter does
        optimizer.step()
    got = weights(tmp_path)
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(got[name], expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
