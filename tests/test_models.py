"""Each model builds and takes a real optimizer step; the datasets read real files made here."""

import struct

import numpy as np
import pytest
import torch

from trainer import data, models
from trainer.models import ModelArgs

SMALL_IMAGES = dict(image_size=32, num_classes=4)


@pytest.mark.parametrize(
    "args, x, y",
    [
        (ModelArgs(name="mnist_cnn", dropout=0.25), torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))),
        (
            ModelArgs(name="transformer", size="tiny", seq_len=16),
            torch.randint(0, 256, (2, 16)),
            torch.randint(0, 256, (2, 16)),
        ),
        (ModelArgs(name="resnet18", **SMALL_IMAGES), torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2,))),
        (ModelArgs(name="mobilenet_v3_small", **SMALL_IMAGES), torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2,))),
    ],
    ids=["mnist_cnn", "transformer", "resnet18", "mobilenet_v3_small"],
)
def test_model_takes_a_step(args, x, y):
    torch.manual_seed(0)
    model = models.build(args)
    if args.name == "transformer":
        model.init_weights(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = models.loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if b.grad is not None)
    assert models.blocks(model), "per-block wrapping needs blocks"


def test_transformer_sizes_have_the_advertised_parameter_counts():
    with torch.device("meta"):
        counts = {size: models.build(ModelArgs(size=size)).num_params(exclude_embedding=False) for size in ("1b", "8b")}
    assert 1.0e9 < counts["1b"] < 1.3e9
    assert 7.8e9 < counts["8b"] < 8.2e9


def test_init_does_not_depend_on_seed_order():
    a = models.build(ModelArgs(seq_len=8))
    b = models.build(ModelArgs(seq_len=8))
    torch.manual_seed(123)  # the global RNG plays no part
    a.init_weights(seed=5)
    b.init_weights(seed=5)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_synthetic_lm_is_deterministic_and_follows_its_chain():
    ds = data.SyntheticLM(vocab_size=50, seq_len=20, seed=3)
    x1, y1 = ds[12345]
    x2, y2 = ds[12345]
    assert torch.equal(x1, x2) and torch.equal(x1[1:], y1[:-1])
    for prev, nxt in zip(x1.tolist(), y1.tolist()):
        assert nxt in ds.table[prev]
    assert not torch.equal(ds[1][0], ds[2][0])


def test_token_file(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    ds = data.TokenFile(str(path), "uint16", seq_len=10, vocab_size=1000)
    assert len(ds) == 99
    x, y = ds[3]
    assert x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))


def test_stream_order_is_a_permutation_per_epoch():
    order = data.StreamOrder(length=7, seed=1)
    first, second = [order(i) for i in range(7)], [order(i) for i in range(7, 14)]
    assert sorted(first) == sorted(second) == list(range(7))
    assert first != second  # reshuffled each epoch
    assert [data.StreamOrder(7, 1)(i) for i in range(14)] == first + second  # a pure function


def test_rank_slices_tile_each_global_batch():
    for world in (1, 2, 3, 4):
        got = sorted(i for r in range(world) for i, _ in zip(data.RankSlice(24, 12, r, world), range(24 // world)))
        assert got == list(range(24, 48))


def write_mnist(root, n: int) -> None:
    data.write_fake_mnist(str(root), n)


@pytest.mark.slow  # an interpreter of trainer.data
def test_fake_mnist_is_the_idx_format_the_reader_takes(tmp_path):
    """The command a user without internet runs: its files are what torchvision's MNIST reads."""
    from conftest import python

    proc = python("-m", "trainer.data", "fake-mnist", str(tmp_path), "--samples", "12", timeout=120)
    assert proc.returncode == 0, proc.stderr
    raw = tmp_path / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(data.MNIST_FILES)
    assert (raw / "t10k-labels-idx1-ubyte").read_bytes()[:8] == struct.pack(">II", 2049, 12)
    ds = data.mnist(str(tmp_path), train=False, download=False)
    assert len(ds) == 12 and ds[7][1] == 7
    again = python("-m", "trainer.data", "fake-mnist", str(tmp_path), timeout=120)
    assert again.returncode == 2 and "never overwrites" in again.stderr


def test_mnist_reads_the_idx_files(tmp_path):
    write_mnist(tmp_path, 20)
    ds = data.mnist(str(tmp_path), train=True, download=False)
    x, y = ds[3]
    assert len(ds) == 20 and x.shape == (1, 28, 28) and y == 3


def test_mnist_missing_says_where(tmp_path):
    with pytest.raises(data.DataError, match=f"MNIST not found under {tmp_path}"):
        data.mnist(str(tmp_path), train=True, download=False)


def test_mnist_download_failure_says_what_to_do(tmp_path, monkeypatch):
    from torchvision import datasets

    monkeypatch.setattr(datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])  # nothing listens there
    with pytest.raises(
        data.DataError, match=f"could not download MNIST into {tmp_path} .*copy the MNIST files to {tmp_path}/MNIST/raw"
    ):
        data.mnist(str(tmp_path), train=True, download=True)
    root = tmp_path / "data" / "mnist"  # not there yet: a failed download creates nothing
    with pytest.raises(
        data.DataError,
        match="train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte",
    ) as e:
        data.mnist(str(root), train=True, download=True)
    assert f"python -m trainer.data fake-mnist {root}" in str(e.value)
    assert not (tmp_path / "data").exists()


def test_image_folder(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.new("RGB", (40, 30), (i * 50, 0, 0)).save(tmp_path / cls / f"{i}.png")
    ds = data.image_folder(str(tmp_path), size=32, num_classes=2)
    x, y = ds[4]
    assert len(ds) == 6 and x.shape == (3, 32, 32) and y == 1


@pytest.mark.slow
def test_trainer_on_mnist_files(tmp_path):
    """configs/mnist.yaml (the tutorial's setup) on MNIST files made here, 2 processes."""
    from conftest import rows, train

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

    from conftest import rows, train

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
    from conftest import train, weights
    from trainer.config import load

    overrides = ["data.name=synthetic_images", "model.dropout=0", "train.steps=1", "log.progress=false"]
    train(tmp_path, 2, *overrides, config="configs/mnist.yaml")
    cfg = load(str(__import__("conftest").ROOT / "configs/mnist.yaml"), overrides)
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
