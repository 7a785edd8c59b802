"""Using a trained model: `trainer.generate` samples from a checkpoint, and `trainer.export --format hf`
writes a folder that a serving account can read, with the tokenizer the run's data was made with.

One run serves every process test here: a tiny transformer trained 3 steps on 2 processes on a token
file made by trainer.prepare with a tokenizer trained here (nothing is downloaded)."""

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers.inputs import corpus  # noqa: E402 - after HF_HUB_OFFLINE is set above
from tests.helpers.run import TINY, export_hf, python, train  # noqa: E402 - after HF_HUB_OFFLINE is set above
from trainer import models  # noqa: E402 - after HF_HUB_OFFLINE is set above
from trainer.commands import generate as gen  # noqa: E402 - after HF_HUB_OFFLINE is set above

pytestmark = pytest.mark.slow  # a module fixture trains a run

EOS = "<|endoftext|>"
PROMPT = "the cat sees"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, tokenizer folder): 3 steps on 2 processes on a prepared token file."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tok_models

    root = tmp_path_factory.mktemp("generate")
    folder = root / "tokenizer"
    folder.mkdir()
    docs = corpus(400)
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=200, special_tokens=[EOS], show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    proc = python(
        "-m",
        "trainer.prepare",
        str(root / "docs.jsonl"),
        "--tokenizer",
        str(folder),
        "--out",
        str(root / "train.bin"),
        "--workers",
        "1",
        "--no-progress",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    train(
        root / "run",
        2,
        *TINY,
        "train.steps=3",
        "data.name=tokens",
        f"data.path={root / 'train.bin'}",
        f"model.vocab_size={tok.get_vocab_size()}",
    )
    return root / "run", folder


def generate_cli(*args) -> subprocess.CompletedProcess:
    return python("-m", "trainer.generate", *map(str, args), timeout=300)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask_022", "umask_027"])
def test_exported_files_follow_the_umask(run, tmp_path, umask, mode):
    """Defect 5: model.safetensors was 0600 (safetensors' own default) beside a 0644 config.json,
    so a serving account could not read the weights. Both formats, every file."""
    from trainer.commands.export import main as export

    run_dir, _ = run
    export_hf(run_dir, tmp_path / "hf", umask=umask)
    old = os.umask(umask)
    try:
        for name in ("model.safetensors", "model.pt"):
            assert export([str(run_dir), "--out", str(tmp_path / name)]) == 0
    finally:
        os.umask(old)
    files = [*sorted((tmp_path / "hf").iterdir()), tmp_path / "model.safetensors", tmp_path / "model.pt"]
    assert "model.safetensors" in [f.name for f in files[:-2]]
    modes = {str(f.relative_to(tmp_path)): oct(stat.S_IMODE(f.stat().st_mode)) for f in files}
    assert modes == {name: oct(mode) for name in modes}


def test_export_copies_the_tokenizer_of_the_token_file(run, tmp_path):
    """Defect 5: only a run started from model.init_from passed a tokenizer on; one trained on a
    prepared token file left the folder without one."""
    run_dir, folder = run
    export_hf(run_dir, tmp_path / "hf", umask=0o022)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (folder / name).read_bytes()
    loaded = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert (
        loaded.encode(PROMPT).ids == tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
    )
    assert not (tmp_path / "hf" / "special_tokens_map.json").exists()  # not beside the tokenizer: not made up


def generated(capsys, *args) -> str:
    """What trainer.generate prints (in this process), its exit code checked."""
    code = gen.main([*map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.rstrip("\n")


def test_greedy_output_is_transformers_greedy_generate(run, tmp_path, capsys):
    """Token for token what LlamaForCausalLM.generate(do_sample=False) gives on the exported folder,
    from a checkpoint saved by 2 processes; and as text, what the run's tokenizer decodes."""
    transformers = pytest.importorskip("transformers")
    run_dir, folder = run
    export_hf(run_dir, tmp_path / "hf", umask=0o022)
    capsys.readouterr()
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    expected = reference.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=20,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert len(expected) == 20 and len(set(expected)) > 1  # not a constant: the comparison can fail
    ours = generated(
        capsys, run_dir, "--ids", "--prompt", " ".join(map(str, prompt)), "--max-new-tokens", 20, "--greedy"
    )
    assert list(map(int, ours.split())) == expected
    assert generated(capsys, run_dir, "--prompt", PROMPT, "--max-new-tokens", 20, "--temperature", 0) == tok.decode(
        expected, skip_special_tokens=False
    )


def test_bad_input_is_one_line_exit_2(run, capsys):
    run_dir, _ = run
    for args, message in [
        (["--prompt", "", "--max-new-tokens", 3], "error: --prompt is empty; give at least one token"),
        (["--ids", "--prompt", "1 x", "--max-new-tokens", 3], "error: --prompt '1 x': this run's prompt is token ids"),
        (
            ["--ids", "--prompt", "1 999", "--max-new-tokens", 3],
            "error: --prompt: token id 999 is not in the vocabulary 0..",
        ),
        (["--prompt", "a", "--max-new-tokens", 0], "error: --max-new-tokens is 0; give at least 1"),
        (["--prompt", "a", "--max-new-tokens", 2, "--top-k", 0], "error: --top-k is 0; give at least 1"),
        (
            ["--prompt", "a", "--max-new-tokens", 2, "--step", 2],
            f"error: {run_dir} has no complete checkpoint for step 2",
        ),
    ]:
        assert gen.main([str(run_dir), *map(str, args)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith(message), err


def tiny_transformer(seq_len: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = models.build(models.ModelArgs(name="transformer", size="tiny", seq_len=seq_len))
    model.init_weights(0)
    return model.eval()


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = tiny_transformer(32)
    prompt = [5, 9, 2]
    greedy = gen.sample(model, prompt, 12)

    def drawn(seed, **kw):
        return gen.sample(model, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw)

    assert drawn(0) == drawn(0) and drawn(0) != drawn(1) and drawn(0) != greedy
    assert drawn(0, top_k=1) == drawn(1, top_k=1) == greedy
    pair = drawn(3, top_k=2)
    assert pair != greedy  # the second most likely token was drawn at least once
    with torch.no_grad():
        logits = model(torch.tensor([prompt + pair]))[0, len(prompt) - 1 : -1]
    top2 = torch.topk(logits, 2).indices.tolist()
    assert all(token in top for token, top in zip(pair, top2))


def test_the_context_is_cropped_to_seq_len():
    """Past model.seq_len the model sees the last seq_len tokens (its RoPE tables end there)."""
    model = tiny_transformer(8)
    prompt = list(range(10, 22))  # 12 tokens
    new = gen.sample(model, prompt, 5, seq_len=8)
    assert new[0] == gen.sample(model, prompt[-8:], 1)[0]
    assert new[1] == gen.sample(model, [*prompt[-7:], new[0]], 1)[0]
    assert len(new) == 5
    with pytest.raises(RuntimeError):  # the whole context: more positions than the model's RoPE tables
        gen.sample(model, prompt, 1)


@pytest.mark.parametrize("secret", ["a secret file", "/proc/self/environ"])
def test_export_refuses_a_sidecar_naming_a_file_that_is_not_a_tokenizer(run, tmp_path, capsys, secret):
    """#32 item 4: a token file's sidecar (or a checkpoint's config pointing data.path at a token
    file of someone else's) names any file as the tokenizer; export copied it into the folder meant
    to be published, and generate opened it. Now one line naming the sidecar and the path, exit 2,
    nothing written, and generate refuses the same way."""
    run_dir, _ = run
    sidecar = Path(str(run_dir.parent / "train.bin") + ".json")
    original = sidecar.read_bytes()
    if secret == "a secret file":
        secret = str(tmp_path / "id_rsa")
        Path(secret).write_text("-----BEGIN OPENSSH PRIVATE KEY----- the victim's key\n")
    secret_bytes = Path(secret).read_bytes()
    try:
        sidecar.write_text(json.dumps({**json.loads(original), "tokenizer": secret}))
        from trainer.commands.export import main as export

        assert export([str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {sidecar} names the tokenizer {secret}, which is not a tokenizer.json")
        assert err.count("\n") == 1, err
        written = [p for p in tmp_path.rglob("*") if p.is_file() and str(p) != secret]
        assert all(secret_bytes[:40] not in p.read_bytes() for p in written), written
        assert not (tmp_path / "hf").exists()
        assert gen.main([str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "1"]) == 2
        assert capsys.readouterr().err.startswith(f"error: {sidecar} names the tokenizer {secret}, which is not")
    finally:
        sidecar.write_bytes(original)
