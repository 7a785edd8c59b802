"""`python -m trainer.submit`, as users type it: the command lives in trainer/launchers/slurm.py."""

import sys

from trainer.launchers.slurm import main

if __name__ == "__main__":
    sys.exit(main())
