"""`python -m trainer.metrics`, as users type it: the command lives in trainer/observe/metrics.py."""

import sys

from trainer.observe.metrics import main

if __name__ == "__main__":
    sys.exit(main())
