"""`python -m trainer.requeue`, as users type it: the command lives in trainer/launchers/requeue.py."""

import sys

from trainer.launchers.requeue import main

if __name__ == "__main__":
    sys.exit(main())
