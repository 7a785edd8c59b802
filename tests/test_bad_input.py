"""Bad input, all of it (issue 15): each case is refused with one line (`error: where: key: what;
what to do`), exit code 2, and nothing written to the run dir. Most cases call the checks in this
process (trainer.check's main, the same code the launcher and the ranks run); a few go through the
real entry points in subprocesses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
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
        f"(configs/default.yaml is an example)")


def test_duplicate_key_names_the_key_and_both_lines(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\n  seed: 1\n  steps: 4\n")
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}:4: steps: given twice (lines 2 and 4); keep one of them")


def test_duplicate_section(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\noptim:\n  lr: 0.1\ntrain:\n  seed: 2\n")
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}:5: train: given twice (lines 1 and 5); keep one of them")


def test_yaml_merge_keys_still_work(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: &t\n  steps: 3\neval:\n  interval: 0\n")
    accepted(capsys, tmp_path / "run", config=str(path))


LATIN1 = "train:\n  steps: 3  # caf\xe9\n".encode("latin-1")


def test_config_not_utf8(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(LATIN1)
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}:2: not UTF-8 text (byte 0xe9 at offset 24); save the file as UTF-8")


def test_config_not_utf8_in_the_trainer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(LATIN1)
    run_dir = tmp_path / "run"
    line = one_line(run("-m", "trainer", "--config", str(path), f"run_dir={run_dir}"))
    assert line == f"error: {path}:2: not UTF-8 text (byte 0xe9 at offset 24); save the file as UTF-8"
    assert not run_dir.exists()


def test_config_is_a_folder(capsys, tmp_path):
    assert refused(capsys, tmp_path / "run", config=str(tmp_path)) == (
        f"error: {tmp_path}: is a folder; pass a YAML file with --config")


def test_overrides_before_config_are_accepted(capsys, tmp_path):
    run_dir = tmp_path / "run"
    assert check.main(["train.steps=3", "--config", DEFAULT, f"run_dir={run_dir}", "--nproc", "1"]) == 0
    assert "config OK" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# Numbers: every float has a documented range; a value from the command line is blamed on it


@pytest.mark.parametrize("override, message", [
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
    ("model.dropout=0.5", "model.dropout: is 0.5; it must be in [0, 0.5): the MNIST CNN's second dropout is twice it"),
])
def test_numbers_out_of_range_are_blamed_on_the_override(capsys, tmp_path, override, message):
    assert refused(capsys, tmp_path / "run", override) == f"error: override {override!r}: {message}"


def test_numbers_from_the_file_are_blamed_on_the_file(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  name: sgd\n  momentum: 1.0\n")
    assert refused(capsys, tmp_path / "run", config=str(path)) == (
        f"error: {path}: optim.momentum: is 1.0; it must be in [0, 1), e.g. 0.9")


def test_the_edges_of_the_ranges_are_accepted(capsys, tmp_path):
    accepted(capsys, tmp_path / "run", "optim.min_lr_ratio=0", "optim.min_lr_ratio=1", "optim.gamma=1",
             "optim.betas=[0, 0]", "optim.momentum=0", "optim.weight_decay=0", "model.dropout=0", "train.grad_clip=null")


def test_run_dir_from_the_command_line_is_blamed_on_it(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = check.main(["--config", DEFAULT, f"run_dir={blocker}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: override 'run_dir={blocker}': run_dir: {blocker} is a file, not a folder; choose another run_dir")


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
        f"checkpoints folder; move it away or choose another run_dir")
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_a_run_file_is_a_folder(capsys, tmp_path, name):
    run_dir = tmp_path / "run"
    (run_dir / name).mkdir(parents=True)
    code = check.main(["--config", DEFAULT, f"run_dir={run_dir}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: override 'run_dir={run_dir}': run_dir: {run_dir}/{name} is a folder where the run writes its "
        f"{name} file; move it away or choose another run_dir")
    assert [p.name for p in run_dir.iterdir()] == [name]


def test_run_dir_that_cannot_be_created(capsys, tmp_path):
    assert refused(capsys, Path("/proc/forbidden/run")) == (
        "error: override 'run_dir=/proc/forbidden/run': run_dir: cannot write to /proc (No such file or directory); "
        "choose a writable run_dir")


def test_the_write_probe_leaves_nothing_behind(capsys, tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert check.main(["--config", DEFAULT, f"run_dir={tmp_path / 'run'}"]) == 0
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
