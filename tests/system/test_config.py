"""The system tier of tests/unit/test_config.py, whose docstring says what both halves test."""

import pytest
import yaml

from tests.helpers.run import python
from tests.unit.test_config import check_at_scale, shipped
from trainer.config import load, resolve


@pytest.mark.slow  # the full-size models' estimates take 2-3 s each
@pytest.mark.parametrize("name", shipped(heavy=True))
def test_every_shipped_config_passes_the_check_at_its_scale(tmp_path, monkeypatch, capsys, name):
    """The heavy shipped configs (tests/unit/test_config.py: the others), as check_at_scale says."""
    check_at_scale(tmp_path, monkeypatch, capsys, name)


def run_cli(*args):
    return python(*args, timeout=120)


@pytest.mark.slow  # an interpreter of trainer.check or the trainer per case
@pytest.mark.parametrize(
    "args, message",
    [
        (["-m", "trainer", "--config", "configs/missing.yaml"], "configs/missing.yaml: config file not found"),
        (
            ["-m", "trainer", "--config", "configs/default.yaml", "train.global_batch_size=7", "RUN"],
            "expected key=value",
        ),
        (
            [
                "-m",
                "trainer.check",
                "--config",
                "configs/default.yaml",
                "--nproc",
                "1",
                "--nnodes",
                "3",
                "train.global_batch_size=32",
            ],
            "32 is not divisible by 3 processes",
        ),
        (["-m", "trainer.check", "--config", "configs/default.yaml", "--nproc", "0"], "--nproc 0: give 1 or more"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, args, message):
    run_dir = tmp_path / "run"
    proc = run_cli(*args, f"run_dir={run_dir}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run_dir.exists()  # nothing written


@pytest.mark.slow
def test_resolved_config_is_written(tmp_path):
    from tests.helpers.run import TINY, train

    train(tmp_path, 1, *TINY, "train.steps=1", "optim.lr=1e-3")
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["optim"]["lr"] == 1e-3 and written["run_dir"] == str(tmp_path)
    expected = load(None, [*TINY, "train.steps=1", "optim.lr=1e-3", f"run_dir={tmp_path}"])
    assert load(str(tmp_path / "config.yaml")) == resolve(expected)  # the transformer's shape spelled out
    assert written["model"]["dim"] == 64 and written["model"]["rope_theta"] == 10000.0
