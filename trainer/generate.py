"""`python -m trainer.generate`, as users type it: the command lives in trainer/commands/generate.py."""

import sys

from trainer.commands.generate import main

if __name__ == "__main__":
    sys.exit(main())
