"""Ranks that stop answering or fall behind: hang forensics and stragglers.

A hang (a collective timed out, or no step completed within parallel.timeout_s) leaves a folder
<run_dir>/hangs/<time>/ before the job exits:

* rank_<R>.txt: each rank that still runs writes the Python stack of every thread, with a header
  (node, process id, the step it was in, why it wrote); the launcher adds the stack of a rank of its
  node that did not write (stopped, or stuck holding the GIL), taken from outside with py-spy;
* nccl_trace_rank_<R>: on GPUs, NCCL's flight recorder, dumped by torch when a collective times out;
* report.txt: the launcher's summary: the ranks that stopped answering, their node, process id and
  last step, and where the others waited.

Every rank of one hang writes into the same folder: the launcher names one per start (the folder's
<time>), and the first rank to write puts its folder into the rendezvous store for the others.

Stragglers: at each logged step every rank's compute time rides in the loss's all-reduce
(trainer/train.py); `Stragglers` names a rank slower than the median for several windows in a row.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback

from trainer.rundir import files

# The hang folder the launcher chose for this start (absolute); without it a rank picks one itself.
HANG_DIR_ENV = "TRAINER_HANG_DIR"
_STORE_KEY = "trainer/hang_dir"
# NCCL flight recorder: entries kept per process group (torch's own suggestion for debugging).
NCCL_TRACE_ENTRIES = 2000
# Logged windows in a row a rank must be slower than log.straggler_factor x the median to be named.
STRAGGLER_WINDOWS = 3
# Seconds a rank whose collective timed out waits, after the newest rank said its own did, for the
# others to say so too (trainer/train.py _stuck_ranks): the ranks still running wait in the same
# collective and time out within a step's spread of each other; the ones that never say so are named.
TIMED_OUT_GRACE_S = 2.0
# Seconds the launcher waits, after the first rank wrote into a hang folder, for the ranks of its
# node to write their own stacks before it takes theirs from outside: a rank whose collective timed
# out first waits for the others to say so too: TIMED_OUT_GRACE_S after the newest, at most 10 s.
OWN_DUMP_WAIT_S = 15


def node() -> str:
    """This node's name as the scheduler knows it, else the hostname (as trainer.dist.node_name)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def launcher_env(run_dir: str, stamp: str, gpus: bool) -> dict[str, str]:
    """The variables the launcher gives its ranks: the hang folder of this start and, on GPUs, NCCL's
    flight recorder with a dump into that folder when a collective times out. The buffer's size
    under the name torch >= 2.11 reads (TORCH_FR_BUFFER_SIZE; the old TORCH_NCCL_TRACE_BUFFER_SIZE
    only makes each rank warn that it is deprecated); the dump file under both names, which 2.11
    and 2.14 both read without a warning."""
    folder = os.path.join(os.path.abspath(run_dir), "hangs", stamp)
    env = {HANG_DIR_ENV: folder}
    if gpus:
        prefix = os.path.join(folder, "nccl_trace_rank_")  # torch appends the rank
        env.update(
            {
                "TORCH_FR_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
                "TORCH_FR_DUMP_TEMP_FILE": prefix,
            }
        )
    return env


def hang_dir(run_dir: str, store) -> str:
    """The folder of this hang, the same for every rank: the first rank to ask sets it in the store
    (the launcher's folder, else one named by the time now); made if missing."""
    proposal = os.environ.get(HANG_DIR_ENV) or os.path.join(
        os.path.abspath(run_dir), "hangs", time.strftime("%Y%m%d-%H%M%S")
    )
    try:
        folder = store.compare_set(_STORE_KEY, "", proposal).decode()
    except Exception:  # noqa: BLE001 - the store may be gone with the launcher: this rank's own folder
        folder = proposal
    files.make_folder(os.path.dirname(folder))
    files.make_folder(folder)
    return folder


