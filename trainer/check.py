"""`python -m trainer.check`, as users type it: the command lives in trainer/preflight/check.py."""

import sys

from trainer.preflight.check import main

if __name__ == "__main__":
    sys.exit(main())
