"""The command table (trainer/cli.py, issue #43 item 5): every command is a row with an installed name
and a `python -m` spelling, and its --help, --version and unparsable command lines go through the one
parser: usage named as typed, `fsdp-trainer X.Y.Z`, and one line with exit 2 (argparse printed its
usage block and `prog: error: ...` before, a second style beside the bad-input lines)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import tomllib

from tests.helpers.run import ROOT
from tests.unit.test_requeue import SYSTEM_PYTHON
from trainer import __version__, cli

VERSION = f"fsdp-trainer {__version__}\n"


def ends(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv)'s exit code (argparse's SystemExit, or what main returns), stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_command_has_its_entry_point_and_its_python_m_spelling():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == sorted(f"fsdp-{name}" for name in cli.COMMANDS), "one entry point per row"
    for name, (module, line) in cli.COMMANDS.items():
        target, function = scripts[f"fsdp-{name}"].split(":")
        assert target == module, (name, target)
        assert callable(getattr(importlib.import_module(module), function))
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert '\nif __name__ == "__main__":\n' in source, f"python -m {module}"
        assert line and "\n" not in line


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_version_and_a_bad_command_line_are_one_path(name, capsys, monkeypatch, handlers):
    main = importlib.import_module(cli.COMMANDS[name][0]).main
    typed = f"{'python3' if name == 'requeue' else 'python'} -m {cli.COMMANDS[name][0]}"

    code, out, _ = ends(main, ["--help"], capsys)
    assert code == 0 and out.startswith(f"usage: {typed} "), out
    assert ends(main, ["--version"], capsys) == (0, VERSION, "")
    code, out, err = ends(main, ["--no-such-option"], capsys)
    assert (code, out) == (2, ""), err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and err.endswith(f"; see {typed} --help\n"), err
    assert "usage:" not in err

    monkeypatch.setattr(sys, "argv", [f"/venv/bin/fsdp-{name}"])  # the console script's argv[0]
    code, out, _ = ends(main, ["--help"], capsys)
    assert code == 0 and out.startswith(f"usage: fsdp-{name} "), out
    code, _, err = ends(main, ["--no-such-option"], capsys)
    assert code == 2 and err.endswith(f"; see fsdp-{name} --help\n"), err


def test_an_argparse_error_says_what_in_one_line(capsys):
    from trainer.commands.export import main as export

    code, _, err = ends(export, ["run", "--best", "--step", "3", "--out", "x.pt"], capsys)
    assert (code, err) == (
        2,
        "error: argument --step: not allowed with argument --best; see python -m trainer.export --help\n",
    )
    from trainer.preflight.check import main as check

    code, _, err = ends(check, ["--config", "default", "--nproc", "two"], capsys)
    assert (code, err) == (
        2,
        "error: argument --nproc: invalid int value: 'two'; see python -m trainer.check --help\n",
    )


def test_the_helpers_parse_through_the_table_too(capsys, handlers):
    from trainer.data import main as data

    assert ends(data, ["--version"], capsys) == (0, VERSION, "")
    assert ends(data, ["fake-mnist"], capsys) == (
        2,
        "",
        "error: the following arguments are required: root; see python -m trainer.data fake-mnist --help\n",
    )
    # One rank, `python -m trainer`: its module installs signal handlers as it is imported (handlers puts
    # the test process's back)
    rank = importlib.import_module("trainer.__main__").main
    assert ends(rank, ["--version"], capsys) == (0, VERSION, "")
    assert ends(rank, ["train.steps=3"], capsys) == (
        2,
        "",
        "error: the following arguments are required: --config; see python -m trainer --help\n",
    )


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_the_requeue_check_s_command_line_on_the_host_s_python_alone():
    """The batch shell's python3, no site-packages: the table and the parser are standard library."""
    run = lambda *argv: subprocess.run(
        [SYSTEM_PYTHON, "-S", "-s", "-E", "-m", "trainer.requeue", *argv], cwd=ROOT, capture_output=True, text=True
    )
    version = run("--version")
    assert (version.returncode, version.stdout) == (0, VERSION), version.stderr
    bad = run("--exit-code", "1")
    assert (bad.returncode, bad.stderr) == (
        2,
        "error: the following arguments are required: --run-dir; see python3 -m trainer.requeue --help\n",
    )


def test_the_table_lists_every_command(capsys):
    code, out, _ = ends(cli.main, [], capsys)
    assert code == 0
    for name, (module, line) in cli.COMMANDS.items():
        assert f"  {name}" in out and f"{module}: {line}" in out
    assert ends(cli.main, ["--version"], capsys) == (0, VERSION, "")
