"""Datasets and the global sample stream.

The order of samples is a pure function of (seed, global sample index): sample i of the run is item
`order(i)` of the dataset, whatever the number of processes. Optimizer step s consumes the global
indices [s·B, (s+1)·B); rank r takes the r-th contiguous slice of them. So a checkpoint only needs
the number of samples consumed to resume the exact stream on any number of processes. Several
token files mixed by weight (data.sources, Mixture) are one such dataset: its item i is a pure
function of (seed, i) too, and each source's passes (epochs) are counted from the samples consumed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from fractions import Fraction

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer import cli
from trainer.config import DataArgs, eval_data_problem, holds_out
from trainer.prepare import token_file_problem


class DataError(Exception):
    """A dataset that cannot be read; the message says which file and what to do."""


# ---------------------------------------------------------------------------------------------------
# Datasets. Each returns (input, target) for an index in [0, len).


class SyntheticLM(Dataset):
    """Token sequences from a fixed random Markov chain: every token has 4 possible successors.

    Needs no download and is learnable: the loss falls from ln(vocab) towards ln(4) ≈ 1.39.
    `len` is effectively infinite; item i is generated from (seed, i).
    """

    successors = 4

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        table = np.random.default_rng([seed, 0x5EED]).integers(0, vocab_size, (vocab_size, self.successors))
        self.table = table
        self._next = table.ravel().tolist()  # the walk below runs in plain Python: lists beat numpy scalars 10x

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, i: int):
        rng = np.random.default_rng([self.seed, int(i)])
        choices = rng.integers(0, self.successors, self.seq_len + 1).tolist()
        token = int(rng.integers(0, self.vocab_size))
        walk, nxt, k = [token], self._next, self.successors
        for choice in choices[1:]:
            token = nxt[token * k + choice]
            walk.append(token)
        tokens = torch.from_numpy(np.array(walk, dtype=np.int64))
        return tokens[:-1], tokens[1:]


def _sidecar_vouches(path: str, tokens: int, vocab_size: int) -> bool:
    """Whether trainer.prepare's sidecar of this very file (same token count) puts every id below vocab_size."""
    from trainer.prepare import read_sidecar

    try:
        info = read_sidecar(path) or {}
    except (OSError, ValueError):
        return False
    return info.get("tokens") == tokens and -1 <= info.get("max_id", vocab_size) < vocab_size


class TokenFile(Dataset):
    """A flat binary array of token ids (uint16 or uint32), memory-mapped, cut into windows.

    Every id must be below the vocabulary: one out of range would otherwise stop training in the
    middle with an IndexError, or on the GPU with a device assert. A file written by trainer.prepare
    has a sidecar that records its token count and largest id (checked before start, trainer/preflight/check.py);
    any other file is scanned when it is opened (a few seconds per GB; the page cache serves the
    ranks of one node after the first)."""

    CHUNK = 1 << 24  # tokens checked at a time

    def __init__(self, path: str, dtype: str, seq_len: int, vocab_size: int):
        problem = token_file_problem(path, dtype, seq_len)
        if problem:
            raise DataError(problem)
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.windows = (len(self.tokens) - 1) // seq_len
        if _sidecar_vouches(path, len(self.tokens), vocab_size):
            return
        for start in range(0, len(self.tokens), self.CHUNK):
            chunk = self.tokens[start : start + self.CHUNK]
            if chunk.max() >= vocab_size:
                i = int(np.argmax(chunk >= vocab_size))
                raise DataError(
                    f"token file {path}: token {start + i} (byte offset {(start + i) * chunk.itemsize}) is "
                    f"id {int(chunk[i])}, not below model.vocab_size={vocab_size}; raise model.vocab_size "
                    f"above the file's largest id, or check data.token_dtype"
                )

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, i: int):
        start = int(i) * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class SyntheticImages(Dataset):
    """Class-dependent noisy images (a fixed random pattern per class), for image models offline."""

    def __init__(self, num_classes: int, channels: int, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, channels, size, size, generator=g)
        self.seed = seed

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        label = int(torch.randint(len(self.patterns), (1,), generator=g))
        image = self.patterns[label] + torch.randn(self.patterns.shape[1:], generator=g)
        return image, label


