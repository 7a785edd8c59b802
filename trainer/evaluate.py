"""`python -m trainer.evaluate`, as users type it: the command lives in trainer/commands/evaluate.py."""

from trainer.commands.evaluate import main, run  # noqa: F401 - main for the command table

if __name__ == "__main__":
    run()
