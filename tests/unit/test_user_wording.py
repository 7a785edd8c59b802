"""Wording that sent a pip user astray (issue #42 item 6): the installed commands' usage names the
command typed, a sliding-window refusal blames the override that named the folder, an export to a
folder not yet made makes it, and a family of one's own exported as --format hf is named as such."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.bad_input import DEFAULT, refused
from tests.helpers.inputs import HF_CONFIG, hf_folder
from trainer.commands.export import main as export


def test_an_installed_command_s_usage_names_the_command(monkeypatch, capsys):
    """`fsdp-train --help` printed `usage: python -m trainer.launch`. A console script runs main() with
    its own path as argv[0], as here."""
    from trainer.launchers import torchrun

    assert torchrun._parser().format_usage().startswith("usage: python -m trainer.launch ")  # python -m
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fsdp-train"])
    assert torchrun._parser().format_usage().startswith("usage: fsdp-train ")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fsdp-export"])
    with pytest.raises(SystemExit) as e:
        export(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: fsdp-export ")


def test_a_sliding_window_refusal_blames_the_override_that_named_the_folder(capsys, tmp_path):
    """It blamed `configs/default.yaml: model.init_from` for a folder given on the command line."""
    folder = hf_folder(tmp_path, {**HF_CONFIG, "model_type": "mistral", "sliding_window": 16})
    line = refused(capsys, tmp_path / "run", f"model.init_from={folder}")
    assert line == (
        f"error: override 'model.init_from={folder}': model.init_from: {folder}/config.json: sliding_window is 16 "
        f"tokens, shorter than model.seq_len=64; the transformer attends to the whole sequence: set model.seq_len "
        f"to at most 16"
    )
    assert DEFAULT not in line


def test_an_export_into_a_folder_not_made_yet_makes_it_once_every_check_passed(capsys, tmp_path):
    """`--out a/b/model.pt` failed when a/ did not exist; now the folders are made, but only after the
    checks (here: no checkpoint to export), so a refused export still writes nothing."""
    out = tmp_path / "a" / "b" / "model.pt"
    assert export([str(tmp_path / "no-run"), "--out", str(out)]) == 2
    assert "checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("")
    assert export([str(tmp_path / "no-run"), "--out", str(tmp_path / "file" / "model.pt")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --out {tmp_path}/file/model.pt: {tmp_path}/file is not a folder; write elsewhere"
    )
