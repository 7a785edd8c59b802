"""Each model builds and takes a real optimizer step; the datasets read real files made here."""

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
