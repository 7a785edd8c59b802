"""Stop requests: SIGTERM (preemption, `docker stop`), SIGUSR1 (Slurm's time-limit warning), SIGINT.

The handler only sets a flag. The training loop asks `requested()` at each step boundary, which
all-reduces the flag so that every rank sees the same answer and they save and stop together.
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

log = logging.getLogger("trainer")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopFlag:
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.received: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            log.warning("received %s: will save a checkpoint and stop at the next step", signal.Signals(signum).name)

    def requested(self) -> bool:
        """True on every rank as soon as any rank has received a stop signal (collective)."""
        flag = torch.tensor([1 if self.received is not None else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
