"""tools/imports.py, which `make lint` runs: the trainer package's imports form no circle and none
runs up its declared floors; and the script does fail on a circle and on an import running up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.run import ROOT

SCRIPT = ROOT / "tools" / "imports.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_the_trainer_package_has_no_circle_and_no_import_running_up():
    proc = run("--root", str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^floor \d+ config:$", proc.stdout, re.M)  # the floors are printed
    assert "trainer.config -> " in proc.stdout
    config_imports = proc.stdout.split("trainer.config -> ")[1].splitlines()[0].split(", ")
    assert "trainer.launchers.torchrun" not in config_imports  # LaunchArgs lives in config.py
    assert "trainer.preflight.check" not in config_imports


def plant(tmp_path: Path, modules: dict[str, str]) -> Path:
    """A package `trainer` under tmp_path whose modules hold the given sources."""
    for name, source in modules.items():
        path = tmp_path / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    (tmp_path / "trainer" / "__init__.py").touch()
    return tmp_path


def test_a_planted_circle_through_a_function_level_import_fails(tmp_path):
    root = plant(
        tmp_path,
        {
            # two modules of one floor: only the circle is wrong
            "trainer.models.__init__": "from trainer.models import family\n",
            "trainer.models.family": "def f():\n    from trainer.models import spec\n",
            "trainer.models.spec": "from trainer.models.family import f\n",
        },
    )
    proc = run("--root", str(root), "--quiet")
    assert proc.returncode == 1
    assert "import circle of 2 modules (trainer.models.family, trainer.models.spec)" in proc.stderr
    assert "trainer/models/family.py:2" in proc.stderr  # the function-level import is named


def test_an_import_under_type_checking_is_not_a_circle(tmp_path):
    root = plant(
        tmp_path,
        {
            "trainer.models.__init__": "from trainer.models import family\n",
            "trainer.models.family": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from trainer.models import spec\n",
            "trainer.models.spec": "from trainer.models.family import f\n",
        },
    )
    proc = run("--root", str(root), "--quiet")
    assert proc.returncode == 0, proc.stderr


def test_an_import_running_up_a_floor_fails(tmp_path):
    root = plant(
        tmp_path, {"trainer.rundir.files": "", "trainer.config": "", "trainer.prepare": "import trainer.config\n"}
    )
    proc = run("--root", str(root), "--quiet")
    assert proc.returncode == 1
    assert (
        "trainer/prepare.py:1: trainer.prepare (floor 'sections') imports trainer.config, a floor above it ('config')"
        in proc.stderr
    )


def test_a_module_on_no_floor_fails(tmp_path):
    root = plant(tmp_path, {"trainer.rundir.files": "", "trainer.newthing": "from trainer import files\n"})
    proc = run("--root", str(root), "--quiet")
    assert proc.returncode == 1
    assert "trainer.newthing is on no floor; add it to FLOORS in tools/imports.py" in proc.stderr
