"""`python -m trainer.launch`, as users type it: the command lives in trainer/launchers/torchrun.py."""

import sys

from trainer.launchers.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
