"""What a run directory holds, readable with the standard library alone.

    <run_dir>/config.yaml            the resolved config of the run
    <run_dir>/metrics.jsonl          one JSON row per logged step and evaluation (trainer/observe/metrics.py)
    <run_dir>/status.json            what the trainer is doing: train.steps, state, newest save
    <run_dir>/lease.json             which process holds the run (trainer/rundir/lease.py)
    <run_dir>/metrics.superseded.jsonl  rows an earlier start logged and did not save
    <run_dir>/trackers.json          the experiment trackers' run ids (trainer/observe/trackers.py)
    <run_dir>/heartbeats/            one file per node of a multi-node run (trainer/resilience/heartbeat.py)
    <run_dir>/health/, slurm/health/ failed health checks (trainer/resilience/health.py)
    <run_dir>/hangs/                 stacks of a hung or straggling rank (trainer/resilience/hangs.py)
    <run_dir>/trace/                 each rank's sample order, with data.trace (trainer/train.py)
    <run_dir>/tensorboard/, wandb/   the trackers' files, with log.tensorboard, log.wandb (trainer/observe/trackers.py)
    <run_dir>/slurm/requeue.json     the Slurm requeue check's state (trainer/launchers/requeue.py)
    <run_dir>/run_id                 the run's identity, written at its first start (trainer/checkpoint/manager.py)
    <run_dir>/checkpoints/step_00000100/   a complete checkpoint (see trainer/checkpoint/manager.py)
    <run_dir>/checkpoints/.tmp_*, .trash_* a save in progress or a folder being deleted

The trainer (trainer/checkpoint/manager.py, trainer/train.py) and the Slurm requeue check
(trainer/launchers/requeue.py) both read the layout from here. The requeue check runs in the batch shell
on the host, often with the system's python3 and nothing else installed: this module runs on
Python 3.6 and later (RHEL/Rocky 8 and SLES 15 ship 3.6) and imports nothing outside the standard
library. tests/{unit,system}/test_requeue.py checks both.
"""

import os
import re
import stat
import time

from trainer.rundir import files

STEP_DIR = re.compile(r"^step_(\d+)$")
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
LEASE_FILE = "lease.json"
RUN_ID_FILE = "run_id"
CHECKPOINTS_DIR = "checkpoints"
# Where a node's launcher that failed the health check (trainer/resilience/health.py) leaves its record,
# <run_dir>/slurm/health/<job>.<node>.json, before it exits HEALTH_FAILED; the requeue check reads it.
HEALTH_RECORDS = ("slurm", "health")
# What the run dir holds, by kind: a folder where a file belongs (or the reverse) fails only later
# (trainer/preflight/check.py refuses both before the start).
RUN_DIR_FOLDERS = (CHECKPOINTS_DIR,)
RUN_DIR_FILES = (CONFIG_FILE, METRICS_FILE, STATUS_FILE, LEASE_FILE)
SUPERSEDED_FILE = "metrics.superseded.jsonl"
TRACKERS_FILE = "trackers.json"
HEARTBEATS_DIR = "heartbeats"
HEALTH_DIR = "health"
HANGS_DIR = "hangs"
TRACE_DIR = "trace"
TENSORBOARD_DIR = "tensorboard"  # log.tensorboard's event files (trainer/observe/trackers.py)
WANDB_DIR = "wandb"  # log.wandb's files, written by wandb itself (trainer/observe/trackers.py)
SLURM_DIR = "slurm"
REQUEUE_FILE = os.path.join(SLURM_DIR, "requeue.json")
# Every name the project writes or reads in a run dir, file or folder (tests/{unit,system}/test_plant.py plants a
# link and a FIFO at each and checks nothing is written or read through it).
WRITTEN_FILES = RUN_DIR_FILES + (SUPERSEDED_FILE, TRACKERS_FILE, REQUEUE_FILE, RUN_ID_FILE)
WRITTEN_FOLDERS = (
    CHECKPOINTS_DIR,
    HEARTBEATS_DIR,
    HEALTH_DIR,
    HANGS_DIR,
    TRACE_DIR,
    SLURM_DIR,
    TENSORBOARD_DIR,
    WANDB_DIR,
)
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
    if root is None:
        root = checkpoints_dir(run_dir)
        if os.path.islink(root):
            return []
    if not os.path.isdir(root):
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


def _regular_problem(path, name):
    """Why `name` in the checkpoint folder `path` is not a regular file (missing, a link, a FIFO...),
    told by lstat alone (nothing followed, nothing opened), or None."""
    try:
        mode = os.lstat(os.path.join(path, name)).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return "unreadable ({})".format(e.strerror or e)
    if stat.S_ISLNK(mode):  # the words of files.py's own refusal
        return "a symbolic link; the project never follows one here"
    return None if stat.S_ISREG(mode) else "{}, not a regular file".format(files.kind(mode))


def files_problem(path):
    """Why the folder at `path` is not a committed checkpoint by its files alone, or None.

    A commit writes meta.json last, after DCP's .metadata (or the chunk index that stands for it,
    chunks.npz, where .metadata follows the commit: trainer/checkpoint/stock.py) and every shard:
    both present and a meta.json with every key is what a commit leaves.
    trainer/checkpoint/manager.py checks the shards too."""
    why = _regular_problem(path, ".metadata")
    if why == "missing":
        why = _regular_problem(path, "chunks.npz")
        if why == "missing":
            return "no DCP .metadata"
        if why:
            return "its chunks.npz is {}".format(why)
    elif why:
        return "its .metadata is {}".format(why)
    why = _regular_problem(path, "meta.json")
    if why == "missing":
        return "no meta.json"
    if why:
        return "its meta.json is {}".format(why)
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as e:
        return "unreadable meta.json ({})".format(e)
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        return "meta.json lacks {}".format(", ".join(missing))
    return None


