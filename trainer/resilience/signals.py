"""Stop requests: SIGTERM (preemption, `docker stop`), SIGUSR1 (Slurm's time-limit warning), SIGINT.

The handler only sets a flag. At each step boundary the training loop agrees on it across ranks, so
that every rank sees the same answer and they save and stop together: at a logged step the flag rides
in the loss's all-reduce (`pending()`), at any other step a tiny CPU all-reduce carries it (with
whether rank 0 lost the run dir's lease: trainer/train.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("trainer")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# What torchrun forwards to every rank (trainer/launchers/torchrun.py): the stop signals, plus the two that
# torchrun forwards by default (a hang-up or quit also reaches the ranks, which then stop at once).
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# Seconds of a grace time kept back for what runs after the ranks stopped: the launcher's own exit
# and, under Slurm, the requeue check in the batch shell (it reads a few files, calls scontrol).
EXIT_MARGIN_S = 20
# Grace time when nobody says: `docker stop` / compose's stop_grace_period (compose.yaml uses this
# value, tests/system/test_launch.py checks that it does), and Slurm's warning (make submit WARN=).
DEFAULT_GRACE_S = 120


def shutdown_budget(grace_s: int) -> int:
    """Seconds the ranks get to reach a step boundary and save after a stop signal, when `grace_s`
    pass between the signal and the hard kill (Slurm's --signal=USR1@S warning, compose's
    stop_grace_period). torchrun kills ranks that take longer (its --shutdown-timeout)."""
    return max(1, grace_s - EXIT_MARGIN_S)


@contextlib.contextmanager
def held():
    """Inside, a stop signal (or another that torchrun handles) waits: the few lines that must run
    together (a claim and the row it grants) are not cut between them by a handler that raises, as
    torchrun's agent's does. At the end, the first signal that came is raised again, to the
    handlers that were there. SIGKILL cannot wait: keep what runs inside short."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        yield
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
    came: list[int] = []
    previous = {}
    for sig in (getattr(signal, name) for name in names):
        previous[sig] = signal.signal(sig, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if came:
            signal.raise_signal(came[0])


_received: int | None = None
# The folder, named by trainer.launch for its ranks, where a rank marks why it stopped (bad input,
# divergence, a lost lease); set: the ranks run under the launcher, which reports stops itself.
MARKS_ENV = "TRAINER_LAUNCH_MARKS"


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
        if _says_it():
            log.warning("received %s: will save a checkpoint and stop at the next step", signal.Signals(signum).name)


def _says_it() -> bool:
    """Whether this process says that it got a stop signal: rank 0 only, and not when the ranks are
    being stopped because one of them refused bad input (its one line is the message)."""
    if os.environ.get("RANK", "0") != "0":
        return False
    marks = os.environ.get(MARKS_ENV)
    return not (marks and os.path.exists(os.path.join(marks, "bad-input")))


def stop_with_launcher() -> None:
    """Under torchrun, ask Linux for SIGTERM when the launcher dies (PR_SET_PDEATHSIG): torchrun
    starts each rank in a session of its own, so a `kill -9` of torchrun alone would leave the ranks
    training and saving on their own, beside the next start. With it they save and stop."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request
        os.kill(os.getpid(), signal.SIGTERM)


def pending() -> bool:
    """Whether this process has received a stop signal: its own answer, before the ranks agree."""
    return _received is not None
