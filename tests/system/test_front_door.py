"""The system tier of tests/unit/test_front_door.py, whose docstring says what both halves test."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.unit.test_front_door import ROOT


@pytest.mark.slow  # eight interpreters: the slow tier
def test_every_command_s_help_ends_its_sentence():
    """`python -m trainer.export --help` stopped at `... or as a`: the description was the first
    line of a docstring whose sentence goes on."""
    for module in ("check", "evaluate", "export", "generate", "launch", "prepare", "requeue", "metrics"):
        out = subprocess.run(
            [sys.executable, "-m", f"trainer.{module}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        description = out.stdout.split("\n\n")[1]
        assert description.rstrip().endswith((".", ")", ":")), f"trainer.{module}: {description!r}"
