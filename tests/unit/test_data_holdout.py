"""Evaluation reads data that training never reads (issue #42 item 1). Without data.eval_path, a
token file's evaluation read data.path from sample 0 (its first batch was the first training batch,
element for element), a mixture's wrapped onto training samples and an image folder's was the
training folder. Now data.eval_fraction holds a fixed part out: a token file's last sequences, every
k-th image of a folder, the last sequences of each source of a mixture without its own eval_path;
0.01 when a run that evaluates starts, recorded in its config.yaml so that every resume keeps it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.bad_input import refused
from tests.helpers.run import ROOT
from trainer.config import load, resolve
from trainer.data import DataError, EvalSources, Indexed, Mixture, StreamOrder, build
from trainer.preflight import check

SEQ = 32
TOKENS = ["data.name=tokens", "model.vocab_size=256", f"model.seq_len={SEQ}"]


def token_file(path, windows: int, seed: int):
    np.random.default_rng(seed).integers(0, 256, windows * SEQ + 1).astype(np.uint16).tofile(path)
    return path


def window(path, w: int) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16)[w * SEQ : w * SEQ + SEQ].astype(np.int64))


def windows_of(dataset, path, n: int, *more) -> list:
    """The file's window that each item of `dataset` is (its input compared with every window); with
    `more` files (path, n, ...): (file, window) pairs, the files counted from 0."""
    files = [(path, n), *zip(more[::2], more[1::2])]
    every = [(f, w, window(p, w)) for f, (p, count) in enumerate(files) for w in range(count)]
    found = [next((f, w) for f, w, x in every if torch.equal(x, dataset[i][0])) for i in range(len(dataset))]
    return [w for _, w in found] if not more else found


def test_a_token_file_without_eval_path_holds_out_its_last_sequences(tmp_path):
    path = token_file(tmp_path / "train.bin", 300, 1)
    cfg = resolve(load(None, [*TOKENS, f"data.path={path}", "eval.interval=5"]))
    assert cfg.data.eval_fraction == 0.01  # resolved once, as config.yaml records it
    train_set = build(cfg.data, cfg.model, 0, train=True)
    eval_set = build(cfg.data, cfg.model, 0, train=False)
    assert (len(train_set), len(eval_set)) == (297, 3)  # 1% of 300
    assert windows_of(eval_set, path, 300) == [297, 298, 299]
    # the evaluation's first batch is not the training's first batch (it was, element for element)
    first_train, first_eval = Indexed(train_set, 0)[0][0], Indexed(eval_set, 0)[0][0]
    assert not torch.equal(first_train, first_eval)
    # training reads every window but the held-out ones, over its passes
    order = StreamOrder(len(train_set), 0)
    assert {train_set.indices[order(i)] for i in range(3 * 297)} == set(range(297))


def test_the_fraction_is_resolved_once_and_only_where_it_applies(tmp_path):
    path = token_file(tmp_path / "t.bin", 10, 2)
    fraction = lambda *o: resolve(load(None, [*TOKENS, f"data.path={path}", *o])).data.eval_fraction
    assert fraction("eval.interval=5") == 0.01
    assert fraction() == 0.0  # no evaluation: training reads the whole file
    assert fraction("eval.interval=5", f"data.eval_path={path}") == 0.0  # a file of its own
    assert fraction("eval.interval=5", "data.eval_fraction=0.2") == 0.2
    assert resolve(load(None, ["eval.interval=5"])).data.eval_fraction == 0.0  # generated data: its far range
    cfg = resolve(load(None, [*TOKENS, f"data.path={path}", "data.eval_fraction=0.1"]))  # set without evaluation
    assert (len(build(cfg.data, cfg.model, 0, True)), len(build(cfg.data, cfg.model, 0, False))) == (9, 1)


def test_an_image_folder_holds_out_every_kth_image_so_each_class_gives_its_share(tmp_path):
    from PIL import Image

    for c, cls in enumerate(["cat", "dog", "eel"]):
        (tmp_path / "img" / cls).mkdir(parents=True)
        for i in range(10):
            Image.new("RGB", (8, 8), (c * 80, i * 20, 0)).save(tmp_path / "img" / cls / f"{i}.png")
    over = [
        "model.name=resnet18",
        "model.num_classes=3",
        "model.image_size=8",
        "data.name=imagefolder",
        f"data.path={tmp_path / 'img'}",
        "eval.interval=5",
        "data.eval_fraction=0.2",
    ]
    cfg = resolve(load(None, over))
    train_set = build(cfg.data, cfg.model, 0, train=True)
    eval_set = build(cfg.data, cfg.model, 0, train=False)
    held, kept = list(eval_set.indices), list(train_set.indices)
    assert len(held) == 6 and len(kept) == 24 and not set(held) & set(kept)
    assert sorted(eval_set[i][1] for i in range(6)) == [0, 0, 1, 1, 2, 2]  # two of each class
    assert torch.equal(eval_set[0][0], train_set.dataset[held[0]][0])  # the folder's own images


def test_a_mixture_without_eval_paths_holds_out_the_end_of_each_source(tmp_path):
    web, code = token_file(tmp_path / "web.bin", 100, 3), token_file(tmp_path / "code.bin", 50, 4)
    mix = f"data.sources=[{{path: {web}, weight: 0.7}}, {{path: {code}, weight: 0.3, name: code}}]"
    cfg = resolve(load(None, [*TOKENS, mix, "eval.interval=5", "data.eval_fraction=0.1"]))
    train_set, eval_set = build(cfg.data, cfg.model, 0, True), build(cfg.data, cfg.model, 0, False)
    assert isinstance(train_set, Mixture) and train_set.lengths == [90, 45]
    assert isinstance(eval_set, EvalSources) and eval_set.weights == {"web": 0.7, "code": 0.3}
    assert windows_of(eval_set["web"], web, 100) == list(range(90, 100))
    assert windows_of(eval_set["code"], code, 50) == list(range(45, 50))
    read = windows_of([train_set[i] for i in range(1000)], web, 100, code, 50)  # over 7 passes of each
    assert {w for k, w in read if k == 0} == set(range(90)) and {w for k, w in read if k == 1} == set(range(45))


def test_evaluation_with_nothing_held_out_is_refused_in_one_line(capsys, tmp_path):
    path = token_file(tmp_path / "t.bin", 10, 5)
    line = refused(capsys, tmp_path / "run", *TOKENS, f"data.path={path}", "eval.interval=5", "data.eval_fraction=0")
    assert line == (
        "error: override 'eval.interval=5': eval.interval: is 5, but evaluation needs data that training does not "
        "read: data.eval_path is not set and data.eval_fraction is 0; give data.eval_path, or set "
        "data.eval_fraction=0.01 to hold out 1% of data.path's sequences (training then never reads them)"
    )
    # a fraction that leaves nothing to train on: a DataError (bad input: the ranks' one line, exit 2,
    # before the run dir is touched, as every DataError)
    one = token_file(tmp_path / "one.bin", 1, 6)
    cfg = resolve(load(None, [*TOKENS, f"data.path={one}", "eval.interval=5"]))
    with pytest.raises(DataError) as e:
        build(cfg.data, cfg.model, 0, train=True)
    assert str(e.value) == (
        f"{one}: holding out data.eval_fraction=0.01 of its 1 items for evaluation leaves none to train on; lower "
        f"data.eval_fraction, or give data.eval_path"
    )


def test_make_check_says_what_evaluation_reads(capsys, tmp_path):
    """`make check ... eval.interval=5 train.early_stop_patience=2` said `config OK` while evaluation
    (and so early stopping) would read the training data; it says what evaluation reads now."""
    path = token_file(tmp_path / "t.bin", 300, 8)
    argv = ["--config", str(ROOT / "configs/default.yaml"), f"run_dir={tmp_path / 'run'}", *TOKENS]
    assert check.main([*argv, f"data.path={path}", "eval.interval=5", "train.early_stop_patience=2"]) == 0
    assert (
        f"evaluation: every 5 steps on the last 1% of {path}'s sequences (data.eval_fraction=0.01), which training "
        "never reads"
    ) in capsys.readouterr().out.splitlines()
    held = token_file(tmp_path / "code.eval.bin", 10, 9)
    mix = f"data.sources=[{{path: {path}, name: web}}, {{path: {path}, eval_path: {held}, name: code}}]"
    assert check.main([*argv, mix, "eval.interval=5", "data.eval_fraction=0.1"]) == 0
    assert (
        f"evaluation: every 5 steps on each source's own (web: the last 10% of {path}; code: {held}), which training "
        "never reads"
    ) in capsys.readouterr().out.splitlines()
