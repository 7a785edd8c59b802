"""Which node of a multi-node launch stopped answering: each node's launcher beats in the run dir.

    <run_dir>/heartbeats/<node>.json    {"node", "endpoint", "beat", "pid"}, rewritten every INTERVAL_S

When a node dies (its power, its kernel, its slurmd and processes), the ranks of the other nodes
see only closed connections, and the rendezvous store may have died with it (it lives on the first
node). The run dir is on a filesystem every node sees, so it is the witness that survives any one
node: after its ranks failed, a launcher reads the others' heartbeats; a node whose counter has not
moved for SILENT_S seconds is the one that stopped answering. Counters, not times: the nodes' clocks
need not agree. Written in place, not renamed over: NFS clients cache a folder's names for tens of
seconds, but re-read a file's content at each open (close-to-open); a read cut short is retried.
Only the heartbeats of this launch count (the same rendezvous endpoint): a requeued job picks a new
port, and the files of nodes it no longer has are ignored.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

from trainer.rundir import files

log = logging.getLogger("trainer")

INTERVAL_S = 1.0  # seconds between two beats of a node
# Seconds without a beat after which a node counts as gone: several beats, so that a loaded node
# or a slow shared filesystem is not taken for a dead node.
SILENT_S = 10.0


def folder(run_dir: str) -> str:
    return os.path.join(run_dir, "heartbeats")


class Heartbeat:
    """A daemon thread that rewrites this node's heartbeat file until stop()."""

    def __init__(self, run_dir: str, node: str, endpoint: str, interval_s: float = INTERVAL_S) -> None:
        self.path = os.path.join(folder(run_dir), f"{node}.json")
        self.record = {"node": node, "endpoint": endpoint, "beat": 0, "pid": os.getpid()}
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._said = False  # whether a skipped beat was said

    def failed(self, round_: str, rank: int, exit_code: int, noticed: float) -> None:
        """Say in the next beats (and this one, at once) that this node's ranks failed in rendezvous
        round `round_`: rank `rank` with `exit_code`, noticed at time `noticed` (time.time())."""
        self.record["failure"] = {"round": round_, "rank": rank, "exit_code": exit_code, "time": noticed}
        self._write()

    def lost(self, nodes: list[str]) -> None:
        """Say in this and the next beats that `nodes` stopped answering."""
        self.record["lost"] = nodes
        self._write()

    def start(self) -> None:
        # The run dir is shared: a link there, in place of the folder or of this node's file, is not
        # ours to follow (someone else's, leading anywhere): it is removed, and the beats are written
        # in the run dir itself, never through a link (_write: O_NOFOLLOW).
        for path in (os.path.dirname(self.path), self.path):
            if os.path.islink(path):
                os.unlink(path)
            if path != self.path:
                os.makedirs(path, exist_ok=True)
        self._write()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def _write(self) -> None:
        self.record["beat"] += 1
        try:  # a new file renamed into place: a link or FIFO planted at the name is replaced
            files.write_json(self.path, self.record, indent=None, sort_keys=False)
        except files.UnsafeFile as e:  # a folder (or the like) there: this beat is skipped, said once
            if not self._said:
                self._said = True
                log.warning(f"heartbeat: {e}; beats are skipped until it is moved away")
        except OSError:  # a full or briefly unreachable filesystem: the next beat tries again
            pass


def beats(run_dir: str, endpoint: str) -> dict[str, int]:
    """{node: its counter} of the heartbeats of this launch (the same endpoint) now in the run dir."""
    return {node: record.get("beat") for node, record in records(run_dir, endpoint).items()}


def first_to_name(run_dir: str, endpoint: str, nodes: list[str]) -> bool:
    """Whether this node is the first of this launch to name `nodes` as lost (then it writes the one
    metrics row): a file made with O_EXCL, atomic on NFS v3 and later as on a local disk. The first
    to get here is the first survivor to end, whose exit makes srun stop the others."""
    tag = hashlib.sha256(f"{endpoint} {' '.join(nodes)}".encode()).hexdigest()[:16]
    try:
        fd = os.open(os.path.join(folder(run_dir), f"lost-{tag}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError:  # no run dir to write in: say it anyway
        return True
    os.close(fd)
    return True


def named_lost(run_dir: str, endpoint: str) -> list[str]:
    """The nodes another node of this launch found silent (Heartbeat.lost): a node stopped by the
    others' exit before its own wait ended says the same."""
    found = set()
    for record in records(run_dir, endpoint).values():
        found.update(str(n) for n in record.get("lost") or ())
    return sorted(found)


def failures(run_dir: str, endpoint: str, round_: str) -> dict[str, dict]:
    """{node: its failure} of the nodes of this launch whose ranks failed in rendezvous round `round_`."""
    found = {}
    for node, record in records(run_dir, endpoint).items():
        failure = record.get("failure")
        if isinstance(failure, dict) and failure.get("round") == round_:
            found[node] = failure
    return found


def records(run_dir: str, endpoint: str) -> dict[str, dict]:
    """{node: its heartbeat record} of this launch (the same endpoint) now in the run dir."""
    found = {}
    try:
        names = os.listdir(folder(run_dir))
    except OSError:
        return found
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            record = files.read_json(os.path.join(folder(run_dir), name))
        except (OSError, ValueError):  # being rewritten, or not a regular file (files.UnsafeFile): skipped
            continue
        if isinstance(record, dict) and record.get("endpoint") == endpoint:
            found[str(record.get("node"))] = record
    return found


def silent_nodes(
    run_dir: str, endpoint: str, me: str, silent_s: float = SILENT_S, poll_s: float = INTERVAL_S / 4
) -> list[str]:
    """The other nodes of this launch whose heartbeat did not move for silent_s seconds from now;
    returns as soon as every one of them has beaten (nothing silent: usually within one interval)."""
    first = {n: b for n, b in beats(run_dir, endpoint).items() if n != me}
    deadline, moved = time.monotonic() + silent_s, set()
    while True:
        for node, beat in beats(run_dir, endpoint).items():
            if node != me and node not in first:  # not readable at the first look: from now on
                first[node] = beat
            elif node in first and beat != first[node]:
                moved.add(node)
        if moved >= first.keys() or time.monotonic() >= deadline:
            return sorted(first.keys() - moved)
        time.sleep(poll_s)
