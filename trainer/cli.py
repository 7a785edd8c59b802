"""The trainer's commands in one table, and the one parser every command line goes through.

    python -m trainer.cli        the commands, one line each (--help), and --version

Each command is typed two ways: `python -m <module>` from a checkout, and `fsdp-<name>` where the
package is installed (pyproject.toml's [project.scripts], one entry per row of COMMANDS; the test
tests/unit/test_cli.py holds the two together). Every command's main(), and the helpers the commands run
(HELPERS), build their parser with `parser()`, so that

* `--help` names the command as the user typed it: `usage: fsdp-train ...` for the installed
  command, `usage: python -m trainer.launch ...` for the module;
* `--version` prints `fsdp-trainer X.Y.Z` (trainer/version.py) and exits 0;
* a command line argparse cannot parse is ONE line, as every other bad input (an unknown option, a
  missing --config, a word where a number goes): `error: <what>; see <command> --help`, exit 2
  (trainer/resilience/outcomes.py's BAD_INPUT), never argparse's usage block above it.

The Slurm requeue check (trainer/launchers/requeue.py) parses its command line here too, in the batch shell
with the host's python3: this module runs on Python 3.6 and later with the standard library only
(tests/{unit,system}/test_requeue.py, HOST_MODULES).

A new command: its module with a main(argv=None) -> int that builds its parser with
`cli.parser("<name>", description)`, a row below, and `fsdp-<name> = "<module>:main"` in
pyproject.toml's [project.scripts].
"""

import argparse
import os
import sys

from trainer.resilience import outcomes
from trainer.version import add_version

# The commands a user types: name -> (the module whose main() runs it, one line of what it does).
# Installed as fsdp-<name>; from a checkout `python -m <module>`.
COMMANDS = {
    "train": ("trainer.launch", "train on this node: check, then torchrun's ranks; restarts them, one exit code"),
    "check": ("trainer.check", "check a config against itself and this machine before anything starts"),
    "config": ("trainer.config", "print every key of a config: its value, its default and its meaning"),
    "submit": ("trainer.submit", "submit training to Slurm (sbatch or submitit) from a login node"),
    "submit-k8s": (
        "trainer.launchers.k8s",
        "a Kubernetes TrainJob or JobSet training from the image: rendered, applied",
    ),
    "evaluate": ("trainer.evaluate", "evaluate a checkpoint: one eval row in the run's metrics.jsonl"),
    "export": ("trainer.export", "a checkpoint's weights as one .pt or .safetensors file, or a Hugging Face folder"),
    "generate": ("trainer.generate", "the continuation of a prompt from a checkpoint: greedy or sampled"),
    "prepare": ("trainer.prepare", "text and .jsonl files into a token file, with a Hugging Face tokenizer"),
    "metrics": ("trainer.metrics", "summarise runs from their metrics.jsonl, and plot them"),
    "requeue": ("trainer.requeue", "after a Slurm job's step: requeue the job or not (its batch script runs it)"),
    "dcp-metadata": ("trainer.checkpoint.stock", "write a checkpoint's .metadata for stock DCP where it is missing"),
}
# Run by the commands above rather than typed, each with a parser of its own here too: module -> what it is.
HELPERS = {
    "trainer": "one rank of a run (fsdp-train starts them; `python -m trainer` alone is one process)",
    "trainer.data": "data helpers: MNIST's files with generated digits (fake-mnist)",
}
# Commands run by a host's own python3 (Slurm's batch shell), named so in their usage.
HOST_PYTHON = {"requeue": "python3"}


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a command line it cannot parse is one line and exit 2."""

    def error(self, message):
        self.exit(outcomes.BAD_INPUT.code, "error: {}; see {} --help\n".format(message, self.prog))


def spelling(name):
    """How `name` (a command of COMMANDS or a module of HELPERS) was typed: its installed name where
    this process is that console script (argv[0] is the script's path), else `python -m <module>`."""
    if name in COMMANDS:
        script = "fsdp-" + name
        if os.path.basename(sys.argv[0] if sys.argv else "") == script:
            return script
        return "{} -m {}".format(HOST_PYTHON.get(name, "python"), COMMANDS[name][0])
    if name in HELPERS:
        return "python -m " + name
    raise KeyError("{} is neither a command of trainer.cli.COMMANDS nor a helper of HELPERS".format(name))


def parser(name, description, **kwargs):
    """The parser of command `name` (a key of COMMANDS, or a module of HELPERS): usage named as it
    was typed, --version, and bad input in one line. kwargs go to argparse.ArgumentParser."""
    return add_version(Parser(prog=spelling(name), description=description, **kwargs))


def main(argv=None):
    """`python -m trainer.cli`: the table, as help."""
    lines = ["commands (installed as fsdp-NAME; from a checkout python -m MODULE):"]
    width = max(len(n) for n in COMMANDS)
    for name, (module, line) in COMMANDS.items():
        lines.append("  {:<{}}  {}: {}".format(name, width, module, line))
    lines.append("run by them:")
    for module, line in HELPERS.items():
        lines.append("  python -m {}: {}".format(module, line))
    p = Parser(
        prog="python -m trainer.cli",
        description="The trainer's commands; each says its own options with --help.",
        epilog="\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_version(p)
    p.parse_args(argv)
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
