"""What a run directory holds, readable with the standard library alone.

    <run_dir>/config.yaml            the resolved config of the run
    <run_dir>/metrics.jsonl          one JSON row per logged step and evaluation (trainer/metrics.py)
    <run_dir>/status.json            what the trainer is doing: train.steps, state, newest save
    <run_dir>/lease.json             which process holds the run (trainer/lease.py)
    <run_dir>/metrics.superseded.jsonl  rows an earlier start logged and did not save
    <run_dir>/trackers.json          the experiment trackers' run ids (trainer/trackers.py)
    <run_dir>/heartbeats/            one file per node of a multi-node run (trainer/heartbeat.py)
    <run_dir>/health/, slurm/health/ failed health checks (trainer/health.py)
    <run_dir>/hangs/                 stacks of a hung or straggling rank (trainer/hangs.py)
    <run_dir>/trace/                 each rank's sample order, with data.trace (trainer/train.py)
    <run_dir>/slurm/requeue.json     the Slurm requeue check's state (trainer/requeue.py)
    <run_dir>/run_id                 the run's identity, written at its first start (trainer/checkpoint.py)
    <run_dir>/checkpoints/step_00000100/   a complete checkpoint (see trainer/checkpoint.py)
    <run_dir>/checkpoints/.tmp_*, .trash_* a save in progress or a folder being deleted

The trainer (trainer/checkpoint.py, trainer/train.py) and the Slurm requeue check
(trainer/requeue.py) both read the layout from here. The requeue check runs in the batch shell
on the host, often with the system's python3 and nothing else installed: this module runs on
Python 3.6 and later (RHEL/Rocky 8 and SLES 15 ship 3.6) and imports nothing outside the standard
library. tests/test_requeue.py checks both.
"""

import os
import re
import time

from trainer import files

STEP_DIR = re.compile(r"^step_(\d+)$")
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
LEASE_FILE = "lease.json"
RUN_ID_FILE = "run_id"
CHECKPOINTS_DIR = "checkpoints"
# What the run dir holds, by kind: a folder where a file belongs (or the reverse) fails only later
# (trainer/check.py refuses both before the start).
RUN_DIR_FOLDERS = (CHECKPOINTS_DIR,)
RUN_DIR_FILES = (CONFIG_FILE, METRICS_FILE, STATUS_FILE, LEASE_FILE)
SUPERSEDED_FILE = "metrics.superseded.jsonl"
TRACKERS_FILE = "trackers.json"
HEARTBEATS_DIR = "heartbeats"
HEALTH_DIR = "health"
HANGS_DIR = "hangs"
TRACE_DIR = "trace"
SLURM_DIR = "slurm"
REQUEUE_FILE = os.path.join(SLURM_DIR, "requeue.json")
# Every name the project writes or reads in a run dir, file or folder (tests/test_plant.py plants a
# link and a FIFO at each and checks nothing is written or read through it).
WRITTEN_FILES = RUN_DIR_FILES + (SUPERSEDED_FILE, TRACKERS_FILE, REQUEUE_FILE, RUN_ID_FILE)
WRITTEN_FOLDERS = (CHECKPOINTS_DIR, HEARTBEATS_DIR, HEALTH_DIR, HANGS_DIR, TRACE_DIR, SLURM_DIR)
# Keys a committed checkpoint's meta.json always holds.
META_KEYS = ("step", "samples", "world_size", "scheduler", "shapes")


def checkpoints_dir(run_dir):
    return os.path.join(str(run_dir), CHECKPOINTS_DIR)


def step_path(run_dir, step):
    return os.path.join(checkpoints_dir(run_dir), "step_{:08d}".format(step))


def step_folders(run_dir, root=None):
    """(step, path) of every step_N folder, oldest first, complete or not; none when checkpoints/ is
    a symbolic link (never followed: the start refuses it). `root`: where checkpoints/ is listed
    instead (the trainer's descriptor of it, files.HeldFolder.path)."""
    root = root or checkpoints_dir(run_dir)
    if os.path.islink(root) or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def read_meta(path):
    """A checkpoint's meta.json: never through a link, never blocking on a FIFO, bounded."""
    return files.read_json(os.path.join(path, "meta.json"))


def files_problem(path):
    """Why the folder at `path` is not a committed checkpoint by its files alone, or None.

    A commit writes meta.json last, after DCP's .metadata and every shard: both present and a
    meta.json with every key is what a commit leaves. trainer/checkpoint.py checks the shards too."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return "no DCP .metadata"
    if not os.path.isfile(os.path.join(path, "meta.json")):
        return "no meta.json"
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as e:
        return "unreadable meta.json ({})".format(e)
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        return "meta.json lacks {}".format(", ".join(missing))
    return None


def read_run_id(run_dir):
    """The run's identity (its run_id file, trainer/checkpoint.py writes it), or None where it has
    none or it cannot be read (trainer/checkpoint.py says why at the start)."""
    try:
        return files.read_text(os.path.join(str(run_dir), RUN_ID_FILE), limit=256).strip() or None
    except OSError:
        return None


def latest_committed_step(run_dir):
    """Step of the newest folder that passes files_problem and is this run's own, or None: a step_N
    that is a symbolic link, whose meta.json's step is not its name (a copy), or whose run id is
    another run's is not the run's, as trainer/checkpoint.py decides."""
    run = read_run_id(run_dir)
    for step, path in reversed(step_folders(run_dir)):
        if os.path.islink(path) or files_problem(path) is not None:
            continue
        meta = read_meta(path)
        saved_by = meta.get("run_id")
        if meta.get("step") == step and (run is None or saved_by is None or saved_by == run):
            return step
    return None


def early_stop_record(run_dir, step):
    """(step, its early_stop part) when `step`, the newest committed checkpoint (latest_committed_step,
    which the caller has asked already), records that the run stopped early there
    (trainer/early_stop.py), else None."""
    if step is None:
        return None
    try:
        record = read_meta(step_path(run_dir, step)).get("early_stop")
    except (OSError, ValueError):
        return None
    if isinstance(record, dict) and record.get("stopped") == step:
        return step, record
    return None


def read_status(run_dir):
    """The trainer's status.json as a dict ({} when absent or not JSON). A link or FIFO there is
    files.UnsafeFile: it names the file, and never hangs."""
    try:
        status = files.read_json(os.path.join(str(run_dir), STATUS_FILE))
    except files.UnsafeFile:
        raise
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def write_status(run_dir, **fields):
    """Update status.json with `fields` and the time (`updated`), atomically (files.write_json): a
    reader never sees half a file, and a link or FIFO planted there is refused (files.UnsafeFile)."""
    status = read_status(run_dir)
    status.update(fields, updated=time.time())
    files.write_json(os.path.join(str(run_dir), STATUS_FILE), status)
