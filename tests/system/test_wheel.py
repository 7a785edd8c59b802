"""The system tier of tests/unit/test_wheel.py, whose docstring says what both halves test."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import trainer
from tests.helpers.run import ROOT, TINY, env
from trainer import cli

VERSION = f"{trainer.__version__}+wheeltest"  # only the wheel built below says this


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; its folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: building in the checkout would leave build/ and an egg-info there
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("trainer", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    init = src / "trainer" / "__init__.py"
    text = init.read_text()
    assert f'__version__ = "{trainer.__version__}"' in text
    init.write_text(text.replace(f'__version__ = "{trainer.__version__}"', f'__version__ = "{VERSION}"'))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(src), "-w", str(tmp / "dist"))
    (wheel,) = (tmp / "dist").glob("fsdp_trainer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "trainer").rglob("*.py")}
    configs = {f"trainer/{p.relative_to(ROOT)}" for p in (ROOT / "configs").glob("*.yaml")}
    assert modules | configs <= names, f"missing from the wheel: {sorted(modules | configs - names)}"
    # the license ships (#42 item 8: the wheel carried none): the file, and the metadata that names it
    info = f"fsdp_trainer-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = z.read(f"{info}/METADATA").decode().splitlines()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata

    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    purelib = run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    deps = sysconfig.get_path("purelib")  # this venv's: torch and the rest, and pip
    assert deps in site.getsitepackages()
    Path(purelib, "deps.pth").write_text(deps + "\n")
    run(str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel))
    return venv


def outside() -> dict:
    """The trainer's environment (tests/helpers/run.py: env) without the checkout on PYTHONPATH."""
    e = env()
    e.pop("PYTHONPATH")  # env() puts the checkout there
    return e


def run(*cmd: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`cmd` to its end, in `cwd`, without this checkout on PYTHONPATH; fail the test with its output
    unless it exits 0."""
    proc = subprocess.run(list(cmd), cwd=cwd, env=outside(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{cmd} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.mark.slow
def test_the_wheels_entry_points_run_outside_the_repository(installed, tmp_path):
    bin_ = installed / "bin"
    where = run(str(bin_ / "python"), "-c", "import trainer; print(trainer.__file__)", cwd=tmp_path).stdout
    assert Path(where.strip()).is_relative_to(installed), where  # the wheel's trainer, not the checkout's
    for command in cli.COMMANDS:  # every command of the table, installed
        assert run(str(bin_ / f"fsdp-{command}"), "--version", cwd=tmp_path).stdout == f"fsdp-trainer {VERSION}\n"
    # A config by name: the one shipped inside the wheel (there is no configs/ in tmp_path).
    check = run(str(bin_ / "fsdp-check"), "--config", "default", "--nproc", "1", cwd=tmp_path)
    assert check.stdout.startswith("config OK: default: transformer on 1 processes"), check.stdout
    # Slurm jobs run the trainer from a checkout (slurm/train.sbatch.in cds there): one line, before any query.
    submit = subprocess.run(
        [str(bin_ / "fsdp-submit"), "--dry-run", "--config", "default"],
        cwd=tmp_path,
        env=outside(),
        capture_output=True,
        text=True,
    )
    assert (submit.returncode, submit.stdout) == (2, ""), submit
    assert submit.stderr.endswith("not found; submit from a checkout of the repository (make submit)\n"), submit.stderr
    assert len(submit.stderr.splitlines()) == 1, submit.stderr


@pytest.mark.slow
def test_a_run_through_fsdp_train_records_the_wheels_version(installed, tmp_path):
    run_dir = tmp_path / "run"
    run(
        str(installed / "bin" / "fsdp-train"),
        "--nproc-per-node=1",
        "--config",
        "configs/default.yaml",  # a path as the README writes it, found in the wheel from any folder
        f"run_dir={run_dir}",
        *TINY,
        "train.steps=2",
        cwd=tmp_path,
    )
    (meta,) = run_dir.glob("checkpoints/*/meta.json")
    saved = json.loads(meta.read_text())
    assert (saved["step"], saved["trainer"]) == (2, VERSION)