# The four files torchvision's MNIST reads from <root>/MNIST/raw (uncompressed), with their idx magic.
MNIST_FILES = {
    "train-images-idx3-ubyte": 2051,
    "train-labels-idx1-ubyte": 2049,
    "t10k-images-idx3-ubyte": 2051,
    "t10k-labels-idx1-ubyte": 2049,
}


def mnist(root: str, train: bool, download: bool) -> Dataset:
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    raw = os.path.join(root, "MNIST", "raw")
    made, folder = [], os.path.abspath(raw)  # the folders a download creates, deepest first
    while not os.path.lexists(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    try:
        return datasets.MNIST(root, train=train, download=download, transform=transform)
    except (RuntimeError, OSError) as e:  # "Dataset not found", or every download mirror failed
        for folder in made:  # a failed download leaves nothing behind (empty folders only)
            try:
                os.rmdir(folder)
            except OSError:
                break
        why = " ".join(str(e).split())  # torchvision's message spans lines
        files = ", ".join(MNIST_FILES)
        if download:
            raise DataError(
                f"could not download MNIST into {root} ({why}); without internet, copy the MNIST files to "
                f"{raw} ({files}, uncompressed; or try generated digits: python -m trainer.data "
                f"fake-mnist {root})"
            ) from None
        raise DataError(
            f"MNIST not found under {raw} ({why}); set data.download=true or copy the files there "
            f"({files}, uncompressed)"
        ) from None


def write_fake_mnist(root: str, samples: int, seed: int = 0) -> str:
    """Generated images and labels in the four MNIST files' format under <root>/MNIST/raw (for trying
    the MNIST configs without the data set: the labels are i mod 10, the images noise)."""
    import struct

    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    images = np.random.default_rng(seed).integers(0, 255, (samples, 28, 28), dtype=np.uint8)
    labels = (np.arange(samples) % 10).astype(np.uint8)
    for name, magic in MNIST_FILES.items():
        path = os.path.join(raw, name)
        if os.path.lexists(path):
            raise DataError(f"{path} exists; fake-mnist never overwrites files: use an empty root")
        header = struct.pack(">IIII", magic, samples, 28, 28) if magic == 2051 else struct.pack(">II", magic, samples)
        with open(path, "xb") as f:
            f.write(header + (images if magic == 2051 else labels).tobytes())
    return raw


def image_folder(root: str, size: int, num_classes: int) -> Dataset:
    from torchvision import datasets, transforms

    if not os.path.isdir(root):
        raise DataError(f"image folder {root} not found; set data.path to a folder of class subfolders")
    transform = transforms.Compose(
        [
            transforms.Resize(size),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    try:
        dataset = datasets.ImageFolder(root, transform=transform)
    except FileNotFoundError as e:  # no class folders, or no image in any of them
        raise DataError(
            f"image folder {root}: {str(e).splitlines()[0].rstrip('.')}; put the images in one subfolder "
            f"per class ({root}/<class>/<image>.jpg)"
        ) from None
    if len(dataset.classes) > num_classes:
        raise DataError(
            f"image folder {root} has {len(dataset.classes)} class folders but model.num_classes is "
            f"{num_classes}; set model.num_classes={len(dataset.classes)}"
        )
    return dataset


# ---------------------------------------------------------------------------------------------------
# The part of a file or folder held out for evaluation (data.eval_fraction).


class Part(Dataset):
    """Items `indices` of `dataset`, as its items 0, 1, ...: what training reads of a token file or
    image folder, or the part held out of it for evaluation."""

    def __init__(self, dataset: Dataset, indices):
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.dataset[int(self.indices[int(i)])]


def held_out(length: int, fraction: float | None) -> int:
    """How many of `length` items data.eval_fraction holds out: rounded up, so at least one when it is
    set, from the decimal as written (0.01 of 300 is 3)."""
    if not fraction:
        return 0
    exact = Fraction(repr(float(fraction)))
    return -(-length * exact.numerator // exact.denominator)


def split(dataset: Dataset, fraction: float | None, where: str, spread: bool = False) -> tuple[Dataset, Dataset | None]:
    """(what training reads, the part held out for evaluation or None) of `dataset` (data.eval_fraction):
    its last items (a token file: one stretch of text, whose neighbours training reads as little as it
    can), or with `spread` every k-th item (an image folder in class order: each class gives its share).
    A pure function of the length and the fraction, which the run's config.yaml records: every start
    of the run holds out the same items, whatever the seed and the number of processes."""
    n, h = len(dataset), held_out(len(dataset), fraction)
    if not h:
        return dataset, None
    if h >= n:
        raise DataError(
            f"{where}: holding out data.eval_fraction={fraction:g} of its {n} items for evaluation leaves none to "
            f"train on; lower data.eval_fraction, or give data.eval_path"
        )
    if not spread:
        return Part(dataset, range(n - h)), Part(dataset, range(n - h, n))
    held = (np.arange(h) * n + n // 2) // h  # evenly spaced over the folder, the first a half step in
    rest = np.setdiff1d(np.arange(n), held)
    return Part(dataset, rest), Part(dataset, held)


# ---------------------------------------------------------------------------------------------------
# Several token files mixed by weight (data.sources).


def _shares(weights: list[float]) -> list[tuple[int, int]]:
    """Each source's share of what the sources before it leave, as (numerator, denominator): w_k /
    (w_k + ... + w_last), exact fractions of the weights as written (0.3 is 3/10); the last is 1."""
    exact = [Fraction(repr(float(w))) for w in weights]  # 0.3 as 3/10, the decimal given, not the float's binary
    shares, rest = [], sum(exact)
    for w in exact:
        share = w / rest
        shares.append((share.numerator, share.denominator))
        rest -= w
    return shares


def _counts(shares: list[tuple[int, int]], n: int) -> list[int]:
    """How many of n samples interleaved by `shares` each source gives."""
    out = []
    for num, den in shares[:-1]:
        out.append(num * n // den)
        n -= out[-1]
    return [*out, n]


class Mixture(Dataset):
    """Token files interleaved by weight: item i is global sample i of the run's stream.

    Which source sample i comes from is a pure function of i, computed for any i without replaying
    the stream (so a resume on any number of processes reads on exactly where the run stopped): the
    sources are split off one at a time, source k taking the share p_k = w_k / (w_k + ... + w_last)
    of what the sources before it left, and among the first n samples of a level it takes exactly
    floor(p_k·n). Every prefix of the stream so holds source k's weight share to within k + 1
    samples (k counted from 0): a low-discrepancy interleave (as Megatron's BlendedDataset's greedy one), not
    a random draw whose counts drift. The shares are exact fractions of the weights as written (0.3 is 3/10).
    Inside a source, its j-th sample is item perm(j // len)[j % len]: a fresh permutation per pass
    (epoch), drawn from (seed, source, epoch). `len` is effectively infinite, as generated data's:
    the sources wrap on their own.

    The interleave counts from the mixture's origin (`start`, `taken`): global sample `start`, where
    each source k had given taken[k] samples; 0 and none from the run's first step. A resume with
    other weights (or other files) moves the origin to where the checkpoint stopped (resume()), so
    that each source goes on from its own next sample, as Megatron's blended datasets keep a position
    per dataset: nothing of a pass read twice, nothing skipped."""

    def __init__(self, datasets: list[Dataset], weights: list[float], names: list[str], seed: int, paths=None):
        self.datasets, self.names, self.seed = datasets, names, seed
        self.paths = list(paths or names)  # the sources' files, as the config names them (resume() matches them)
        self.weights = list(weights)
        self.lengths = [len(d) for d in datasets]
        self.shares = _shares(weights)
        self.start, self.taken = 0, [0] * len(datasets)  # the origin
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, permutation) last used

    def __len__(self) -> int:
        return 2**62

    def locate(self, i: int) -> tuple[int, int]:
        """(source, that source's own sample index) of global sample i (at or after the origin)."""
        i -= self.start
        if i < 0:
            raise IndexError(f"global sample {i + self.start} is before the mixture's origin {self.start}")
        for k, (num, den) in enumerate(self.shares[:-1]):
            before = num * i // den  # source k's samples among the level's first i
            if num * (i + 1) // den > before:
                return k, self.taken[k] + before
            i -= before  # its place among what the later sources share
        return len(self.shares) - 1, self.taken[-1] + i

    def counts(self, n: int) -> list[int]:
        """How many of the first n global samples (n at or after the origin) each source gave."""
        if n < self.start:
            raise IndexError(f"{n} samples is before the mixture's origin {self.start}")
        return [t + c for t, c in zip(self.taken, _counts(self.shares, n - self.start))]

    def __getitem__(self, i: int):
        k, j = self.locate(int(i))
        epoch, pos = divmod(j, self.lengths[k])
        cached = self._perms.get(k)
        if cached is None or cached[0] != epoch:
            cached = epoch, np.random.default_rng([self.seed, 0x50C, k, epoch]).permutation(self.lengths[k])
            self._perms[k] = cached
        return self.datasets[k][int(cached[1][pos])]


MIXTURE = "mixture"  # meta.json's key of a mixture's origin (position())


def position(dataset: Dataset) -> dict:
    """What a checkpoint's meta.json keeps of the stream beside the samples consumed: a mixture's
    origin (resume() reads it); nothing for a single dataset."""
    if not isinstance(dataset, Mixture):
        return {}
    return {MIXTURE: {"start": dataset.start, "taken": list(dataset.taken)}}


def _saved_origin(meta: dict, sources: list, samples: int) -> list[int]:
    """How many samples each of the checkpoint's sources had given among the stream's first `samples`,
    from its meta.json (untrusted: a value not of its kind raises DataError): its origin and its
    config's weights; a checkpoint of a trainer before the origin was kept read its weights'
    interleave from sample 0."""
    where = f"checkpoint {meta.get('path', '?')}: meta.json's {MIXTURE}"
    origin = meta.get(MIXTURE, {"start": 0, "taken": [0] * len(sources)})

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    ok = isinstance(origin, dict) and set(origin) == {"start", "taken"} and count(origin["start"])
    ok = ok and isinstance(origin["taken"], list) and len(origin["taken"]) == len(sources)
    if not ok or not all(map(count, origin["taken"])) or origin["start"] > samples:
        raise DataError(f"{where} is {str(origin)[:80]}, not the origin a save writes; move that checkpoint away")
    weights = [s.get("weight") for s in sources]
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights):
        raise DataError(f"{where}: the config's data.sources weights {str(weights)[:80]} are not all positive numbers")
    given = _counts(_shares(weights), samples - origin["start"])
    return [t + c for t, c in zip(origin["taken"], given)]


def resume(dataset: Dataset, meta: dict | None) -> str | None:
    """Continue a mixture from the checkpoint `meta`: with the same files and weights, from the
    checkpoint's origin (the stream is the one never interrupted); with other weights or files, each
    source from the samples it had given (matched by file: a new file from its first), the new
    weights sharing the samples that follow. Returns the line to say for a change, else None."""
    if not isinstance(dataset, Mixture) or not meta:
        return None
    data = meta.get("config", {}).get("data", {}) if isinstance(meta.get("config"), dict) else {}
    sources = data.get("sources") if isinstance(data, dict) else None
    samples = meta["samples"]
    if not isinstance(sources, list) or not sources or not all(isinstance(s, dict) for s in sources):
        return None  # the checkpoint's run read one file: stream_change says so
    given = _saved_origin(meta, sources, samples)
    paths = [s.get("path") for s in sources]
    now = dataset.paths
    if paths == now and [s.get("weight") for s in sources] == dataset.weights:
        origin = meta.get(MIXTURE, {"start": 0, "taken": [0] * len(sources)})
        dataset.start, dataset.taken = origin["start"], list(origin["taken"])
        return None
    by_path = dict(zip(paths, given))
    dataset.start, dataset.taken = samples, [by_path.get(p, 0) for p in now]

    def printable(name) -> str:  # the checkpoint's bytes, never a terminal's escape sequence
        return "".join(c for c in str(name) if c.isprintable())

    before = ", ".join(f"{printable(p)} x{printable(s.get('weight'))}" for p, s in zip(paths, sources))
    after = ", ".join(f"{p} x{w}" for p, w in zip(now, dataset.weights))
    where = ", ".join(
        f"{name} from its sample {t}" + ("" if p in by_path else " (new)")
        for name, p, t in zip(dataset.names, now, dataset.taken)
    )
    return (
        f"the mixture changed since the checkpoint ({before} -> {after}): from sample {samples} on each source "
        f"goes on from where it was ({where}) and the new weights share what follows; each pass reads every "
        f"sample of a source once"
    )


class EvalSources(dict):
    """The per-source evaluation sets of a mixture, {source name: dataset}, with the sources' weights
    (the evaluation's overall eval_loss is their weighted mean)."""

    def __init__(self, sets: dict, weights: dict):
        super().__init__(sets)
        self.weights = weights


def _mixture(args: DataArgs, model_args, seed: int, train: bool) -> Dataset:
    """data.sources' training mixture, or its evaluation set: data.eval_path's file, else per source
    (EvalSources) its own eval_path file or the part data.eval_fraction holds out of it. A source
    with an evaluation file of its own holds nothing out."""
    from trainer.models import transformer_shape

    seq_len, vocab = model_args.seq_len, transformer_shape(model_args).vocab_size
    if not train and args.eval_path:
        return TokenFile(args.eval_path, args.token_dtype, seq_len, vocab)
    fraction = 0.0 if args.eval_path else args.eval_fraction
    parts = [
        split(TokenFile(s.path, args.token_dtype, seq_len, vocab), 0.0 if s.eval_path else fraction, s.path)
        for s in args.sources
    ]
    if train:
        weights, names = [s.weight for s in args.sources], [s.label for s in args.sources]
        return Mixture([p[0] for p in parts], weights, names, seed, [s.path for s in args.sources])
    sets = {
        s.label: TokenFile(s.eval_path, args.token_dtype, seq_len, vocab) if s.eval_path else held
        for s, (_, held) in zip(args.sources, parts)
        if s.eval_path or held is not None
    }
    if not sets:
        raise DataError(eval_data_problem(args))
    return EvalSources(sets, {s.label: s.weight for s in args.sources if s.label in sets})


def passes(dataset: Dataset, samples: int) -> dict[str, tuple[int, int]]:
    """{source name: (samples it gave, its length)} after the first `samples` of the stream, for each
    finite source; a single dataset's name is "". Generated (endless) data has none."""
    if isinstance(dataset, Mixture):
        return {n: (c, length) for n, c, length in zip(dataset.names, dataset.counts(samples), dataset.lengths)}
    if len(dataset) >= 2**62:
        return {}
    return {"": (samples, len(dataset))}


def epochs(dataset: Dataset, samples: int) -> dict[str, float]:
    """The passes made over each source after `samples`, as a training row's fields: `epoch` for a
    single dataset, `epoch/<name>` for each source of a mixture."""
    return {("epoch/" + n if n else "epoch"): taken / length for n, (taken, length) in passes(dataset, samples).items()}


def epoch_starts(dataset: Dataset, before: int, after: int) -> list[tuple[str, int]]:
    """(source name, epoch) for each epoch (counted from 0) after the first that a source starts
    among global samples [before, after): its sample epoch x len is read there."""
    starts = []
    then = passes(dataset, before)
    for name, (taken, length) in passes(dataset, after).items():
        first = max(1, -(-then[name][0] // length))  # the first epoch whose start is not behind us
        starts += [(name, e) for e in range(first, (taken - 1) // length + 1)]
    return starts


def stream_change(saved: dict, args: DataArgs, step: int) -> str | None:
    """The line for a resume whose training files differ from the checkpoint's (`saved`: its config, as
    to_dict wrote it), or whose held-out part does, or None: the stream goes on at the same position,
    over the new files, so what each step reads from here is not what the old config would have read.
    A mixture resumed as a mixture is resume()'s: each source goes on from its own position."""

    def files(data) -> list:
        if not isinstance(data, dict):
            return []
        sources = data.get("sources") or []
        if not isinstance(sources, (list, tuple)) or not all(isinstance(s, dict) for s in sources):
            return ["?"]
        return [data.get("path")] if data.get("path") else [f"{s.get('path')} x{s.get('weight')}" for s in sources]

    def printable(name) -> str:  # the checkpoint's bytes, never a terminal's escape sequence
        return "".join(c for c in str(name) if c.isprintable())

    before = [printable(f) for f in files(saved.get("data"))] if isinstance(saved, dict) else []
    now = files({"path": args.path, "sources": [{"path": s.path, "weight": s.weight} for s in args.sources]})
    held = saved.get("data", {}).get("eval_fraction") if isinstance(saved.get("data"), dict) else None
    held = held if isinstance(held, (int, float)) and not isinstance(held, bool) else 0  # older runs: none
    if holds_out(args) and held != (args.eval_fraction or 0):
        return (
            f"data.eval_fraction is {args.eval_fraction or 0:g}, the checkpoint's run held out {held:g}: from step "
            f"{step} on training reads {'less' if (args.eval_fraction or 0) > held else 'more'} of each file, in "
            f"another order, at the same position in its stream; evaluation reads the new held-out part"
        )
    was_mixture = isinstance(saved.get("data"), dict) and not saved["data"].get("path") and saved["data"].get("sources")
    if not before or before == now or (args.sources and was_mixture):  # mixture to mixture: resume()'s line
        return None
    return (
        f"the training data changed since the checkpoint ({', '.join(before)} -> {', '.join(now)}): "
        f"from step {step} on the run reads the new data at the same position in its stream, and counts each "
        f"file's epochs as if it had been read so from the start"
    )


def build(args: DataArgs, model_args, seed: int, train: bool) -> Dataset:
    """The training (or evaluation) dataset for this config."""
    from trainer.models import transformer_shape

    if args.sources:
        return _mixture(args, model_args, seed, train)
    path = args.path if train else (args.eval_path or args.path)
    if args.name == "synthetic":
        vocab = transformer_shape(model_args).vocab_size
        return SyntheticLM(vocab, model_args.seq_len, seed)
    if args.name == "mnist":  # its own test split
        return mnist(path, train=train, download=args.download)
    if args.name in ("tokens", "imagefolder"):
        if args.name == "tokens":
            dataset = TokenFile(path, args.token_dtype, model_args.seq_len, transformer_shape(model_args).vocab_size)
        else:
            dataset = image_folder(path, model_args.image_size, model_args.num_classes)
        if args.eval_path:  # a file or folder of its own for evaluation: training reads all of data.path
            return dataset
        part, held = split(dataset, args.eval_fraction, path, spread=args.name == "imagefolder")
        if not train and held is None:
            raise DataError(eval_data_problem(args))
        return part if train else held
    from trainer.models import spec

    channels, size, _ = spec(model_args).input_shape(model_args)
    return SyntheticImages(model_args.num_classes, channels, size, seed)


# ---------------------------------------------------------------------------------------------------
# The global sample stream.


class StreamOrder:
    """Maps a global sample index to a dataset index: a fresh permutation of the dataset per epoch,
    drawn from (seed, epoch). Infinite (generated) datasets are read in order."""

    def __init__(self, length: int, seed: int):
        self.length, self.seed = length, seed
        self._epoch, self._perm = -1, None

    def __call__(self, i: int) -> int:
        if self.length >= 2**62:
            return i
        epoch, pos = divmod(i, self.length)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.length, generator=g)
        return int(self._perm[pos])


class Indexed(Dataset):
    """Wraps a dataset so that item `i` is global sample i of the stream: (input, target, i)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.order = dataset, StreamOrder(len(dataset), seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        x, y = self.dataset[self.order(i)]
        return x, y, i


class RankSlice(Sampler[int]):
    """This rank's global sample indices from `start` on: for each optimizer step, the rank's
    contiguous slice of that step's global batch."""

    def __init__(self, start: int, global_batch: int, rank: int, world_size: int):
        self.start, self.global_batch = start, global_batch
        self.per_rank = global_batch // world_size
        self.offset = rank * self.per_rank

    def __iter__(self) -> Iterator[int]:
        step_start = self.start
        while True:
            base = step_start + self.offset
            yield from range(base, base + self.per_rank)
            step_start += self.global_batch


def loader(
    dataset: Dataset,
    args: DataArgs,
    seed: int,
    start: int,
    global_batch: int,
    micro_batch: int,
    rank: int,
    world_size: int,
) -> Iterator:
    """An endless iterator of this rank's micro-batches (input, target, global indices)."""
    sampler = RankSlice(start, global_batch, rank, world_size)
    return iter(
        DataLoader(
            Indexed(dataset, seed),
            batch_size=micro_batch,
            sampler=sampler,
            num_workers=args.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=args.num_workers > 0,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("trainer.data", "Data helpers.")
    sub = parser.add_subparsers(dest="command", required=True)
    fake = sub.add_parser("fake-mnist", help="write generated digits in MNIST's file format to ROOT/MNIST/raw")
    fake.add_argument("root", help="the data.path of the MNIST config, e.g. data/mnist")
    fake.add_argument("--samples", type=int, default=1000, help="images in each of the train and test files")
    args = parser.parse_args(argv)
    if args.samples < 1:
        print(f"error: --samples is {args.samples}; it must be at least 1", file=sys.stderr)
        return 2
    try:
        raw = write_fake_mnist(args.root, args.samples)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.samples} generated images per split to {raw} ({', '.join(MNIST_FILES)}); "
        f"train with data.path={args.root} data.download=false"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
