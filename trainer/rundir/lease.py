"""One run at a time per run dir: a lease file that names its owner and is renewed while it lives.

    <run_dir>/lease.json   {"host", "pid", "boot_id", "pid_ns", "start", "slurm_job", "token", "renewed"}

Rank 0 takes the lease before anything in the run dir is touched (clean-up of unfinished saves
included) and renews it every RENEW_S seconds from a thread; a second run is refused with one line
naming the owner.

Whether an owner lives: a pid means something only in the PID namespace that gave it. Where host,
boot id (/proc/sys/kernel/random/boot_id) and PID namespace (/proc/self/ns/pid) are this process's,
the owner lives while a process of its pid exists and started at the recorded time (field 22 of
/proc/<pid>/stat; a reused pid is another process). Anywhere else (another host; a container with
host networking or `unshare --pid`, which share the hostname; a lease without these fields) it lives
while it is renewed: one not renewed for STALE_S seconds is taken over, with a warning.

Only link(2) and rename(2) decide, atomic on every POSIX filesystem, NFS and Lustre included (flock
may be missing there, or local to a client). A lease is created with link(2), which fails if one
exists. A stale one is taken over by exactly one starter: it link(2)-creates
`lease.json.takeover-<hash of the stale lease's bytes>` (one creator succeeds), checks that the lease
still is those bytes, renames it away, checks the renamed file is them (else puts it back), then
links its own. A run whose lease was taken over or removed finds out at its next renewal, or in
`check()`, which rank 0 calls right before it commits or deletes a checkpoint; `lost` then says to
whom, and the training loop stops every rank (exit code requeue.LEASE_LOST, not requeued).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid

from trainer.rundir import files
from trainer.rundir.layout import LEASE_FILE

log = logging.getLogger("trainer")

FILE = LEASE_FILE
RENEW_S = 10.0  # seconds between renewals
STALE_S = 120.0  # a lease not renewed this long, whose owner cannot be looked up here, is taken over
LEASE_BYTES = 1 << 16  # a lease is a few hundred bytes
TAKEOVER_S = 30.0  # seconds after which a takeover lock is one left by a starter that died taking over


class LeaseError(Exception):
    """The run dir is in use by a live run; the message names it."""


class LeaseLost(Exception):
    """This run's lease was taken over (or removed) while it ran; the message names the new owner."""


def _read_raw(path: str) -> bytes | None:
    """The lease file's bytes, None when absent. files.UnsafeFile for a link, a FIFO or another
    non-regular file there (planted in a shared run dir): never followed, never a hang."""
    try:
        return files.read_bytes(path, LEASE_BYTES)
    except FileNotFoundError:
        return None


def _parse(raw: bytes | None) -> dict:
    """The lease in `raw`; {} if damaged (nobody's)."""
    try:
        owner = json.loads(raw or b"")
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _stat(pid) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process `pid` in this /proc, or None."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (OSError, ValueError, TypeError, IndexError):
        return None


def identity() -> dict:
    """What names this process beyond host and pid: boot id, PID namespace, start time. Empty where
    /proc cannot say: not Linux, or a /proc of another PID namespace (/proc/self is another pid)."""
    try:
        if int(os.readlink("/proc/self")) != os.getpid():
            return {}
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        stat = _stat(os.getpid())
        return {"boot_id": boot_id, "pid_ns": os.readlink("/proc/self/ns/pid"), "start": stat[1]} if stat else {}
    except (OSError, ValueError):
        return {}


def describe(owner: dict) -> str:
    job = f", Slurm job {owner['slurm_job']}" if owner.get("slurm_job") else ""
    return f"process {owner.get('pid')} on {owner.get('host')}{job}"


def _age(owner: dict, now: float) -> float:
    try:
        return now - float(owner.get("renewed", 0))
    except (TypeError, ValueError):
        return now


def _gone(owner: dict, me: dict, now: float) -> str | None:
    """Why the owner of a lease is gone, or None if it may be alive."""
    if not owner:
        return "its lease file was unreadable"
    if all(owner.get(key) and owner.get(key) == me.get(key) for key in ("host", "boot_id", "pid_ns")):
        stat = _stat(owner.get("pid"))
        if stat is None or stat[0] in ("Z", "X"):
            return f"{describe(owner)} is gone"
        if stat[1] != owner.get("start"):
            return f"{describe(owner)} is gone (pid {owner.get('pid')} is another process now)"
        return None
    age = _age(owner, now)  # its pid cannot be looked up here: its renewals say whether it lives
    return f"{describe(owner)} did not renew it for {age:.0f} s" if age >= STALE_S else None


