"""trainer.prepare with a real tokenizer trained here on the fly (nothing is downloaded): the token
file holds each document's tokens and an end-of-document token, in order; the trainer learns from
it; a sidecar that does not fit the model stops the start with one line."""

import json
import os
import subprocess

import numpy as np
import pytest

from tests.helpers.inputs import corpus
from tests.helpers.run import python

tokenizers = pytest.importorskip("tokenizers")

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A BPE tokenizer.json trained on the corpus, two .jsonl files and a plain text file."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("prepare")
    docs = corpus(1500)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:700]))
    (folder / "b.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[700:1499]))
    )
    (folder / "c.txt").write_text(docs[1499])
    return folder, docs, tok


def prepare(*args) -> subprocess.CompletedProcess:
    return python("-m", "trainer.prepare", *map(str, args), timeout=300)


def test_tokens_in_order_with_an_end_of_document_token_between(inputs, tmp_path):
    folder, docs, tok = inputs
    out = tmp_path / "train.bin"
    proc = prepare(
        folder / "a.jsonl",
        folder / "b.jsonl",
        folder / "c.txt",
        "--tokenizer",
        folder / "tokenizer.json",
        "--out",
        out,
        "--workers",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    assert "100.0%" in proc.stderr  # the progress bar reached the end
    eos_id = tok.token_to_id(EOS)
    expected = [i for d in docs for i in [*tok.encode(d, add_special_tokens=False).ids, eos_id]]
    got = np.fromfile(out, dtype=np.uint16)
    assert got.tolist() == expected
    sidecar = json.loads((tmp_path / "train.bin.json").read_text())
    assert sidecar["vocab_size"] == tok.get_vocab_size() and sidecar["dtype"] == "uint16"
    assert sidecar["tokens"] == len(expected) and sidecar["max_id"] == max(expected) and sidecar["documents"] == 1500
    assert sidecar["eos_token"] == EOS and sidecar["tokenizer"] == str(folder / "tokenizer.json")


def test_bad_input_is_one_line(inputs, tmp_path):
    folder, _, _ = inputs
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    proc = prepare(
        tmp_path / "bad.jsonl", "--tokenizer", folder / "tokenizer.json", "--out", tmp_path / "x.bin", "--no-progress"
    )
    assert (
        proc.returncode == 2
        and f"error: {tmp_path / 'bad.jsonl'}:2: expected a JSON object with a 'text' string" in proc.stderr
    )
    assert not list(tmp_path.glob("x.bin*"))  # nothing half-written
    proc = prepare(
        folder / "c.txt", "--tokenizer", folder / "tokenizer.json", "--out", tmp_path / "x.bin", "--eos", "<nope>"
    )
    assert proc.returncode == 2 and "--eos '<nope>' is not a token of" in proc.stderr


def test_the_sidecar_of_the_same_file_spares_the_id_scan(tmp_path):
    """Opening a token file scans every id unless trainer.prepare's sidecar of that very file (same
    token count) records its largest id: a corpus of hundreds of GB is not read at each start. A
    sidecar of another file (count differs) is not trusted. (The sidecar here lies on purpose: that
    the bad id goes unseen proves the scan was skipped.)"""
    from trainer.data import DataError, TokenFile

    path = tmp_path / "tokens.bin"
    np.array([1, 2, 3, 99, 4, 5, 6, 7, 8], dtype=np.uint16).tofile(path)
    sidecar = {"tokenizer": "t", "vocab_size": 50, "dtype": "uint16", "tokens": 9, "max_id": 8}
    (tmp_path / "tokens.bin.json").write_text(json.dumps(sidecar))
    assert len(TokenFile(str(path), "uint16", 4, vocab_size=50)) == 2
    (tmp_path / "tokens.bin.json").write_text(json.dumps({**sidecar, "tokens": 8}))
    with pytest.raises(DataError, match=r"token 3 \(byte offset 6\) is id 99, not below model.vocab_size=50"):
        TokenFile(str(path), "uint16", 4, vocab_size=50)


@pytest.mark.parametrize("kind", ["link", "fifo", "not a tokenizer"])
def test_a_tokenizer_named_by_a_sidecar_is_read_only_as_a_regular_tokenizer_file(tmp_path, kind):
    """#32 item 4: export.read_tokenizer reads no link (but the hub cache's), no FIFO (without
    blocking), and nothing that does not load as a tokenizer: one line naming the sidecar and the path."""
    from trainer.commands.export import read_tokenizer
    from trainer.config import ConfigError

    secret = tmp_path / "secret"
    secret.write_text("the victim's key\n")
    path = tmp_path / "tokenizer.json"
    if kind == "link":
        path.symlink_to(secret)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError) as e:
        read_tokenizer(str(path), "data.bin.json")
    assert str(e.value).startswith(f"data.bin.json names the tokenizer {path}, ") and "\n" not in str(e.value)
