"""The system tier of tests/unit/test_prepare.py, whose docstring says what both halves test."""

import json

import numpy as np
import pytest

from tests.helpers.outputs import rows
from tests.helpers.run import TINY, train
from tests.unit import test_prepare as unit
from tests.unit.test_prepare import EOS, prepare

inputs = unit.inputs  # the fixture, shared with the unit tests: a corpus, a tokenizer, token files

tokenizers = pytest.importorskip("tokenizers")


@pytest.mark.slow
def test_prepare_then_train_loss_falls_and_a_misfit_model_is_refused(inputs, tmp_path):
    folder, _, tok = inputs
    tokens = tmp_path / "train.bin"
    assert (
        prepare(
            folder / "a.jsonl",
            folder / "b.jsonl",
            "--tokenizer",
            folder,
            "--out",
            tokens,
            "--workers",
            "2",
            "--no-progress",
        ).returncode
        == 0
    )  # a folder holding tokenizer.json works too
    vocab = tok.get_vocab_size()
    common = [*TINY, "data.name=tokens", f"data.path={tokens}", "train.steps=40", "optim.warmup_steps=5"]
    train(tmp_path / "run", 2, *common, f"model.vocab_size={vocab}")
    logged = rows(tmp_path / "run")
    first, last = logged[0]["loss"], sum(r["loss"] for r in logged[-5:]) / 5
    assert last < 0.5 * first, f"loss went from {first} to {last}"

    proc = train(tmp_path / "small", 1, *common, f"model.vocab_size={vocab - 1}", expect=2)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"model.vocab_size: is {vocab - 1} but {tokens} was tokenized with" in lines[0]
    assert f"set model.vocab_size={vocab} or more" in lines[0]
    assert not (tmp_path / "small").exists()  # refused before anything was written

    proc = train(tmp_path / "wide", 1, *common, f"model.vocab_size={vocab}", "data.token_dtype=uint32", expect=2)
    assert "data.token_dtype: is uint32 but" in proc.stderr and "set data.token_dtype=uint16" in proc.stderr


@pytest.mark.slow
def test_a_folder_an_eval_split_and_the_vocabulary_from_the_sidecar(inputs, tmp_path):
    """A folder is every file below it (not "not found"); --eval-fraction holds documents out into
    the eval file; a run that sets no model.vocab_size takes the tokenizer's from the sidecar."""
    folder, docs, tok = inputs
    src = tmp_path / "docs"
    (src / "sub").mkdir(parents=True)
    for name in ("a.jsonl", "b.jsonl"):
        (src / name).write_text((folder / name).read_text())
    (src / "sub" / "c.txt").write_text((folder / "c.txt").read_text())
    (src / ".hidden").write_text("never read")
    out = tmp_path / "train.bin"
    proc = prepare(src, "--tokenizer", folder, "--out", out, "--eval-fraction", "0.1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    held = tmp_path / "train.eval.bin"
    assert f"set data.eval_path={held}" in proc.stdout
    eos_id = tok.token_to_id(EOS)
    train_ids, eval_ids = (np.fromfile(f, dtype=np.uint16).tolist() for f in (out, held))
    from trainer.prepare import held_out

    encode = [[*tok.encode(d, add_special_tokens=False).ids, eos_id] for d in docs]
    assert train_ids == [i for n, ids in enumerate(encode) if not held_out(n, 0.1) for i in ids]
    assert eval_ids == [i for n, ids in enumerate(encode) if held_out(n, 0.1) for i in ids]
    n_eval = json.loads((tmp_path / "train.eval.bin.json").read_text())["documents"]
    assert 75 <= n_eval <= 225 and json.loads((tmp_path / "train.bin.json").read_text())["documents"] == 1500 - n_eval

    train(
        tmp_path / "run",
        1,
        *TINY,
        "data.name=tokens",
        f"data.path={out}",
        f"data.eval_path={held}",
        "train.steps=2",
        "eval.interval=2",
        "eval.batches=1",
    )
    assert f"vocab_size: {tok.get_vocab_size()}" in (tmp_path / "run" / "config.yaml").read_text()
