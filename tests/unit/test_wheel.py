"""The trainer installed as a library: a wheel built from this checkout, installed into a fresh venv,
run through its console entry points from a folder that is not the repository (#35 item 6).

No network and no torch download: the wheel is built with this venv's setuptools (pip wheel
--no-build-isolation --no-index), and the fresh venv (python -m venv --without-pip) reaches the
dependencies (torch, pyyaml, ..., pip itself) through one .pth line naming this venv's site-packages.
A plain path line adds that folder to sys.path after the fresh venv's own site-packages, and the .pth
files in it are not run, so this venv's editable install of the checkout (a .pth there) is not loaded:
`trainer` can only come from the wheel. (pip finds this venv's fsdp-trainer there too, and leaves it:
"Not uninstalling ..., outside environment".) The wheel is built from a copy of the sources whose
__version__ is changed, so a version seen in --version or a checkpoint's meta.json is the wheel's
code at work, not the checkout's.
"""

from __future__ import annotations

import pytest

from tests.helpers.run import ROOT
from trainer.config import ConfigError, load


def test_a_config_by_name_is_the_shipped_one_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = load(str(ROOT / "configs" / "llama-8b.yaml"))
    assert load("llama-8b") == load("llama-8b.yaml") == load("configs/llama-8b.yaml") == shipped
    (tmp_path / "llama-8b").write_text("model:\n  name: transformer\n  size: tiny\n")
    assert load("llama-8b").model.size == "tiny"  # a file of that name wins over the shipped config
    with pytest.raises(ConfigError, match="^no-such: config file not found"):
        load("no-such")
