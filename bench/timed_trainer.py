"""The trainer (`-m trainer ...`, unchanged) with the wall-clock time of each start-up phase noted, for
the resume measurement: run under torchrun in its place,

    torchrun ... -m bench.timed_trainer --times T.json --config ... key=value ...

Rank 0 writes T.json: time.time() when the interpreter reached this module, after the imports (the
trainer's and torch's), around the rendezvous (`trainer.dist.init`), around the checkpoint load
(`Checkpointer.load`) and when the first metrics row was written (after the first step). The trainer
is not modified: its functions are wrapped here from outside.
"""

from __future__ import annotations

import json
import sys
import time

times = {"started": time.time()}


def _wrap(owner, name: str, before: str, after: str) -> None:
    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        times.setdefault(before, time.time())
        try:
            return inner(*args, **kwargs)
        finally:
            times.setdefault(after, time.time())

    setattr(owner, name, wrapped)


def main() -> int:
    out = sys.argv[sys.argv.index("--times") + 1]
    argv = [a for i, a in enumerate(sys.argv[1:], 1) if a != "--times" and sys.argv[i - 1] != "--times"]
    import trainer.__main__ as entry  # installs the trainer's signal handlers, as `-m trainer` does
    import trainer.train  # noqa: F401 - imported lazily by entry.main: counted with the imports here
    from trainer import dist as distributed
    from trainer.checkpoint import manager
    from trainer.observe import metrics

    times["imported"] = time.time()
    _wrap(distributed, "init", "rendezvous_start", "rendezvous_end")
    _wrap(manager.Checkpointer, "load", "load_start", "load_end")
    _wrap(metrics.Reporter, "row", "first_row", "first_row")
    rc = entry.main(argv)
    if distributed.read_env().rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    return rc


if __name__ == "__main__":
    from trainer.dist import exit_process

    exit_process(main())
