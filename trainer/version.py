"""`--version` for every entry point: the installed trainer's version (trainer.__version__, the one source)."""

from __future__ import annotations

import argparse
import os
import sys

from trainer import __version__


def add_version(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` with a --version flag that prints `fsdp-trainer X.Y.Z` and exits 0 (before any required
    argument is asked for), named as the user called it: an installed command by its own name
    (`fsdp-train --help` says `usage: fsdp-train`, not the module's `python -m trainer.launch`)."""
    command = os.path.basename(sys.argv[0] if sys.argv else "")
    if command.startswith("fsdp-"):  # pyproject.toml's [project.scripts]
        parser.prog = command
    parser.add_argument("--version", action="version", version=f"fsdp-trainer {__version__}")
    return parser