def stacks() -> str:
    """The Python stack of every thread of this process, the innermost call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(
            f"Thread {names.get(ident, ident)} (most recent call last):\n" + "".join(traceback.format_stack(frame))
        )
    return "\n".join(parts)


def write_rank_file(folder: str, rank: int, header: dict, body: str) -> str:
    """Append one section (header lines `key: value`, a list one line per item, then `body`) to
    rank_<R>.txt in `folder`."""
    path = os.path.join(folder, f"rank_{rank}.txt")
    lines = [f"{key}: {v}\n" for key, value in header.items() for v in (value if isinstance(value, list) else [value])]
    with files.open_append(path) as f:
        f.write("".join(lines) + "\n" + body.rstrip() + "\n\n")
    return path


def dump(
    run_dir: str, store, rank: int, step: int, why: str, extra: dict | None = None, error: BaseException | None = None
) -> str | None:
    """This rank's stacks into the hang folder, after the call that raised `error` (a collective that
    timed out); never raises (it runs while the job is failing)."""
    try:
        header = {"rank": rank, "node": node(), "pid": os.getpid(), "step": step, "why": why, **(extra or {})}
        call = (
            "".join(["Call that timed out (most recent call last):\n", *traceback.format_tb(error.__traceback__)])
            + "\n"
            if error is not None
            else ""
        )
        return write_rank_file(hang_dir(run_dir, store), rank, header, call + stacks())
    except Exception as e:  # noqa: BLE001 - the forensics must never mask the hang itself
        print(f"rank {rank}: could not write its stack into {run_dir}/hangs: {e}", file=sys.stderr, flush=True)
        return None


class Watchdog:
    """A thread of each rank: when no step completes within `timeout_s` it writes this rank's stacks
    into the hang folder and, if the process still runs `timeout_s` + 30 s later (nothing timed out:
    every rank stuck outside collectives), ends it with exit code 1 so the job can be restarted.

    A Python thread needs the GIL: a rank stuck in C++ that holds it cannot write; the launcher then
    takes its stack with py-spy (Monitor)."""

    def __init__(self, run_dir: str, rank: int, timeout_s: float, store):
        self.run_dir, self.rank, self.timeout_s, self.store = run_dir, rank, timeout_s, store
        self.step, self._deadline = 0, None  # armed by the first reached()
        self._since = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    def reached(self, step: int) -> None:
        """This rank starts `step`: the previous one completed. The first call starts the thread."""
        self.step, self._since = step, time.monotonic()
        self._deadline = self._since + self.timeout_s
        if not self._thread.is_alive() and not self._stopped.is_set():
            self._thread.start()

    def allow(self, seconds: float) -> None:
        """The work that follows may take `seconds` (a checkpoint save: checkpoint.timeout_s)."""
        if self._deadline is not None:
            self._deadline = max(self._deadline, time.monotonic() + seconds)

    def stop(self) -> None:
        """End the thread (it wakes at once), unless it is the one calling."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout_s / 10)):
            if self._deadline is None or time.monotonic() < self._deadline:
                continue
            waited = time.monotonic() - self._since
            why = (
                f"no step completed within {self.timeout_s:g} s (parallel.timeout_s): in step {self.step} "
                f"for {waited:.1f} s"
            )
            path = dump(self.run_dir, self.store, self.rank, self.step, why)
            if self._stopped.wait(self.timeout_s + 30):
                return
            print(
                f"error: rank {self.rank} on {node()}: {why}; its stack is in {path}; the run stops so that it can "
                f"be restarted",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


def silent_line(rank: int, where: str, step: str) -> str:
    """A rank file's line naming a rank that did not answer (`where`: "node pid" from the store)."""
    host, _, pid = where.partition(" ")
    return f"rank {rank}: node {host or '?'}, pid {pid or '?'}, last step {step}"


class Monitor:
    """In the launcher: a thread that watches <run_dir>/hangs for a folder a rank wrote into since
    `started`, gives the ranks of this node a few seconds to write their own stacks, and takes the
    stack of each one that did not (a stopped process cannot) with `py-spy dump` where installed.
    report() writes report.txt once the ranks have exited."""

    def __init__(self, run_dir: str, started: float, nccl_folder: str | None = None):
        self.root, self.started = os.path.join(os.path.abspath(run_dir), "hangs"), started
        self.nccl_folder = nccl_folder  # made now, for NCCL's dumps; removed at the end if still empty
        self.folder: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-monitor", daemon=True)

    def start(self) -> None:
        if self.nccl_folder:
            os.makedirs(self.nccl_folder, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        for folder in (self.nccl_folder, self.root) if self.nccl_folder else ():
            try:
                os.rmdir(folder)  # only if empty
            except OSError:
                pass

    def newest(self) -> str | None:
        """The newest folder under hangs/ made or written since the start that holds a file."""
        try:
            entries = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return None
        found = [
            e.path
            for e in entries
            if e.stat(follow_symlinks=False).st_mtime >= self.started - 1 and any(True for _ in os.scandir(e.path))
        ]
        return max(found, key=os.path.getmtime, default=None)

    def _run(self) -> None:
        while not self._stopped.wait(0.5):
            self.folder = self.newest()
            if self.folder:
                break
        else:
            return
        workers = local_workers()
        deadline = time.monotonic() + OWN_DUMP_WAIT_S
        while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(self.folder, f"rank_{r}.txt")) or process_state(p).startswith("T")
            for r, p in workers.items()
        ):
            time.sleep(0.2)
        for rank, pid in sorted(workers.items()):
            if not os.path.exists(os.path.join(self.folder, f"rank_{rank}.txt")):
                take_stack(self.folder, rank, pid)

    def settle(self, timeout: float = OWN_DUMP_WAIT_S + 15) -> None:
        """Before the launcher kills its ranks: once a hang folder was written, wait (at most `timeout`
        seconds) until the stacks of this node's ranks are in it."""
        if self._thread.is_alive() and (self.folder or self.newest()):
            self._thread.join(timeout)

    def report(self) -> str | None:
        """Write report.txt into the hang folder of this start, if there is one; its path."""
        self.stop()
        folder = self.folder or self.newest()
        if not folder:
            return None
        path = os.path.join(folder, "report.txt")
        files.write_text(path, report(folder))  # whole or not at all; a planted link is replaced
        return path


