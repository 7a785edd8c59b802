"""One run at a time per run dir: a lease file that names its owner and is renewed while it lives.

    <run_dir>/lease.json   {"host", "pid", "slurm_job", "token", "renewed" (unix time)}

Rank 0 takes the lease before anything in the run dir is touched (clean-up of unfinished saves
included) and renews it every RENEW_S seconds from a thread; a second run is refused with one line
naming the owner. It works on NFS and Lustre, where flock may be missing or local to a client: the
lease is created with link(2), which is atomic on every POSIX filesystem, NFS included, and replaced
with rename(2). A lease whose owner is gone is taken over with a warning: on the same host when its
process no longer exists, elsewhere when it was not renewed for STALE_S seconds (a run that lost its
filesystem for longer than that can be taken over: it says so in its log at its next renewal).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

log = logging.getLogger("trainer")

FILE = "lease.json"
RENEW_S = 10.0  # seconds between renewals
STALE_S = 120.0  # a lease not renewed this long, held from another host, is taken over


class LeaseError(Exception):
    """The run dir is in use by a live run; the message names it."""


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # half-written or damaged: nobody's


def _alive(owner: dict, now: float) -> bool:
    if owner.get("host") == socket.gethostname():
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, KeyError, ValueError):
            pass
        return True
    return now - float(owner.get("renewed", 0)) < STALE_S


def describe(owner: dict) -> str:
    job = f", Slurm job {owner['slurm_job']}" if owner.get("slurm_job") else ""
    return f"process {owner.get('pid')} on {owner.get('host')}{job}"


class Lease:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, FILE)
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
                   "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease, or raise LeaseError naming the live owner."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(3):  # another starter may win a race in between: look again
            owner = _read(self.path)
            if owner is not None:
                age = time.time() - float(owner.get("renewed", 0))
                if owner and _alive(owner, time.time()):
                    raise LeaseError(f"run_dir {os.path.dirname(self.path)} is in use by {describe(owner)} (lease "
                                     f"renewed {age:.0f} s ago); stop that run first, or use another run_dir")
                log.warning("taking over the lease of %s: %s", os.path.dirname(self.path),
                            f"{describe(owner)} is gone" if owner else "its lease file was unreadable")
                try:  # out of the way atomically; of two starters, one renames it, the other finds none
                    os.rename(self.path, f"{self.path}.stale-{self.me['token']}")
                    os.remove(f"{self.path}.stale-{self.me['token']}")
                except FileNotFoundError:
                    continue
            tmp = self._write_tmp()
            try:
                os.link(tmp, self.path)  # atomic create: fails if someone else's lease appeared
                break
            except FileExistsError:
                continue
            finally:
                os.remove(tmp)
        else:
            raise LeaseError(f"run_dir {os.path.dirname(self.path)}: another run keeps taking its lease; use another run_dir")
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if (_read(self.path) or {}).get("token") == self.me["token"]:
            os.remove(self.path)

    def _write_tmp(self) -> str:
        tmp = f"{self.path}.tmp-{self.me['token']}"
        with open(tmp, "w") as f:
            json.dump({**self.me, "renewed": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if (_read(self.path) or {}).get("token") != self.me["token"]:
                    log.error("the lease of %s was taken over by another run (%s): stop this one",
                              os.path.dirname(self.path), describe(_read(self.path) or {}))
                    return
                os.replace(self._write_tmp(), self.path)
            except OSError as e:  # the filesystem is away for a moment: try again next time
                log.warning("could not renew the lease %s: %s", self.path, e)