MANIFEST_FILE = "manifest.json"
MANIFEST_BYTES = (
    256 << 20
)  # the most a manifest.json is read (trainer/checkpoint/checksums.py: ~3 million files' entries)


def manifest_problem(path, meta, absent=()):
    """Why the checkpoint folder at `path`, whose meta.json is `meta`, does not hold the files its
    manifest.json lists, by what the standard library can tell: the manifest a regular file that
    parses, listing files inside the folder, each there as a regular file of the size listed; or
    None (also for a checkpoint saved before manifests: no manifest.json, and a meta.json that does
    not name one). Their checksums are trainer/checkpoint/checksums.py's to check (it needs xxhash).
    A file named in `absent` may be missing (an s3:// run dir's shards, fetched when a load reads them)."""
    why = _regular_problem(path, MANIFEST_FILE)
    if why == "missing":
        return (
            "{} is missing, though meta.json says its commit wrote one".format(MANIFEST_FILE)
            if meta.get("manifest")
            else None
        )
    if why:
        return "{} is {}".format(MANIFEST_FILE, why)
    try:
        listed = files.read_json(os.path.join(path, MANIFEST_FILE), MANIFEST_BYTES)["files"]
        if not isinstance(listed, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return "{} is damaged: it is not what the commit wrote".format(MANIFEST_FILE)
    for name, want in sorted(listed.items()):
        parts = name.split("/")
        if name.startswith("/") or ".." in parts:
            return "{} names {}, a file outside the checkpoint".format(MANIFEST_FILE, name)
        if not (isinstance(want, dict) and isinstance(want.get("size"), int)):
            return "{} is damaged: it is not what the commit wrote".format(MANIFEST_FILE)
        why = _regular_problem(path, os.path.join(*parts))
        if why == "missing" and name in absent:
            continue
        if why == "missing" and name.endswith(".distcp"):
            return "shard file {} missing or truncated".format(name)  # the words of a check older than manifests
        if why:
            return "{} is {}".format(name, why)
        size = os.lstat(os.path.join(path, *parts)).st_size
        if name.endswith(".distcp") and size < want["size"]:
            return "shard file {} missing or truncated".format(name)
        if size != want["size"]:
            return "{} is damaged: {} bytes, but {} were written".format(name, size, want["size"])
    return None


def checkpoint_problem(path, step, run, absent=()):
    """Why the folder at `path`, listed as checkpoint `step` of the run whose id is `run` (None: a run
    without one), is not a good checkpoint of that run, or None. The one answer, by what the standard
    library can tell, to "is this a checkpoint of ours": the launcher's "nothing to do", the Slurm
    requeue check and the trainer ask it (the trainer then hashes and unpickles what it loads,
    trainer/checkpoint/manager.py). A symbolic link; the files a commit leaves (files_problem); the files its
    manifest lists (manifest_problem); meta.json's step is the folder's (else a copy under another
    name); the run id of meta.json and manifest.json is this run's (a checkpoint saved before run ids
    has none, and is checked by its step). `absent`: files it may lack (manifest_problem)."""
    if os.path.islink(path):
        return "a symbolic link, not a folder this run saved; give it as checkpoint.resume_from instead"
    why = files_problem(path)
    if why:
        return why
    meta = read_meta(path)
    why = manifest_problem(path, meta, absent)
    if why:
        return why
    if meta.get("step") != step:
        return (
            "its meta.json says step {!r}, not {} as its folder's name: it is a copy of another checkpoint; "
            "move it away, or give it as checkpoint.resume_from".format(meta.get("step"), step)
        )
    saved_by = meta.get("run_id")
    manifest = os.path.join(path, MANIFEST_FILE)
    has_manifest = os.path.lexists(manifest)  # manifest_problem found it a regular file that parses
    if saved_by is not None and not has_manifest:  # run ids came after manifests: no trainer saved this
        return (
            "its meta.json has a run id but neither a manifest.json nor its name, which no trainer saves: "
            "its manifest was removed and meta.json changed; move it away"
        )
    if saved_by is None or run is None:
        return None
    recorded = files.read_json(manifest, MANIFEST_BYTES).get("run_id") if has_manifest else None
    if saved_by != run:
        return (
            "it was saved by another run (run id {}, this run's is {}); move it away, or start a new run_dir "
            "with checkpoint.resume_from={}".format(str(saved_by)[:32], run, path)
        )
    if has_manifest and recorded != saved_by:
        return (
            "its manifest.json names run id {}, its meta.json this run's ({}): one of them was changed; move "
            "it away".format(str(recorded)[:32], run)
        )
    return None


def read_run_id(run_dir):
    """The run's identity (its run_id file, trainer/checkpoint/manager.py writes it), or None where it has
    none or it cannot be read (trainer/checkpoint/manager.py says why at the start)."""
    try:
        return files.read_text(os.path.join(str(run_dir), RUN_ID_FILE), limit=256).strip() or None
    except OSError:
        return None


def latest_committed_step(run_dir):
    """Step of the newest folder that is a good checkpoint of this run (checkpoint_problem), or None."""
    run = read_run_id(run_dir)
    for step, path in reversed(step_folders(run_dir)):
        if checkpoint_problem(path, step, run) is None:
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


def steps_saved_for(run_dir, step):
    """train.steps of the run when it saved checkpoint `step` (its meta.json's config), or None
    where it does not say (an older trainer's, or unreadable): whether a run finished is what its
    newest checkpoint proves, never what status.json (which anyone who can write the run dir can
    write) says."""
    if step is None:
        return None
    try:
        steps = read_meta(step_path(run_dir, step)).get("config", {}).get("train", {}).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


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
