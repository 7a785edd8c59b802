"""`--version` for every command: the installed trainer's version (trainer.__version__, the one source).

trainer/cli.py adds it to every command's parser. Standard library only and Python 3.6 or later, as the
host modules that use it (tests/{unit,system}/test_requeue.py, HOST_MODULES): no `from __future__ import annotations`.
"""

import argparse

from trainer import __version__


def add_version(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` with a --version flag that prints `fsdp-trainer X.Y.Z` and exits 0 (before any required
    argument is asked for)."""
    parser.add_argument("--version", action="version", version=f"fsdp-trainer {__version__}")
    return parser
