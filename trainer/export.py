"""`python -m trainer.export`, as users type it: the command lives in trainer/commands/export.py."""

import sys

from trainer.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