def local_workers() -> dict[int, int]:
    """{rank: pid} of this process's children that are ranks (Linux /proc: RANK in their environment)."""
    workers = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != os.getpid():
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env and env[b"RANK"].isdigit():
            workers[int(env[b"RANK"])] = int(entry)
    return workers


def process_state(pid: int) -> str:
    """'T (stopped)', 'S (sleeping)', ... from /proc, or '' when gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("State:")), "")
    except OSError:
        return ""


def py_spy() -> str | None:
    """The py-spy program: on PATH or beside this Python (a venv's bin/); None if not installed."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)


def take_stack(folder: str, rank: int, pid: int) -> None:
    """Write the stack of rank `rank` (process `pid`, of this node) taken from outside into its file.
    A stopped process is read without pausing it (--nonblocking: py-spy cannot suspend it again)."""
    state = process_state(pid)
    program = py_spy()
    header = {"rank": rank, "node": node(), "pid": pid}
    if not program:
        body = "(py-spy is not installed: pip install py-spy to take the stack of a rank that cannot write its own)"
        how = "no stack: py-spy not installed"
    else:
        command = [program, "dump", "--pid", str(pid)] + (["--nonblocking"] if state.startswith("T") else [])
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=30)
            body = (
                out.stdout if out.returncode == 0 else f"py-spy failed ({out.returncode}): {out.stderr.strip()[:2000]}"
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            body = f"py-spy failed: {e}"
        how = f"taken from outside with {' '.join(command[1:])}"
    header["why"] = f"did not write its own stack (process state: {state or 'gone'}); {how}"
    write_rank_file(folder, rank, header, body)


_SILENT = re.compile(r"^rank (\d+): node (\S+), pid (\S+), last step (\S+)$")


def sections(path: str) -> list[dict]:
    """The sections of a rank file: each one's header values (`silent`: a list of lines) and `where`,
    the innermost call of its main thread."""
    text = files.read_text(path, files.SMALL_FILE_BYTES * 4)
    result = []
    for chunk in re.split(r"(?m)^(?=rank: \d+$)", text):  # stack lines are indented: never a match
        if not chunk.strip():
            continue
        head, _, body = chunk.partition("\n\n")
        part: dict = {"silent": []}
        for line in head.splitlines():
            key, _, value = line.partition(": ")
            if key == "silent":
                part["silent"].append(value)
            else:
                part[key] = value
        part["where"] = _innermost(body)
        result.append(part)
    return result


def _innermost(body: str) -> str:
    """Where the main thread was, from a section's body (the call that timed out, if it says): the
    innermost call in the trainer's code and, if deeper, the innermost call of all, each with its
    source line; or py-spy's innermost frame."""
    own = re.search(
        r"^(?:Call that timed out|Thread MainThread) \(most recent call last\):\n(.*?)(?:\n\n|\Z)", body, re.S | re.M
    )
    if own:
        lines = [ln.strip() for ln in own.group(1).splitlines()]
        calls = [" ".join(lines[i : i + 2]) for i, ln in enumerate(lines) if ln.startswith("File ")]
        calls = [
            c for c in calls if "trainer/resilience/hangs.py" not in c
        ]  # the dump itself, when the main thread wrote it
        ours = [c for c in calls if "/trainer/" in c]
        return " > ".join(dict.fromkeys(ours[-1:] + calls[-1:]))
    spy = re.search(r"^Thread \d+ \(\w+\): \"MainThread\"\n(.*?)(?:^\S|\Z)", body, re.S | re.M)  # innermost first
    if spy:
        calls = [ln.strip() for ln in spy.group(1).splitlines() if ln.strip()]
        ours = [c for c in calls if "(trainer/" in c]
        return " > ".join(dict.fromkeys(ours[:1] + calls[:1]))
    return ""


def report(folder: str) -> str:
    """report.txt: the ranks that stopped answering (named by a rank whose collective timed out, else
    every rank that wrote), with node, pid and last step, then what each rank was doing."""
    ranks: dict[int, list[dict]] = {}
    for name in sorted(os.listdir(folder)):
        match = re.fullmatch(r"rank_(\d+)\.txt", name)
        if match:
            ranks[int(match.group(1))] = sections(os.path.join(folder, name))
    silent: dict[int, str] = {}
    for parts in ranks.values():
        for part in parts:
            for line in part["silent"]:
                m = _SILENT.match(line)
                if m:
                    silent.setdefault(int(m.group(1)), line)
    lines = [f"hang of {os.path.dirname(os.path.dirname(folder))} ({os.path.basename(folder)})"]
    if silent:
        lines.append("stopped answering: " + ", ".join(f"rank {r}" for r in sorted(silent)))
        lines += [f"  {line}" for _, line in sorted(silent.items())]
    else:
        lines.append("no collective timed out; ranks that wrote: " + ", ".join(f"rank {r}" for r in sorted(ranks)))
    lines.append("what each rank was doing (its file rank_<R>.txt has the whole stack):")
    for rank, parts in sorted(ranks.items()):
        for part in parts:
            where = f"; in {part['where']}" if part.get("where") else ""
            step = f", step {part['step']}" if "step" in part else ""
            lines.append(
                f"  rank {rank} (node {part.get('node', '?')}, pid {part.get('pid', '?')}{step}): "
                f"{part.get('why', '')}{where}"
            )
    traces = sorted(n for n in os.listdir(folder) if n.startswith("nccl_trace_rank_"))
    if traces:
        lines.append("NCCL flight recorder dumps: " + ", ".join(traces))
    return "\n".join(lines) + "\n"


class Stragglers:
    """Names a rank whose compute time per step exceeded `factor` x the median of all ranks' for
    STRAGGLER_WINDOWS logged windows in a row: once per such run of windows.

    The first window after a start is warm-up (lazy set-up, the allocator, a compile: more on some
    ranks than others, by how loaded their machine is) and never counts."""

    def __init__(self, factor: float):
        self.factor = factor
        self.streak: dict[int, int] = {}
        self.warm = False

    def update(self, times: list[float]) -> list[int]:
        """Feed one window's compute time of each rank; the ranks to name now."""
        if not self.warm:
            self.warm = True
            return []
        median = statistics.median(times)
        named = []
        for rank, t in enumerate(times):
            if t > self.factor * median:
                self.streak[rank] = self.streak.get(rank, 0) + 1
                if self.streak[rank] == STRAGGLER_WINDOWS:
                    named.append(rank)
            else:
                self.streak.pop(rank, None)
        return named
