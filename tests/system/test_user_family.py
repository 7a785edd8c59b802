"""The system tier of tests/unit/test_user_family.py, whose docstring says what both halves test."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.outputs import rows
from tests.helpers.run import PYTHON, ROOT, command, env
from tests.unit import test_user_family as unit
from tests.unit.test_user_family import FAMILY, MINE
from trainer.config import load

package = unit.package  # the fixture, shared with the unit tests: the user's family as a package

SMALL = ["train.global_batch_size=4", "log.interval=1", "log.progress=false", "optim.warmup_steps=0"]


def user_env(package) -> dict:
    return dict(env(), PYTHONPATH=f"{ROOT}{os.pathsep}{package}")


def imports(package) -> int:
    """How many processes imported the family module."""
    marker = package / "my_pkg" / "imported"
    return len(marker.read_text().splitlines()) if marker.exists() else 0


def run(package, *args, module: str = "trainer") -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", module, *args], cwd=ROOT, env=user_env(package), capture_output=True, text=True, timeout=300
    )


def saved_run(tmp_path, mode: int):
    """A run dir of mode `mode` whose config.yaml (a run's, ours) names the family."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load(None, [*MINE, f"run_dir={run_dir}"])
    from trainer.config import dump

    dump(cfg, run_dir / "config.yaml")
    run_dir.chmod(mode)
    return run_dir


@pytest.mark.slow  # starts the trainer and its check
def test_a_run_dir_that_others_can_write_may_not_name_the_family(tmp_path, package):
    """Someone who can write the run dir can put a config.yaml there that names any module: the
    trainer refuses it before anything imports it. The user's own command line (or --config file)
    naming the module is what is imported; so is a config.yaml nobody else could have written."""
    run_dir = saved_run(tmp_path, 0o777)
    proc = run(package, "--config", str(ROOT / "configs/default.yaml"), f"run_dir={run_dir}")
    assert proc.returncode == 2, proc.stderr
    saved = run_dir / "config.yaml"
    assert proc.stderr.splitlines() == [  # refused as a whole (issue 41 item 3), before anything imports it
        f"error: {saved}: not used, because its folder {run_dir} can be written by group or others (mode 777), so "
        f"someone else may have written it (its values set the run: learning rate, checkpoints kept, commands); if "
        f"it is yours, read it and continue with it by naming it: --config {saved} (make: CONFIG={saved}), and "
        f"keep the run dir writable by you only (chmod go-w)"
    ]
    assert imports(package) == 0 and not (run_dir / "metrics.jsonl").exists()

    # named as the user's own --config: their choice, imported (the check reads the family)
    proc = run(package, "--config", str(saved), module="trainer.check")
    assert proc.returncode == 0, proc.stderr
    assert imports(package) >= 1
    # a run dir only the user can write: its config.yaml is the user's
    run_dir.chmod(0o755)
    before = imports(package)
    default = ("--config", str(ROOT / "configs/default.yaml"))
    proc = run(package, *default, f"run_dir={run_dir}", module="trainer.check")
    assert proc.returncode == 0, proc.stderr
    assert imports(package) > before


@pytest.mark.slow
def test_a_family_of_ones_own_trains_with_fsdp_checkpointing_and_compile_and_exports(tmp_path, package):
    run_dir = tmp_path / "run"
    overrides = [
        *MINE,
        *SMALL,
        "train.steps=2",
        "parallel.activation_checkpointing=true",
        "parallel.compile=true",
    ]
    # the memory estimate: built on the meta device through the family, one FSDP unit per block
    default = ("--config", str(ROOT / "configs/default.yaml"))
    proc = run(
        package,
        *default,
        "--nproc",
        "2",
        "--gpu-mem-gb",
        "80",
        f"run_dir={run_dir}",
        *overrides,
        module="trainer.check",
    )
    assert proc.returncode == 0, proc.stderr
    assert "memory: about " in proc.stdout + proc.stderr

    proc = subprocess.run(
        command(run_dir, 2, overrides), cwd=ROOT, env=user_env(package), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == [1, 2] and all(math.isfinite(r["loss"]) for r in logged)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["family"] == FAMILY

    # export: the consolidated weights are the family's network's, trained
    proc = run(package, str(run_dir), "--out", str(tmp_path / "model.pt"), module="trainer.export")
    assert proc.returncode == 0, proc.stderr
    trained = torch.load(tmp_path / "model.pt", weights_only=True)
    from my_pkg.net import Net

    torch.manual_seed(load(None, []).train.seed)  # the trainer's start: the seed, then build
    start = Net(8, 3).state_dict()
    assert trained.keys() == start.keys()
    assert all(not torch.equal(trained[k], start[k]) for k in start)

    # without the package on the Python path: one line, exit 2, as for the trainer; so for the tools
    # that read a checkpoint
    for args in (
        ["trainer.export", run_dir, "--out", tmp_path / "none.pt"],
        ["trainer.evaluate", run_dir],
        ["trainer.generate", run_dir, "--prompt", "1", "--max-new-tokens", "1"],
    ):
        proc = subprocess.run(
            [PYTHON, "-m", *map(str, args)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
        )
        assert (proc.returncode, proc.stderr.splitlines()) == (
            2,
            [
                f"error: model.family: no module '{FAMILY}' on the Python path; put its package's folder on "
                f"PYTHONPATH (or pip install it)"
            ],
        ), args[0]

    # a checkpoint's meta.json that others could have written names no module that is imported
    from trainer.checkpoint import manager

    step = Path(dict(manager.complete(str(run_dir)))[2])
    step.chmod(0o777)
    before = imports(package)
    proc = run(package, str(run_dir), "--out", str(tmp_path / "again.pt"), module="trainer.export")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: {step}/meta.json: its model.family '{FAMILY}' is not imported (importing runs its code) because "
        f"its folder {step} can be written by group or others (mode 777), so someone else may have written it; "
        f"give model.family= on the command line or in your own --config file, and keep the run dir writable by "
        f"you only (chmod go-w)"
    ]
    assert imports(package) == before and not (tmp_path / "again.pt").exists()
