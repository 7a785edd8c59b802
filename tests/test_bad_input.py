"""Bad input, all of it (issue 15): each case is refused with one line (`error: where: key: what;
what to do`), exit code 2, and nothing written to the run dir. Most cases call the checks in this
process (trainer.check's main, the same code the launcher and the ranks run); a few go through the
real entry points in subprocesses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, env
from trainer import check

DEFAULT = str(ROOT / "configs" / "default.yaml")


def refused(capsys, run_dir: Path, *argv: str, config: str = DEFAULT) -> str:
    """The one error line of `python -m trainer.check`; fails unless it exits 2 and wrote nothing."""
    code = check.main(["--config", config, f"run_dir={run_dir}", *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, out + err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not run_dir.exists(), "the check wrote into the run dir"
    return lines[0]


def accepted(capsys, run_dir: Path, *argv: str, config: str = DEFAULT) -> None:
    code = check.main(["--config", config, f"run_dir={run_dir}", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not run_dir.exists()


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The single error line of a process that must exit 2 without a traceback."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    device_line = re.compile(r"launch: \S+: \d+ rank\(s\) on ")  # the launcher says it before the ranks start
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not device_line.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# The config file itself


def test_empty_config_file(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# only a comment\n\n")
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}: the file is empty (no settings, only blanks or comments); write settings into it "
        f"(configs/default.yaml is an example)"
    )


def test_duplicate_key_names_the_key_and_both_lines(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\n  seed: 1\n  steps: 4\n")
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}:4: steps: given twice (lines 2 and 4); keep one of them"
    )


def test_duplicate_section(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\noptim:\n  lr: 0.1\ntrain:\n  seed: 2\n")
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}:5: train: given twice (lines 1 and 5); keep one of them"
    )


def test_yaml_merge_keys_still_work(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: &t\n  steps: 3\neval:\n  interval: 0\n")
    accepted(capsys, tmp_path / "run", config=str(path))


LATIN1 = "train:\n  steps: 3  # caf\xe9\n".encode("latin-1")


def test_config_not_utf8(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(LATIN1)
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}:2: not UTF-8 text (byte 0xe9 at offset 24); save the file as UTF-8"
    )


@pytest.mark.slow  # an interpreter of the trainer
def test_config_not_utf8_in_the_trainer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(LATIN1)
    run_dir = tmp_path / "run"
    line = one_line(run("-m", "trainer", "--config", str(path), f"run_dir={run_dir}"))
    assert line == f"error: {path}:2: not UTF-8 text (byte 0xe9 at offset 24); save the file as UTF-8"
    assert not run_dir.exists()


def test_config_is_a_folder(capsys, tmp_path):
    assert refused(capsys, tmp_path / "run", config=str(tmp_path)) == (
        f"error: {tmp_path}: is a folder; pass a YAML file with --config"
    )


def test_overrides_before_config_are_accepted(capsys, tmp_path):
    run_dir = tmp_path / "run"
    assert check.main(["train.steps=3", "--config", DEFAULT, f"run_dir={run_dir}", "--nproc", "1"]) == 0
    assert "config OK" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# Numbers: every float has a documented range; a value from the command line is blamed on it


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=nan", "optim.lr: is nan; give a finite number"),
        ("optim.lr=inf", "optim.lr: is inf; give a finite number"),
        ("optim.lr=0", "optim.lr: is 0.0; it must be positive"),
        ("optim.weight_decay=nan", "optim.weight_decay: is nan; give a finite number"),
        ("optim.weight_decay=-0.1", "optim.weight_decay: is -0.1; it must be 0 or more"),
        ("train.grad_clip=nan", "train.grad_clip: is nan; give a finite number"),
        ("train.grad_clip=0", "train.grad_clip: is 0.0; give a positive norm, or null to disable clipping"),
        ("optim.min_lr_ratio=-5", "optim.min_lr_ratio: is -5.0; it must be in [0, 1]"),
        ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio: is 1.5; it must be in [0, 1]"),
        ("optim.gamma=-1", "optim.gamma: is -1.0; it must be in (0, 1], e.g. 0.7"),
        ("optim.gamma=0", "optim.gamma: is 0.0; it must be in (0, 1], e.g. 0.7"),
        ("optim.betas=[1.0, 0.95]", "optim.betas[0]: is 1.0; it must be in [0, 1), e.g. 0.9"),
        ("optim.betas=[0.9, -0.1]", "optim.betas[1]: is -0.1; it must be in [0, 1), e.g. 0.95"),
        ("optim.momentum=-1", "optim.momentum: is -1.0; it must be in [0, 1), e.g. 0.9"),
        ("health.min_busbw_gbps=-1", "health.min_busbw_gbps: is -1.0; it must be 0 or more (GB/s; 0: not judged)"),
        ("health.min_write_mbps=nan", "health.min_write_mbps: is nan; give a finite number"),
        ("health.max_excluded=-1", "health.max_excluded: is -1; it must be 0 or more"),
        ("health.command_timeout_s=0", "health.command_timeout_s: is 0; it must be at least 1"),
        (
            "health.command_timeout_s=1000000000",
            "health.command_timeout_s: is 1000000000; it must be at most 604800 (7 days)",
        ),
        (
            "model.dropout=0.5",
            "model.dropout: is 0.5; it must be in [0, 0.5): the MNIST CNN's second dropout is twice it",
        ),
    ],
)
def test_numbers_out_of_range_are_blamed_on_the_override(capsys, tmp_path, override, message):
    assert refused(capsys, tmp_path / "run", override) == f"error: override {override!r}: {message}"


def test_numbers_from_the_file_are_blamed_on_the_file(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  name: sgd\n  momentum: 1.0\n")
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}: optim.momentum: is 1.0; it must be in [0, 1), e.g. 0.9"
    )


def test_the_edges_of_the_ranges_are_accepted(capsys, tmp_path):
    accepted(
        capsys,
        tmp_path / "run",
        "optim.min_lr_ratio=0",
        "optim.min_lr_ratio=1",
        "optim.gamma=1",
        "optim.betas=[0, 0]",
        "optim.momentum=0",
        "optim.weight_decay=0",
        "model.dropout=0",
        "train.grad_clip=null",
    )


def test_run_dir_from_the_command_line_is_blamed_on_it(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = check.main(["--config", DEFAULT, f"run_dir={blocker}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: override 'run_dir={blocker}': run_dir: {blocker} is a file, not a folder; choose another run_dir"
    )


# ---------------------------------------------------------------------------------------------------
# Inside the run dir


def test_checkpoints_is_a_file(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("")
    code = check.main(["--config", DEFAULT, f"run_dir={run_dir}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: override 'run_dir={run_dir}': run_dir: {run_dir}/checkpoints is a file where the run keeps its "
        f"checkpoints folder; move it away or choose another run_dir"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_a_run_file_is_a_folder(capsys, tmp_path, name):
    run_dir = tmp_path / "run"
    (run_dir / name).mkdir(parents=True)
    code = check.main(["--config", DEFAULT, f"run_dir={run_dir}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: override 'run_dir={run_dir}': run_dir: {run_dir}/{name} is a folder where the run writes its "
        f"{name} file; move it away or choose another run_dir"
    )
    assert [p.name for p in run_dir.iterdir()] == [name]


def test_run_dir_that_cannot_be_created(capsys, tmp_path):
    assert refused(capsys, Path("/proc/forbidden/run")) == (
        "error: override 'run_dir=/proc/forbidden/run': run_dir: cannot write to /proc (No such file or directory); "
        "choose a writable run_dir"
    )


def test_the_write_probe_leaves_nothing_behind(capsys, tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert check.main(["--config", DEFAULT, f"run_dir={tmp_path / 'run'}"]) == 0
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


# ---------------------------------------------------------------------------------------------------
# Data files


def tokens_file(tmp_path, data: bytes, name: str = "tokens.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("key", ["data.path", "data.eval_path"])
@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "token file {p} is empty; point it at a file of at least model.seq_len+1 = 33 tokens"),
        (
            b"\x01\x00" * 40 + b"\x01",
            "token file {p} has 81 bytes, not a whole number of 2-byte uint16 tokens; check "
            "data.token_dtype, or whether the file was cut short",
        ),
        (
            b"\x01\x00" * 32,
            "token file {p} holds 32 tokens, fewer than model.seq_len+1 = 33; lower model.seq_len or "
            "give a longer file",
        ),
    ],
)
def test_token_file_sizes(capsys, tmp_path, key, data, message):
    good = tokens_file(tmp_path, b"\x01\x00" * 100, "good.bin")
    bad = tokens_file(tmp_path, data)
    paths = {"data.path": good, "data.eval_path": good, key: bad}
    overrides = ["data.name=tokens", "model.seq_len=32", *(f"{k}={v}" for k, v in paths.items())]
    assert refused(capsys, tmp_path / "run", *overrides) == (
        f"error: override '{key}={bad}': {key}: " + message.format(p=bad)
    )


def test_a_folder_as_token_file(capsys, tmp_path):
    assert refused(capsys, tmp_path / "run", "data.name=tokens", f"data.path={tmp_path}") == (
        f"error: override 'data.path={tmp_path}': data.path: {tmp_path} is a folder; give a token file (a flat uint16 "
        f"array of token ids)"
    )


def test_token_ids_out_of_vocabulary_name_file_and_offset(tmp_path):
    from trainer.data import DataError, TokenFile

    ids = np.arange(100, dtype=np.uint16) % 50
    ids[77] = 300
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    with pytest.raises(DataError) as e:
        TokenFile(str(path), "uint16", seq_len=8, vocab_size=256)
    assert str(e.value) == (
        f"token file {path}: token 77 (byte offset 154) is id 300, not below model.vocab_size=256; "
        f"raise model.vocab_size above the file's largest id, or check data.token_dtype"
    )
    assert len(TokenFile(str(path), "uint16", seq_len=8, vocab_size=301)) == 12


def test_image_folder_without_class_folders(capsys, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "loose.jpg").write_bytes(b"")
    assert refused(capsys, tmp_path / "run", "model.name=resnet18", "data.name=imagefolder", f"data.path={images}") == (
        f"error: override 'data.path={images}': data.path: {images} has no class folders; put the images in one "
        f"subfolder per class ({images}/<class>/<image>)"
    )


def test_image_folder_without_images(tmp_path):
    from trainer.data import DataError, image_folder

    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "notes.txt").write_text("")
    with pytest.raises(DataError) as e:
        image_folder(str(tmp_path), 32, num_classes=2)
    assert str(e.value).startswith(f"image folder {tmp_path}: Found no valid file for the classes cat, dog")
    assert str(e.value).endswith(f"; put the images in one subfolder per class ({tmp_path}/<class>/<image>.jpg)")


def test_image_folder_with_more_classes_than_the_model(tmp_path):
    from PIL import Image

    from trainer.data import DataError, image_folder

    for cls in ("a", "b", "c"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / cls / "0.png")
    with pytest.raises(DataError) as e:
        image_folder(str(tmp_path), 8, num_classes=2)
    assert (
        str(e.value)
        == f"image folder {tmp_path} has 3 class folders but model.num_classes is 2; set model.num_classes=3"
    )


def test_resume_from_a_file(capsys, tmp_path):
    meta = tmp_path / "meta.json"
    meta.write_text("{}")
    assert refused(capsys, tmp_path / "run", f"checkpoint.resume_from={meta}") == (
        f"error: override 'checkpoint.resume_from={meta}': checkpoint.resume_from: {meta} is a file; give the "
        f"checkpoint folder that holds it, such as run_dir/checkpoints/step_00000100"
    )


def launch(
    run_dir: Path, *overrides: str, config: str = DEFAULT, extra_env: dict | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """`python -m trainer.launch` with 2 ranks (what make run does), to its end."""
    from conftest import TINY

    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--nproc-per-node=2",
        "--config",
        config,
        f"run_dir={run_dir}",
        *TINY,
        *overrides,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, env={**env(), **(extra_env or {})}, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_token_ids_out_of_vocabulary_through_the_launcher(tmp_path):
    """Found by the ranks: one line (rank 0's), exit 2, the run dir never created."""
    ids = np.ones(1000, dtype=np.uint16)
    ids[500] = 256  # the tiny transformer's vocabulary is 256
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    run_dir = tmp_path / "run"
    line = one_line(launch(run_dir, "data.name=tokens", f"data.path={path}"))
    assert line == (
        f"error: token file {path}: token 500 (byte offset 1000) is id 256, not below model.vocab_size=256; "
        f"raise model.vocab_size above the file's largest id, or check data.token_dtype"
    )
    assert not run_dir.exists()


@pytest.mark.slow
def test_mnist_offline_is_one_line_from_two_ranks(tmp_path):
    """Rank 0 fails to download; rank 1 must not add a gloo traceback."""
    run_dir, root = tmp_path / "run", tmp_path / "mnist"
    root.mkdir()
    offline = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": ""}
    proc = launch(
        run_dir,
        f"data.path={root}",
        "data.download=true",
        "train.global_batch_size=4",
        config=str(ROOT / "configs" / "mnist.yaml"),
        extra_env=offline,
    )
    line = one_line(proc)
    assert line.startswith(f"error: could not download MNIST into {root} (") and line.endswith(
        f"; without internet, copy the MNIST files to {root}/MNIST/raw (train-images-idx3-ubyte, "
        "train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, uncompressed; or try generated digits: python -m "
        "trainer.data "
        f"fake-mnist {root})"
    ), line
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------------
# metrics.jsonl


def test_metrics_rows_are_strict_json(tmp_path):
    import json

    from trainer.metrics import LogArgs, Reporter

    reporter = Reporter(str(tmp_path), LogArgs(progress=False), total_steps=3, is_main=True)
    reporter.write({"step": 1, "eval_loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    text = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))
    assert row == {"step": 1, "eval_loss": None, "grad_norm": None, "lr": 0.1}


# ---------------------------------------------------------------------------------------------------
# Export: --out is checked before anything is read or written


def exported(capsys, out: Path, run_dir: Path) -> str:
    from trainer.export import main as export

    code = export([str(run_dir), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_export_out_in_a_missing_folder(capsys, tmp_path):
    out = tmp_path / "missing" / "model.pt"
    assert exported(capsys, out, tmp_path) == (
        f"error: --out {out}: the folder {tmp_path}/missing does not exist; create it first, or write elsewhere"
    )
    assert not out.parent.exists()


def test_export_out_onto_a_folder(capsys, tmp_path):
    assert exported(capsys, tmp_path, tmp_path) == (
        f"error: --out {tmp_path}: is a folder; give a file name such as {tmp_path}/model.pt"
    )
    assert list(tmp_path.iterdir()) == []


def test_export_out_with_an_unknown_suffix(capsys, tmp_path):
    out = tmp_path / "model.onnx"
    assert exported(capsys, out, tmp_path) == (
        f"error: --out {out}: unknown suffix .onnx; name the file .pt or .pth (torch.save) or .safetensors"
    )
    assert list(tmp_path.iterdir()) == []


def test_export_out_in_a_read_only_place(capsys, tmp_path):
    import os

    if os.geteuid() == 0:  # root passes permission bits; /proc/sys refuses new entries even to root
        locked = Path("/proc/sys/net")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    line = exported(capsys, locked / "model.pt", tmp_path)
    assert line.startswith(f"error: --out {locked}/model.pt: cannot write to {locked} (") and line.endswith(
        "); write elsewhere"
    )
    assert not (locked / "model.pt").exists()


def test_export_checks_out_before_the_run_dir(capsys, tmp_path):
    """A good --out goes on to the run dir's own check (and writes nothing when it fails)."""
    out = tmp_path / "model.pt"
    assert (
        exported(capsys, out, tmp_path / "no-run") == f"error: {tmp_path}/no-run has no complete checkpoint to export"
    )
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------
# torchvision models with a fixed input side or non-tensor outputs


def test_vit_with_an_image_size_it_cannot_cut(capsys, tmp_path):
    assert refused(
        capsys, tmp_path / "run", "model.name=vit_b_16", "data.name=synthetic_images", "model.image_size=100"
    ) == (
        "error: override 'model.image_size=100': model.image_size: vit_b_16 cuts images into 16x16 patches, but "
        "model.image_size=100 is not a multiple of 16; use e.g. 96"
    )


def test_inception_v3_with_too_small_images(capsys, tmp_path):
    assert refused(
        capsys, tmp_path / "run", "model.name=inception_v3", "data.name=synthetic_images", "model.image_size=64"
    ) == (
        "error: override 'model.image_size=64': model.image_size: inception_v3 needs images of at least 75x75 pixels "
        "(model.image_size=64); use 75 or more (299 is its usual size)"
    )


@pytest.mark.parametrize(
    "name, side",
    [
        ("vit_b_16", 64),
        pytest.param("googlenet", 64, marks=pytest.mark.slow),  # 2-4 s to build: the slow tier
        pytest.param("inception_v3", 75, marks=pytest.mark.slow),
    ],
)
def test_models_with_fixed_sizes_or_aux_outputs_are_supported(capsys, tmp_path, name, side):
    """Built for model.image_size and returning one tensor: the check's memory estimate runs their
    forward (on the meta device) and would fail otherwise."""
    import torch

    from trainer import models
    from trainer.config import load

    accepted(
        capsys,
        tmp_path / "run",
        f"model.name={name}",
        "data.name=synthetic_images",
        f"model.image_size={side}",
        "--nproc",
        "1",
    )
    with torch.device("meta"):
        out = models.build(load(None, [f"model.name={name}", f"model.image_size={side}"]).model)(
            torch.zeros(2, 3, side, side)
        )
    assert isinstance(out, torch.Tensor) and out.shape == (2, 10)


# ---------------------------------------------------------------------------------------------------
# Memory


# A rank's start with the memory check traced (a list of its calls) and the training left out.
RANK_CHECKS = """
import sys
import trainer.train
from trainer import check
from trainer.__main__ import main
traced = []
check._check_memory = lambda *args: traced.append(args)
trainer.train.train = lambda cfg: None
main(sys.argv[1:])
print(len(traced))
"""


@pytest.mark.slow  # two interpreters that import the trainer
def test_a_rank_checks_its_nodes_memory_unless_its_launcher_did(tmp_path):
    """The launcher checks its node's memory before the ranks start; its ranks do not trace the
    model on the meta device again (about 0.5 s of every start and restart); other ranks do."""
    args = ["-c", RANK_CHECKS, "--config", DEFAULT, f"run_dir={tmp_path / 'run'}"]
    alone = subprocess.run([sys.executable, *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    launched = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**env(), "TRAINER_MEMORY_CHECKED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 0 and alone.stdout.split()[-1] == "1", alone.stderr[-2000:]
    assert launched.returncode == 0 and launched.stdout.split()[-1] == "0", launched.stderr[-2000:]


def test_a_batch_that_cannot_fit_is_refused(capsys, tmp_path):
    line = refused(capsys, tmp_path / "run", "train.global_batch_size=1000000000", "--nproc", "2")
    assert re.fullmatch(
        r"error: override 'train.global_batch_size=1000000000': train.global_batch_size: one micro-batch of 500000000 "
        r"samples needs about [\d.]+ GB of activations per rank, [\d.]+ GB in all for 2 rank\(s\), but this machine "
        r"has "
        r"[\d.]+ GB of memory; set train.micro_batch_size to \d+ or less \(the rest becomes gradient accumulation\)",
        line,
    ), line
    micro = int(re.search(r"micro_batch_size to (\d+)", line)[1])
    accepted(
        capsys,
        tmp_path / "run",
        f"train.global_batch_size={micro * 2}",
        f"train.micro_batch_size={micro}",
        "--nproc",
        "2",
    )


def test_memory_estimate_parts():
    from trainer import memory
    from trainer.config import load

    cfg = load(None, ["model.seq_len=32"])
    one, two = memory.estimate(cfg, 1, 4), memory.estimate(cfg, 2, 4)
    n = sum(p.numel() for p in __import__("trainer.models", fromlist=["build"]).build(cfg.model).parameters())
    assert (one.parameters, one.gradients, one.optimizer) == (4 * n, 4 * n, 8 * n)  # float32, AdamW: 2 states
    assert (two.parameters, two.optimizer) == (2 * n, 4 * n)  # FSDP full: halved on 2 ranks
    assert two.gradients == 4 * n  # 4 micro-batches: unsharded (float32) until the last one's reduce-scatter
    assert one.activations == 4 * one.activations_per_sample > 0
    checkpointed = memory.estimate(load(None, ["model.seq_len=32", "parallel.activation_checkpointing=true"]), 1, 4)
    assert checkpointed.activations < one.activations


# ---------------------------------------------------------------------------------------------------
# Inputs that ended in a traceback, or in a wrong message (issue 27, items 6 and 8)


def alias_bomb(levels: int = 9) -> str:
    """Billion laughs in 640 bytes: each level a mapping of 9 aliases of the one before, 9**9 values."""
    lines = ["l0: &l0 {" + ", ".join(f"k{i}: x" for i in range(9)) + "}"]
    lines += [f"l{n}: &l{n} {{" + ", ".join(f"k{i}: *l{n - 1}" for i in range(9)) + "}" for n in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "a: " + "[" * 5000 + "\n",
            "{p}:1: nested more than 32 levels deep; a config needs 3 (section, key, list): write it flatter",
        ),
        (
            alias_bomb(),
            (
                "{p}:4: more than 10000 values once aliases are expanded; a config holds a few hundred: write "
                "the values out instead of nesting aliases"
            ),
        ),
        ("train: &t\n  steps: 3\n  again: *t\n", "{p}:3: an alias inside the value it names (a loop); remove it"),
    ],
    ids=["deep", "alias_bomb", "alias_loop"],
)
def test_yaml_that_exhausts_the_stack_or_memory(capsys, tmp_path, text, message):
    """Refused as the file is read, in well under a second: the bomb took 21.7 GB before."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert refused(capsys, tmp_path / "run", config=str(path)) == "error: " + message.format(p=path)


def test_a_merge_of_an_anchor_is_accepted(capsys, tmp_path):
    """Aliases are bounded, not banned: `<<: *anchor` merges still work."""
    path = tmp_path / "c.yaml"
    path.write_text("log: &every {interval: 5}\neval:\n  <<: *every\n  batches: 2\n")
    accepted(capsys, tmp_path / "run", config=str(path))


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=[4", "invalid YAML (expected ',' or ']', but got '<stream end>'); fix the value"),
        (
            "train.seed=99999999999999999999999",
            "train.seed: is 99999999999999999999999; it must be in [0, 4294967295] (numpy's and torch's generators)",
        ),
        ("train.seed=-1", "train.seed: is -1; it must be in [0, 4294967295] (numpy's and torch's generators)"),
        (
            "parallel.timeout_s=100000000000000",
            "parallel.timeout_s: is 100000000000000; it must be at most 604800 (7 days)",
        ),
        (
            "checkpoint.timeout_s=100000000000000",
            "checkpoint.timeout_s: is 100000000000000; it must be at most 604800 (7 days)",
        ),
        ("run_dir=''", "run_dir: is empty; give the run's folder, e.g. runs/default"),
    ],
    ids=["yaml", "seed_big", "seed_negative", "parallel_timeout", "checkpoint_timeout", "run_dir_empty"],
)
def test_overrides_that_passed_the_check_and_failed_in_the_ranks(capsys, tmp_path, override, message):
    assert refused(capsys, tmp_path / "run", override) == f"error: override {override!r}: {message}"


def test_the_edges_of_seed_and_timeouts_are_accepted(capsys, tmp_path):
    accepted(
        capsys,
        tmp_path / "run",
        "train.seed=0",
        "train.seed=4294967295",
        "parallel.timeout_s=604800",
        "checkpoint.timeout_s=604800",
    )


def test_a_fifo_as_config_or_token_file_is_named_and_never_opened(capsys, tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: this test would hang."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert refused(capsys, tmp_path / "run", config=str(fifo)) == (
        f"error: {fifo}: is a FIFO (named pipe), not a regular file; pass a YAML file with --config"
    )
    assert refused(capsys, tmp_path / "run", "data.name=tokens", f"data.path={fifo}") == (
        f"error: override 'data.path={fifo}': data.path: {fifo} is a FIFO (named pipe), not a regular file; give a "
        f"token file (a flat uint16 array of token ids)"
    )


HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def hf_folder(tmp_path, config=HF_CONFIG, index: str | None = None) -> Path:
    """A Hugging Face folder as trainer.check reads it: config.json and a safetensors file (its header
    is read, not its names), with `index` as model.safetensors.index.json if given."""
    import json

    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(32)}, str(folder / "model.safetensors"))
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(index)
    return folder


def test_a_good_hf_folder_is_accepted(capsys, tmp_path):
    accepted(capsys, tmp_path / "run", f"model.init_from={hf_folder(tmp_path)}")
    index = '{"weight_map": {"model.norm.weight": "model.safetensors"}}'
    accepted(capsys, tmp_path / "run", f"model.init_from={hf_folder(tmp_path / 'sharded', index=index)}")


def test_a_hub_cache_snapshot_is_accepted_and_its_links_stay_in_its_blobs(capsys, tmp_path):
    """The hub cache keeps a revision as links into the repository's blobs/: those are its own files.
    A link from a snapshot to anywhere else is still refused."""
    plain = hf_folder(tmp_path / "plain")
    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (repo / "blobs" / f"blob-{name}").write_bytes((plain / name).read_bytes())
        (snapshot / name).symlink_to(f"../../blobs/blob-{name}")
    accepted(capsys, tmp_path / "run", f"model.init_from={snapshot}")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(plain / "model.safetensors")
    assert refused(capsys, tmp_path / "run", f"model.init_from={snapshot}").endswith(
        f"{snapshot}/model.safetensors is a link to {plain}/model.safetensors, outside {snapshot}; copy the file "
        "itself "
        f"into the folder (hf download --local-dir makes such a folder)"
    )


@pytest.mark.parametrize(
    "config, message",
    [
        ({**HF_CONFIG, "hidden_size": "64"}, "hidden_size is '64'; it must be a whole number of at least 1"),
        ({**HF_CONFIG, "num_attention_heads": 0}, "num_attention_heads is 0; it must be a whole number of at least 1"),
        ({**HF_CONFIG, "rms_norm_eps": "small"}, "rms_norm_eps is 'small'; it must be a number"),
        ([HF_CONFIG], "holds a JSON list, not a mapping of settings; replace it with the model's config.json"),
        ({**HF_CONFIG, "tie_word_embeddings": "false"}, "tie_word_embeddings is 'false'; it must be true or false"),
    ],
    ids=["str", "zero_heads", "str_float", "list", "str_bool"],
)
def test_init_from_with_a_bad_config_json(capsys, tmp_path, config, message):
    folder = hf_folder(tmp_path, config)
    assert refused(capsys, tmp_path / "run", f"model.init_from={folder}") == (
        f"error: {DEFAULT}: model.init_from: {folder}/config.json: {message}"
    )


@pytest.mark.parametrize(
    "case",
    [
        "truncated",
        "invalid_index",
        "index_without_map",
        "index_names_parent",
        "index_names_absolute",
        "index_names_missing",
        "link_out",
        "index_names_link_out",
    ],
)
def test_init_from_with_bad_weights_or_index(capsys, tmp_path, case):
    """The weights' headers and the index are read by the check (and the launcher, and each rank before
    it writes anything): a broken file, or one outside the folder, is one line."""
    import torch
    from safetensors.torch import save_file

    outside = tmp_path / "elsewhere.safetensors"  # readable weights: the old code read them
    save_file({"model.norm.weight": torch.ones(32)}, str(outside))
    indexes = {
        "invalid_index": '{"weight_map": {',
        "index_without_map": '["model.safetensors"]',
        "index_names_parent": '{"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}',
        "index_names_absolute": f'{{"weight_map": {{"model.norm.weight": "{outside}"}}}}',
        "index_names_missing": '{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}',
        "index_names_link_out": '{"weight_map": {"model.norm.weight": "linked.safetensors"}}',
    }
    folder = hf_folder(tmp_path, index=indexes.get(case))
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if case == "truncated":
        single.write_bytes(single.read_bytes()[:-1])
    if case == "link_out":
        single.unlink()
        single.symlink_to(outside)
    if case == "index_names_link_out":
        (folder / "linked.safetensors").symlink_to(outside)
    messages = {
        "truncated": f"{single} is not a readable safetensors file (Error while deserializing header: incomplete "
        f"metadata, file not fully covered); download it again, it may be cut short",
        "invalid_index": f"{index} is not readable JSON (Expecting property name enclosed in double quotes: line 1 "
        f"column 17 (char 16)); replace it with the model's model.safetensors.index.json",
        "index_without_map": f"{index} has no weight_map of parameter names to file names; replace it with the "
        f"model's model.safetensors.index.json",
        "index_names_parent": f"{index} names '../elsewhere.safetensors', outside {folder}; an index may name only "
        f"files in its own folder",
        "index_names_absolute": f"{index} names '{outside}', outside {folder}; an index may name only files in its "
        f"own folder",
        "index_names_missing": f"{index} names 'model-00002-of-00002.safetensors', which {folder} lacks; download "
        f"the whole model folder again",
        "link_out": f"{single} is a link to {outside}, outside {folder}; copy the file itself into the folder "
        f"(hf download --local-dir makes such a folder)",
        "index_names_link_out": f"{folder}/linked.safetensors is a link to {outside}, outside {folder}; copy the "
        f"file itself into the folder (hf download --local-dir makes such a folder)",
    }
    assert refused(capsys, tmp_path / "run", f"model.init_from={folder}") == (
        f"error: {DEFAULT}: model.init_from: {messages[case]}"
    )
