"""Bad input in the config's values (issue 15): the config file itself, numbers out of range, models
and batches that cannot fit, YAML that exhausts the stack, overrides that failed in the ranks. Each case
is refused with one line (`error: where: key: what; what to do`), exit code 2, and nothing written to
the run dir. Most cases call the checks in this process (trainer.check's main, the same code the
launcher and the ranks run); a few go through the real entry points in subprocesses. Files and folders
a config names: tests/unit/test_bad_input_files.py; what the launcher and the ranks find:
tests/system/test_bad_input_launch.py.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.bad_input import DEFAULT, accepted, refused
from trainer.preflight import check

# ---------------------------------------------------------------------------------------------------
# The config file itself


LATIN1 = "train:\n  steps: 3  # caf\xe9\n".encode("latin-1")


@pytest.mark.parametrize(
    "content, message",
    [
        pytest.param(
            "# only a comment\n\n",
            " the file is empty (no settings, only blanks or comments); write settings into it "
            "(configs/default.yaml is an example)",
            id="empty",
        ),
        pytest.param(
            "train:\n  steps: 3\n  seed: 1\n  steps: 4\n",
            "4: steps: given twice (lines 2 and 4); keep one of them",
            id="duplicate_key_names_the_key_and_both_lines",
        ),
        pytest.param(
            "train:\n  steps: 3\noptim:\n  lr: 0.1\ntrain:\n  seed: 2\n",
            "5: train: given twice (lines 1 and 5); keep one of them",
            id="duplicate_section",
        ),
        pytest.param(LATIN1, "2: not UTF-8 text (byte 0xe9 at offset 24); save the file as UTF-8", id="not_utf8"),
        pytest.param(  # a number out of its range is blamed on the file (on the override: below)
            "optim:\n  name: sgd\n  momentum: 1.0\n",
            " optim.momentum: is 1.0; it must be in [0, 1), e.g. 0.9",
            id="numbers_from_the_file_are_blamed_on_the_file",
        ),
    ],
)
def test_a_config_file_is_refused_in_one_line_that_names_it(capsys, tmp_path, content, message):
    path = tmp_path / "c.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert refused(capsys, tmp_path / "run", config=str(path)) == f"error: {path}:{message}"


def test_yaml_merge_keys_still_work(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: &t\n  steps: 3\neval:\n  interval: 0\n")
    accepted(capsys, tmp_path / "run", config=str(path))


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
    [("vit_b_16", 64)],  # googlenet and inception_v3 take 2-4 s to build: tests/system/test_bad_input_config.py
)
def test_models_with_fixed_sizes_or_aux_outputs_are_supported(capsys, tmp_path, name, side):
    assert_supported(capsys, tmp_path, name, side)


def assert_supported(capsys, tmp_path, name: str, side: int) -> None:
    """Built for model.image_size and returning one tensor: the check's memory estimate runs the
    model's forward (on the meta device) and would fail otherwise."""
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
    from trainer.config import load
    from trainer.preflight import memory

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
