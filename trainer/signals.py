"""Stop requests: SIGTERM (preemption, `docker stop`), SIGUSR1 (Slurm's time-limit warning), SIGINT.

The handler only sets a flag. The training loop asks `requested()` at each step boundary, which
all-reduces the flag so that every rank sees the same answer and they save and stop together.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("trainer")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


_received: int | None = None


def install() -> None:
    """Catch the stop signals from now on. Called first thing, so that an early signal (Slurm's
    warning can come before training starts) is remembered rather than fatal."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handle)


def _handle(signum, frame) -> None:
    global _received
    if _received is not None and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
    if _received is None:
        _received = signum
        log.warning("received %s: will save a checkpoint and stop at the next step", signal.Signals(signum).name)


class StopFlag:
    def __init__(self, group):
        self.group = group  # a gloo group: the check is a tiny CPU all-reduce, no device sync

    def requested(self) -> bool:
        """True on every rank as soon as any rank has received a stop signal (collective)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if _received is not None else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
