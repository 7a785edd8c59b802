"""Several token files mixed by weight (data.sources): the mixture's proportions, one global sample
stream whatever the number of processes, exact resume on another number of processes, each source's
epochs counted in rows and the live line, per-source evaluation rows, and a clear refusal for each
bad config."""

import json
import subprocess

import numpy as np
import pytest
import torch

from tests.helpers.bad_input import refused
from tests.helpers.run import PYTHON, ROOT, env
from trainer.config import load
from trainer.data import Indexed, Mixture, RankSlice, build, epoch_starts, epochs, passes
from trainer.observe import metrics
from trainer.preflight import check

SEQ = 32  # model.seq_len of TINY


class Numbered(torch.utils.data.Dataset):
    """A finite dataset whose item j says where it comes from: (source, j)."""

    def __init__(self, source: int, length: int):
        self.source, self.length = source, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, j: int):
        return self.source, int(j)


def mixture(weights, lengths, seed: int = 0) -> Mixture:
    return Mixture(
        [Numbered(k, n) for k, n in enumerate(lengths)], weights, [f"s{k}" for k in range(len(lengths))], seed
    )


# -- the stream, as pure functions ------------------------------------------------------------------


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [3.0, 1.0, 1e-3, 2.5]])
def test_every_prefix_holds_the_weights_to_within_as_many_samples_as_sources(weights):
    m = mixture(weights, [97, 13, 5, 41][: len(weights)])
    total = sum(weights)
    seen = [0] * len(weights)
    for n in range(1, 20_001):  # the items themselves, counted one by one
        seen[m[n - 1][0]] += 1
        if n % 997 == 0 or n == 20_000:
            assert seen == m.counts(n)
            for k, w in enumerate(weights):
                assert abs(seen[k] - w / total * n) <= len(weights), (n, k, seen)
    # and far into the stream, computed without replaying it
    n = 10**15 + 12345
    for k, (c, w) in enumerate(zip(m.counts(n), weights)):
        assert abs(c - w / total * n) <= len(weights), k


def test_decimal_weights_are_exact():
    """0.3 and 0.2 are not binary fractions; their shares must still be exact: 20, 12, 8 of 40."""
    assert mixture([0.5, 0.3, 0.2], [7, 5, 3]).counts(40) == [20, 12, 8]
    assert mixture([0.5, 0.3, 0.2], [7, 5, 3]).counts(10**6) == [500_000, 300_000, 200_000]


def test_each_pass_over_a_source_reads_each_of_its_samples_once_in_a_new_order():
    m = mixture([0.7, 0.3], [50, 20], seed=3)
    by_source: dict[int, list[int]] = {0: [], 1: []}
    for i in range(1000):
        k, j = m[i]
        by_source[k].append(j)
    assert len(by_source[1]) >= 5 * 20
    passes_of_1 = [by_source[1][e * 20 : (e + 1) * 20] for e in range(5)]
    assert all(sorted(p) == list(range(20)) for p in passes_of_1)
    assert len({tuple(p) for p in passes_of_1}) == 5  # a fresh permutation per epoch


def test_the_stream_is_a_function_of_the_seed_and_the_index():
    a, b = mixture([0.7, 0.3], [50, 20], seed=1), mixture([0.7, 0.3], [50, 20], seed=1)
    indices = [*range(300), 10**12, 2**61 + 5, 7, 3]  # any order: nothing depends on what was read before
    assert [a[i] for i in indices] == [b[i] for i in reversed(indices)][::-1]
    other = mixture([0.7, 0.3], [50, 20], seed=2)
    assert [a[i][0] for i in range(300)] == [other[i][0] for i in range(300)]  # the interleave is the weights'
    assert [a[i] for i in range(300)] != [other[i] for i in range(300)]  # the order inside a source, the seed's