def owner_record() -> dict:
    """What a lease says of this process (a fresh token each call): who holds it, where."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **identity(),
        "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
        "token": uuid.uuid4().hex,
    }


class Lease:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, FILE)
        self.me = owner_record()
        self.lost: str | None = None  # once the lease is lost: "to <its new owner>", or what happened to it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease, or raise LeaseError naming the live owner."""
        run_dir = os.path.dirname(self.path)
        os.makedirs(run_dir, exist_ok=True)
        deadline = time.monotonic() + 10
        while True:  # another starter may change the lease while this one looks: look again
            try:
                raw = _read_raw(self.path)
            except files.UnsafeFile as e:
                raise LeaseError(
                    f"run_dir {run_dir}: {e}; remove it (someone else may have put it there), and keep "
                    f"the run dir writable by you only"
                ) from None
            except OSError as e:
                raise LeaseError(
                    f"run_dir {run_dir}: cannot read {self.path} ({e.strerror}); fix its permissions "
                    f"or the filesystem, or use another run_dir"
                ) from None
            if raw is None:
                if self._create(self.path):
                    break
            else:
                owner = _parse(raw)
                why = _gone(owner, self.me, time.time())
                if why is None:
                    raise LeaseError(
                        f"run_dir {run_dir} is in use by {describe(owner)} (lease renewed "
                        f"{_age(owner, time.time()):.0f} s ago); stop that run first, or use another run_dir"
                    )
                if self._take_over(raw, why):
                    break
            if time.monotonic() > deadline:
                raise LeaseError(f"run_dir {run_dir}: another run keeps taking its lease; use another run_dir")
            time.sleep(0.05)
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._thread.start()

    def _take_over(self, raw: bytes, why: str) -> bool:
        """Replace the stale lease `raw` with this run's; False if another starter (or its owner)
        changed it first."""
        version = hashlib.sha256(raw).hexdigest()[:16]
        lock = f"{self.path}.takeover-{version}"  # one starter creates it: only that one takes over `raw`
        if not self._create(lock):
            with contextlib.suppress(OSError):
                if time.time() - os.stat(lock).st_mtime > TAKEOVER_S:
                    raise LeaseError(
                        f"run_dir {os.path.dirname(self.path)}: a start that was taking over its lease "
                        f"died midway and left {lock}; if no other run is starting there, remove that "
                        f"file and start again"
                    )
            return False
        try:
            if _read_raw(self.path) != raw:
                return False
            moved = f"{self.path}.stale-{version}"
            try:
                os.rename(self.path, moved)
            except FileNotFoundError:
                return False
            if _read_raw(moved) != raw:  # its owner renewed it just now: put it back
                with contextlib.suppress(FileExistsError):
                    os.link(moved, self.path)
                os.remove(moved)
                return False
            os.remove(moved)
            log.warning("taking over the lease of %s: %s", os.path.dirname(self.path), why)
            return self._create(self.path)
        finally:
            os.remove(lock)

    def _create(self, path: str) -> bool:
        """Create `path` holding this run's lease, atomically; False if it exists."""
        tmp = self._write_tmp()
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return os.stat(tmp).st_nlink > 1  # NFS: a retried link(2) whose first try had succeeded
        finally:
            os.remove(tmp)

    def check(self) -> bool:
        """Whether this run still holds its lease, read now; if not, `lost` says what became of it."""
        if self.lost:
            return False
        for attempt in range(3):
            try:
                raw = _read_raw(self.path)
                break
            except OSError as e:  # the filesystem is away for a moment: look again, but not at a planted file
                if isinstance(e, files.UnsafeFile) or attempt == 2:
                    self.lost = f": its lease file cannot be read ({e})"
                    return False
                time.sleep(1)
        owner = _parse(raw)
        if owner.get("token") == self.me["token"]:
            return True
        self.lost = (
            f"to {describe(owner)}"
            if owner
            else ": its lease file was removed"
            if raw is None
            else ": its lease file was overwritten with a damaged one"
        )
        return False

    def release(self) -> None:
        """Stop renewing; remove the lease if it is still this run's."""
        self._stop.set()
        if self._thread is None:
            return  # never acquired
        self._thread.join()
        moved = f"{self.path}.released-{self.me['token']}"
        try:  # moved out of the way first: a lease that another run took over just now goes back
            os.rename(self.path, moved)
        except FileNotFoundError:
            return
        try:
            ours = _parse(_read_raw(moved)).get("token") == self.me["token"]
        except OSError:  # a link or FIFO someone put there (files.UnsafeFile): not ours, and no reason to stop
            ours = False
        if not ours:
            with contextlib.suppress(FileExistsError):
                os.link(moved, self.path)
        os.remove(moved)

    def _write_tmp(self) -> str:
        tmp = f"{self.path}.tmp-{self.me['token']}"  # the token is random: a planted name is refused
        fd = files._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            json.dump({**self.me, "renewed": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if not self.check():  # the training loop stops every rank on `lost`
                    return
                os.replace(self._write_tmp(), self.path)
            except OSError as e:  # the filesystem is away for a moment: try again next time
                log.warning("could not renew the lease %s: %s", self.path, e)