def stream(world_size: int, start: int, steps: int, global_batch: int = 12) -> list[list]:
    """Each step's samples, over all ranks in rank order, as the training loop's loader cuts them."""
    m = Indexed(mixture([0.7, 0.3], [50, 20], seed=5), seed=5)
    per_rank = [iter(RankSlice(start, global_batch, r, world_size)) for r in range(world_size)]
    out = []
    for _ in range(steps):
        out.append([m[next(it)][:2] for it in per_rank for _ in range(global_batch // world_size)])
    return out


def test_the_stream_is_the_same_on_1_2_and_3_ranks_and_from_any_step():
    one = stream(1, 0, 20)
    assert stream(2, 0, 20) == one
    assert stream(3, 0, 20) == one
    for resume_at in (1, 7, 13):
        assert stream(3, resume_at * 12, 20 - resume_at) == one[resume_at:]
        assert stream(2, resume_at * 12, 20 - resume_at) == one[resume_at:]


def test_epoch_starts_each_once_whatever_the_steps():
    m = mixture([0.7, 0.3], [50, 20])
    B = 12
    starts = [(s, *e) for s in range(1, 41) for e in epoch_starts(m, (s - 1) * B, s * B)]
    names = [(name, e) for _, name, e in starts]
    assert len(names) == len(set(names))
    assert {e for _, name, e in starts if name == "s0"} == set(range(1, int(40 * B * 0.7) // 50 + 1))
    for s, name, e in starts:  # the step that reads the epoch's first sample
        taken = passes(m, s * B)[name][0]
        before = passes(m, (s - 1) * B)[name][0]
        length = passes(m, 0)[name][1]
        assert before <= e * length < taken
    # one call over many steps finds the same starts (a step bigger than a source's pass, too)
    assert sorted(epoch_starts(m, 0, 40 * B)) == sorted(names)
    assert epochs(m, 100) == {"epoch/s0": 70 / 50, "epoch/s1": 30 / 20}


def test_a_single_dataset_counts_its_epochs_and_generated_data_none():
    single = Numbered(0, 30)
    assert epochs(single, 45) == {"epoch": 1.5}
    assert epoch_starts(single, 24, 36) == [("", 1)]
    assert epoch_starts(single, 0, 24) == []
    assert epochs(Numbered(0, 2**62), 10**6) == {}


def test_an_epoch_row_names_its_source_as_data_source(tmp_path):
    """`source` is trainer.evaluate's key (who wrote an evaluation row); an epoch row names the
    mixture's source as `data_source`, and a single dataset's none."""
    from trainer.config import LogArgs

    reporter = metrics.Reporter(str(tmp_path), LogArgs(), 10, is_main=True)
    reporter.epochs(4, [("code", 1), ("", 2)])
    assert [{k: v for k, v in r.items() if k != "time"} for r in all_rows(tmp_path)] == [
        {"event": "epoch", "data_source": "code", "epoch": 1, "step": 4},
        {"event": "epoch", "epoch": 2, "step": 4},
    ]


def test_the_live_line_shows_the_epoch():
    row = {"step": 3, "loss": 2.0, "samples_per_s": 10.0}
    assert "loss 2.0000  epoch 1.25  10.0 samples/s" in metrics.progress_line({**row, "epoch": 1.25}, 9, 1.0)
    line = metrics.progress_line({**row, "epoch/web": 0.5, "epoch/code": 2.0}, 9, 1.0)
    assert "loss 2.0000  epoch web 0.50 code 2.00  10.0 samples/s" in line
    assert "epoch" not in metrics.progress_line(row, 9, 1.0)


# -- token files and the config ---------------------------------------------------------------------


def token_file(path, tokens: int, seed: int, sidecar: dict | None = None):
    np.random.default_rng(seed).integers(0, 256, tokens).astype(np.uint16).tofile(path)
    if sidecar is not None:
        sidecar = {
            "tokenizer": "t.json",
            "vocab_size": 256,
            "dtype": "uint16",
            "tokens": tokens,
            "max_id": 255,
            **sidecar,
        }
        (path.parent / (path.name + ".json")).write_text(json.dumps(sidecar))
    return path


@pytest.fixture
def files(tmp_path):
    """Two training files of 40 and 20 windows of SEQ tokens, and an evaluation file for each."""
    d = tmp_path / "data"
    d.mkdir()
    return {
        "web": token_file(d / "web.bin", 40 * SEQ + 1, 1, sidecar={}),
        "code": token_file(d / "code.bin", 20 * SEQ + 1, 2),
        "web_eval": token_file(d / "web_eval.bin", 8 * SEQ + 1, 3),
        "code_eval": token_file(d / "code_eval.bin", 8 * SEQ + 1, 4),
    }


def sources(files, eval_paths: bool = True) -> str:
    evals = [f", eval_path: {files['web_eval']}", f", eval_path: {files['code_eval']}"] if eval_paths else ["", ""]
    return (
        f"data.sources=[{{path: {files['web']}, weight: 0.7{evals[0]}}}, "
        f"{{path: {files['code']}, weight: 0.3{evals[1]}}}]"
    )


MIX = ["data.name=tokens", "model.vocab_size=256", f"model.seq_len={SEQ}"]


def test_build_reads_the_files_through_the_mixture(files):
    cfg = load(None, [*MIX, sources(files)])
    train_set = build(cfg.data, cfg.model, 0, train=True)
    assert train_set.names == ["web", "code"] and train_set.lengths == [40, 20]
    k, j = train_set.locate(5)
    x, y = train_set[5]
    window = int(train_set._perms[k][1][j % train_set.lengths[k]])
    raw = np.fromfile(files[["web", "code"][k]], dtype=np.uint16)[window * SEQ : window * SEQ + SEQ + 1]
    assert torch.equal(x, torch.from_numpy(raw[:-1].astype(np.int64)))
    assert torch.equal(y, torch.from_numpy(raw[1:].astype(np.int64)))
    eval_sets = build(cfg.data, cfg.model, 0, train=False)
    assert dict(eval_sets.weights) == {"web": 0.7, "code": 0.3} and sorted(eval_sets) == ["code", "web"]


def test_a_good_mixture_is_accepted(capsys, tmp_path, files):
    code = check.main(["--config", str(ROOT / "configs/default.yaml"), f"run_dir={tmp_path}/run", *MIX, sources(files)])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.path={web}", "data.sources: and data.path ({web}) are both set; give the token files in one of them"),
        ("data.name=synthetic", "data.sources: mixes token files: it needs data.name=tokens (it is synthetic)"),
        (
            "data.eval_path={web_eval}",
            "data.sources[0].eval_path: and data.eval_path are both set; evaluate on one file or per source",
        ),
    ],
)
def test_refusals_of_the_data_section(capsys, tmp_path, files, override, message):
    given = f"override '{sources(files)}'"
    line = refused(capsys, tmp_path / "run", *MIX, sources(files), override.format(**files))
    assert line == f"error: {given}: {message.format(**files)}"


@pytest.mark.parametrize(
    "source, message",
    [
        ("{{weight: 1}}", "data.sources[1].path: is not set; give the source's token file"),
        (
            "{{path: {code}, weight: 0}}",
            "data.sources[1].weight: is 0.0; give a positive share (relative to the other sources')",
        ),
        (
            "{{path: {code}, weight: -2}}",
            "data.sources[1].weight: is -2.0; give a positive share (relative to the other sources')",
        ),
        (
            "{{path: {code}, weight: .nan}}",
            "data.sources[1].weight: is nan; give a positive share (relative to the other sources')",
        ),
        (
            "{{path: {code}, name: web}}",
            "data.sources[1].name: 'web' also names data.sources[0]; give each source its own name",
        ),
        (
            "{{path: {code}, name: 'a b'}}",
            "data.sources[1].name: 'a b' may hold letters, digits, '_', '.' and '-' only (1 to 64 of them); it names "
            "the source in rows (eval_loss/<name>): set data.sources[1].name",
        ),
        (
            "{{path: {missing}}}",
            "data.sources[1].path: token file {missing} does not exist; point it at a flat uint16 token file",
        ),
        (
            "{{path: {short}}}",
            "data.sources[1].path: token file {short} holds 10 tokens, fewer than model.seq_len+1 = 33; lower "
            "model.seq_len or give a longer file",
        ),
        (
            "{{path: {code}, eval_path: {odd}}}",
            "data.sources[1].eval_path: token file {odd} has 5 bytes, not a whole number of 2-byte uint16 tokens; "
            "check data.token_dtype, or whether the file was cut short",
        ),
        (
            "{{path: {wide}}}",
            "{config}: data.token_dtype: is uint16 but {wide} was tokenized with t.json ({wide}.json) as uint32; set "
            "data.token_dtype=uint32",
        ),
        (
            "{{path: {big}}}",
            "override 'model.vocab_size=256': model.vocab_size: is 256 but {big} was tokenized with t.json "
            "({big}.json), vocabulary 1000, largest id 999; set model.vocab_size=1000 or more",
        ),
    ],
)
def test_refusals_of_a_source(capsys, tmp_path, files, source, message):
    d = files["web"].parent
    paths = {
        **files,
        "missing": d / "missing.bin",
        "short": token_file(d / "short.bin", 10, 5),
        "odd": d / "odd.bin",
        "wide": token_file(d / "wide.bin", 100, 6, sidecar={"dtype": "uint32"}),
        "big": token_file(d / "big.bin", 100, 7, sidecar={"vocab_size": 1000, "max_id": 999}),
    }
    paths["odd"].write_bytes(b"\x01" * 5)
    override = f"data.sources=[{{path: {files['web']}}}, {source.format(**paths)}]"
    line = refused(capsys, tmp_path / "run", *MIX, override)
    # a sidecar's dtype or vocabulary is blamed on the key to change, where that was given
    given = "" if message.startswith(("{config}", "override")) else f"override {override!r}: "
    assert line == f"error: {given}{message.format(**paths, config=ROOT / 'configs/default.yaml')}"


def test_the_trainer_refuses_before_writing_anything(tmp_path, files):
    run_dir = tmp_path / "run"
    bad = f"data.sources=[{{path: {files['web']}, weight: 0}}]"
    proc = subprocess.run(
        [PYTHON, "-m", "trainer", "--config", str(ROOT / "configs/default.yaml"), f"run_dir={run_dir}", *MIX, bad],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data.sources[0].weight: is 0.0; give a positive share" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


# -- real runs (gloo, CPU) --------------------------------------------------------------------------


def all_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_resume_on_other_files_or_weights_says_so():
    from trainer.config import to_dict
    from trainer.data import stream_change

    mix = load(None, ["data.name=tokens", "data.sources=[{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]"])
    even = load(None, ["data.name=tokens", "data.sources=[{path: a.bin, weight: 1}, {path: b.bin, weight: 1}]"])
    single = load(None, ["data.name=tokens", "data.path=a.bin"])
    assert stream_change(to_dict(mix), mix.data, 5) is None
    assert stream_change(to_dict(single), single.data, 5) is None
    assert stream_change(to_dict(load(None, [])), load(None, []).data, 5) is None  # generated data
    assert stream_change(to_dict(mix), even.data, 5) is None  # a mixture's own: data.resume says it (below)
    assert "(a.bin -> a.bin x0.7, b.bin x0.3)" in stream_change(to_dict(single), mix.data, 5)
    planted = {"data": {"path": "\x1b]0;owned\x07a.bin"}}  # a checkpoint's config is untrusted bytes
    assert "(]0;owneda.bin -> " in stream_change(planted, mix.data, 5)


# -- issue #42 item 4: other weights on resume: each source goes on from its own position -------------


def saved_meta(m: Mixture, samples: int, paths=None) -> dict:
    """A checkpoint's meta.json as a save of the mixture `m` after `samples` writes it."""
    from trainer.data import position

    sources = [{"path": p, "weight": w} for p, w in zip(paths or m.names, m.weights)]
    return {"samples": samples, "config": {"data": {"sources": sources}}, "path": "ckpt", **position(m)}


def own_indices(m: Mixture, first: int, n: int) -> dict[int, list[int]]:
    """Each source's own sample indices among global samples [first, first + n)."""
    out: dict[int, list[int]] = {}
    for i in range(first, first + n):
        k, j = m.locate(i)
        out.setdefault(k, []).append(j)
    return out


def test_other_weights_on_resume_go_on_from_each_source_s_position_nothing_repeated_or_skipped():
    """The issue's run: 0.7/0.2/0.1 resumed at step 45 with other weights. Each source's own samples
    go on from the count it had given (they jumped: a source from its 180th sample to its 450th, 270
    skipped, its epoch from 0.48 to 1.34 without an epoch row; another read again half of what it had
    read this pass)."""
    from trainer.data import resume

    lengths, B, S = [1000, 375, 400], 20, 45 * 20
    old = mixture([0.7, 0.2, 0.1], lengths)
    before = old.counts(S)
    new = mixture([0.2, 0.7, 0.1], lengths)
    line = resume(new, saved_meta(old, S))
    assert line.startswith(
        "the mixture changed since the checkpoint (s0 x0.7, s1 x0.2, s2 x0.1 -> s0 x0.2, s1 x0.7, s2 x0.1): from "
        f"sample {S} on each source goes on from where it was (s0 from its sample {before[0]}, s1 from its sample "
        f"{before[1]}, s2 from its sample {before[2]})"
    )
    after = own_indices(new, S, 1000)
    for k in range(3):  # consecutive from where it was: each item of a pass once
        assert after[k] == list(range(before[k], before[k] + len(after[k]))), k
    assert abs(len(after[1]) - 700) <= 3  # the new weights share what follows
    assert new.counts(S) == before and epochs(new, S) == epochs(old, S)  # the epochs go on, no jump
    # every epoch that begins is found once, at the step that reads its first sample
    starts = [(s, *e) for s in range(46, 200) for e in epoch_starts(new, (s - 1) * B, s * B)]
    for k, name in enumerate(new.names):
        passes_made = new.counts(199 * B)[k] // lengths[k]
        assert sorted(e for _, n, e in starts if n == name) == list(range(before[k] // lengths[k] + 1, passes_made + 1))


def test_a_resume_after_the_change_is_the_stream_never_interrupted():
    """Same weights as the checkpoint's: its origin is kept, so a run stopped again after a change of
    weights reads on exactly as one that was not; and a mixture without change is the pure stream."""
    from trainer.data import resume

    S1, S2 = 300, 420
    old = mixture([0.7, 0.3], [50, 20])
    changed = mixture([0.4, 0.6], [50, 20])
    resume(changed, saved_meta(old, S1))
    again = mixture([0.4, 0.6], [50, 20])
    assert resume(again, saved_meta(changed, S2)) is None  # nothing changed: nothing to say
    assert [again[i] for i in range(S2, S2 + 200)] == [changed[i] for i in range(S2, S2 + 200)]
    same = mixture([0.7, 0.3], [50, 20])
    assert resume(same, saved_meta(old, S1)) is None
    assert (same.start, same.taken) == (0, [0, 0])
    assert [same[i] for i in range(S1, S1 + 100)] == [old[i] for i in range(S1, S1 + 100)]


def test_a_source_added_on_resume_starts_at_its_first_sample_and_a_bad_origin_is_one_line():
    from trainer.data import DataError, resume

    old = mixture([0.7, 0.3], [50, 20])
    grown = Mixture([Numbered(k, n) for k, n in enumerate([50, 20, 30])], [0.5, 0.3, 0.2], ["s0", "s1", "new"], 0)
    line = resume(grown, saved_meta(old, 100))
    assert "(s0 from its sample 70, s1 from its sample 30, new from its sample 0 (new))" in line
    assert own_indices(grown, 100, 50)[2][:3] == [0, 1, 2]
    meta = saved_meta(old, 100)
    meta["mixture"] = {"start": 0, "taken": [0, -5]}  # meta.json is untrusted
    with pytest.raises(DataError) as e:
        resume(mixture([0.5, 0.5], [50, 20]), meta)
    assert str(e.value) == (
        "checkpoint ckpt: meta.json's mixture is {'start': 0, 'taken': [0, -5]}, not the origin a save writes; "
        "move that checkpoint away"
    )
