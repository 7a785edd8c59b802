"""Checkpoints with torch.distributed.checkpoint (DCP) on a shared filesystem.

Layout of `<run_dir>/checkpoints/`:

    step_00000100/        a complete checkpoint: it only ever appears by an atomic rename
        .metadata, *.distcp   DCP: the sharded parts (model, optim, ...), each rank writing its own shards
        chunks.npz        the same metadata as arrays (trainer/checkpoint/save_plan.py), which a load reads instead;
                          past 100,000 chunk records .metadata follows the commit (trainer/checkpoint/stock.py;
                          not with an s3:// run dir)
        meta.json         step, samples consumed, world size, parameter shapes, the small parts (scheduler, ...)
        rng/rank_00000.pt the per-rank parts: each rank's random number generator states
        manifest.json     size and checksum of every file above (trainer/checkpoint/checksums.py)
    .tmp_step_00000200/   a save in progress (or killed): never read, removed on the next start

A save writes into the temporary folder; once every rank's shards are on disk (DCP's coordinator
has written `.metadata`), rank 0 writes meta.json and manifest.json, fsyncs and renames the folder
to its final name. Only rank 0 creates, renames, lists and deletes folders, and it tells the other
ranks which checkpoint to load, so no rank acts on a stale view of an NFS or Lustre directory.
With an s3:// run dir (trainer/checkpoint/remote.py) the folder is each node's staging copy: each
node's local rank 0 makes the folders a save needs there, and a save counts once uploaded with its
manifest last.

What is saved is a set of named parts, each a `Stateful` (state_dict() and load_state_dict(), as
torchtitan's CheckpointManager takes them), kept in one of three places by its kind: sharded parts
(the model, the optimizer, any other state of sharded tensors) through DCP, resharded at a load on
another number of ranks; small parts (the scheduler, the loss scaler) in meta.json; per-rank parts
(the random states) one file per rank, restored only on as many ranks as saved them. A checkpoint
saved before a part existed loads without it, the part starting afresh.

A checkpoint may come from elsewhere (checkpoint.resume_from, a copied run dir): loading or listing
one never runs code it carries (trainer/checkpoint/reader.py), listing reads its manifest and no pickle,
a symbolic link in checkpoints/ is never written or deleted through, and a checkpoint with any file
not as its commit wrote it is skipped like an unreadable one (docs/security.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import re
import stat
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainer import __version__, torch_compat
from trainer.checkpoint import checksums, load_plan, remote, save_plan, stock
from trainer.checkpoint.checksums import ChecksumWriter
from trainer.checkpoint.reader import Refused, ShardReader, load_metadata
from trainer.config import CheckpointArgs
from trainer.rundir import files, layout, objects
from trainer.rundir.layout import read_meta, step_path

if TYPE_CHECKING:
    from trainer.preflight.interval import AutoInterval

log = logging.getLogger("trainer")


# DCP's save-plan caching (torch 2.6+; 2.11 and 2.14 have it), and the class-level caches it fills.
_PLAN_CACHING = "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names it and what to do."""


folder = layout.checkpoints_dir


def problem(path: str, later: frozenset[str] = frozenset()) -> str | None:
    """Why `path` is not a usable checkpoint, or None if it looks complete: the files a commit
    leaves (trainer/rundir/layout.py), then every file as large as its manifest says (but those in
    `later`, still in an s3:// run dir's bucket: remote.Staging.later), or for a checkpoint
    saved before manifests (its meta.json does not name one), every shard file as long as DCP's
    metadata says."""
    why = layout.files_problem(path)
    if why:
        return why
    if os.path.exists(os.path.join(path, checksums.MANIFEST)) or layout.read_meta(path).get("manifest"):
        return checksums.manifest_problem(path, absent=tuple(later))
    try:
        needed: dict[str, int] = {}
        for info in load_metadata(os.path.join(path, ".metadata")).storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Refused as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any unreadable file makes it unusable
        return f"unreadable metadata ({type(e).__name__}: {e})"
    for name, size in needed.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or os.path.getsize(file) < size:
            return f"shard file {name} missing or truncated"
    return None


def unusable(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None: `problem`, then closer, as rank 0
    does before any rank reads it: the checksum of every file the load does not check as it reads
    (all but the shards), and DCP's metadata unpickled with nothing but its own classes."""
    return _checked_metadata(path)[0]


def _checked_metadata(
    path: str, later: frozenset[str] = frozenset()
) -> tuple[str | None, dcp.metadata.Metadata | Indexed | None]:
    """(`unusable`'s answer, the checkpoint's DCP metadata as rank 0 reads it once and hands to
    every rank at a load, or None where it is unusable): its chunk index (save_plan.INDEX, numeric
    arrays, checked against the manifest as read) where the save wrote one, and then its
    `.metadata` (1.2 GB at 16k ranks) is neither hashed nor read; else `.metadata` by the
    restricted unpickler. `later`: files still in the bucket (`problem`)."""
    indexed = checksums.listed(path, save_plan.INDEX)
    unread = (".metadata", save_plan.INDEX) if indexed else ()
    why = problem(path, later) or checksums.manifest_problem(path, deep=True, unread=unread, absent=tuple(later))
    if why:
        return why, None
    try:
        if indexed:
            return None, _read_index(path, indexed)
        return None, load_metadata(os.path.join(path, ".metadata"))
    except (Refused, save_plan.BadIndex) as e:
        return str(e), None
    except Exception as e:  # noqa: BLE001 - any unreadable file makes it unusable
        return f"unreadable metadata ({type(e).__name__}: {e})", None


class Indexed:
    """A checkpoint's chunk index as rank 0 read it (save_plan.read_index's header and arrays)."""

    def __init__(self, header: dict, arrays: dict):
        self.header, self.arrays = header, arrays


def _read_index(path: str, record: dict) -> Indexed:
    """The chunk index of the checkpoint at `path`, its bytes read once and checked against the
    manifest's `record` before anything is made of them (save_plan.read_checked_index)."""
    return Indexed(*save_plan.read_checked_index(path, record))


def checked_metadata(path: str) -> tuple[str | None, dcp.metadata.Metadata | None]:
    """(`unusable`'s answer, the whole DCP metadata of the checkpoint at `path`), for a reader in one
    process (trainer.export): built from its chunk index where it has one (its `.metadata`, which
    may be written after the commit for stock DCP, is then not read), else its `.metadata` by the
    restricted unpickler; every byte of either checked against the manifest."""
    why, metadata = _checked_metadata(path)
    if isinstance(metadata, Indexed):
        metadata = save_plan.full_metadata(metadata.header, metadata.arrays)
    return why, metadata


_RUN_ID = re.compile(r"[0-9a-f]{32}")  # what run_id holds: 128 random bits in hex


def run_id(run_dir: str, create: bool = False) -> str | None:
    """The identity of the run in `run_dir` (its run_id file), or None where it has none (a run
    started before run ids); `create`: write one first if absent (rank 0 at a start)."""
    path = os.path.join(str(run_dir), layout.RUN_ID_FILE)
    try:
        text = files.read_text(path, limit=256).strip()
    except FileNotFoundError:
        if not create:
            return None
        text = uuid.uuid4().hex
        files.write_text(path, text + "\n")
    except OSError as e:
        raise CheckpointError(f"{e}; the run's identity is read from it: remove it, or start a new run_dir") from None
    if not _RUN_ID.fullmatch(text):
        raise CheckpointError(
            f"{path} holds {text[:40]!r}, not a run id the trainer writes; remove it (its checkpoints are then "
            f"loaded only through checkpoint.resume_from), or start a new run_dir"
        )
    return text


def complete(
    run_dir: str,
    said: set | None = None,
    held: files.HeldFolder | None = None,
    shown: Callable[[str], str] = str,
    later: Callable[[str], frozenset[str]] = lambda path: frozenset(),
) -> list[tuple[int, str]]:
    """Complete checkpoints in `run_dir` that this run saved, oldest first; broken ones, and those
    of another run or copied under another step, are skipped with a warning, once per folder and
    reason when `said` (the lines said so far, added to) is given. Nothing is unpickled for those
    with a manifest (trainer/checkpoint/checksums.py). `held`: checkpoints/ as the run holds it open, listed
    and read by its descriptor (the paths returned and said are by name all the same). `shown`: a
    path as the lines name it (Checkpointer.shown: an s3:// run dir's URL, not its staging copy).
    `later(path)`: the files of a checkpoint still in the bucket (remote.Staging.later)."""
    found = []
    run = run_id(run_dir)
    for step, path in layout.step_folders(run_dir, held.path if held else None):
        where = step_path(run_dir, step)
        absent = later(where)
        why = layout.checkpoint_problem(path, step, run, tuple(absent)) or problem(path, absent)  # then closer
        if why and (said is None or (shown(where), why) not in said):
            log.warning("skipping checkpoint %s: %s", shown(where), why)
            if said is not None:
                said.add((shown(where), why))
        elif not why:
            found.append((step, where))
    return found


def _saved_by_another(path: str, run: str | None) -> str | None:
    """The run id of the run that saved the checkpoint folder at `path` when it is not `run`, as its
    meta.json or manifest.json says (either, readable, naming another), else None: such a folder is
    never discarded, replaced or retired by this run, whatever state it is in."""
    if run is None:
        return None
    for name, limit in (("meta.json", files.SMALL_FILE_BYTES), (checksums.MANIFEST, checksums.MANIFEST_BYTES)):
        try:
            saved_by = files.read_json(os.path.join(path, name), limit).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
        if saved_by is not None and saved_by != run:
            return str(saved_by)[:32]
    return None


def latest_step(run_dir: str) -> int | None:
    """Step of the newest complete checkpoint in `run_dir`, or None."""
    found = complete(run_dir)
    return found[-1][0] if found else None


def earlier_save(run_dir: str) -> str | None:
    """What says that this run saved a checkpoint before, or None: status.json's `saved` (the newest
    commit's step) or `step` (where a start resumed, or where the run stopped or finished). A start
    that finds no checkpoint where one was saved refuses to begin from step 0 (checkpoint.start_over
    does it on purpose): a neighbour's `mv checkpoints .hidden` must not silently restart the run."""
    status = layout.read_status(run_dir)  # a link or FIFO there: files.UnsafeFile, one line
    steps = [v for v in (status.get("saved"), status.get("step")) if isinstance(v, int) and not isinstance(v, bool)]
    newest = max(steps, default=0)
    return f"{os.path.join(run_dir, layout.STATUS_FILE)} says step {newest} was saved" if newest > 0 else None


def shapes(model_state: dict) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}


def check_compatible(path: str, saved: dict[str, list[int]], current: dict[str, list[int]]) -> None:
    """Name the first difference between the checkpoint's parameters and the model's."""
    for key in sorted(set(saved) | set(current)):
        if key not in current:
            raise CheckpointError(
                f"checkpoint {path} has parameter '{key}' that the model lacks: it was saved for another model.* "
                "config; use the matching config or a new run_dir"
            )
        if key not in saved:
            raise CheckpointError(
                f"checkpoint {path} lacks parameter '{key}' of this model: it was saved for another model.* config; "
                "use the matching config or a new run_dir"
            )
        if saved[key] != current[key]:
            raise CheckpointError(
                f"checkpoint {path}: parameter '{key}' has shape {saved[key]} but the model has {current[key]}; use "
                "the matching model.* config or a new run_dir"
            )


@contextlib.contextmanager
def _write_errors(step: int, tmp: str, held: files.HeldFolder | None = None, staging: remote.Staging | None = None):
    """A failed write (full disk, quota, permissions) as one CheckpointError line naming the cause
    and the path, instead of DCP's per-rank tracebacks. What was committed before stays intact.
    `held`: the checkpoints/ folder `tmp` is in, whose name the line says rather than /proc's;
    `staging`: an s3:// run dir's, whose URL the line names (the local path follows in parentheses:
    it is that disk that is full)."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        causes = [c for c, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
        oserror = next((c for c in causes if isinstance(c, OSError)), None)
        cause = oserror or causes[0]
        what = (
            f"{oserror.strerror} ({oserror.filename or tmp})"
            if oserror and oserror.strerror
            else f"{type(cause).__name__}: {cause}"
        )
        free = _free_bytes(tmp)
        if oserror is None and free is not None and free < 1 << 20:  # torch.save hides ENOSPC ("unexpected pos")
            what = f"No space left on device ({tmp}: {free} bytes free)"
        elif oserror is None:  # not the filesystem: a rank failed (a peer gone mid-save), which a restart fixes
            raise
        if held is not None:
            what = what.replace(held.path, held.name)
        where = f" to {staging.url} (in the staging folder {staging.local})" if staging is not None else ""
        raise CheckpointError(
            f"saving the checkpoint of step {step}{where} failed: {what}; the checkpoints saved before are "
            f"intact; free space or fix the filesystem, then start again to resume"
        ) from None


def _free_bytes(path: str) -> int | None:
    """Bytes free for this user on the filesystem that holds `path` (or its nearest parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _warn_if_others_can_write(path: str) -> None:
    """One line for the checkpoint folder `path`, and one for the folder holding it (unless sticky,
    as /tmp), if users other than its owner can write there: they can change what a run loads."""
    for folder in (path, os.path.dirname(os.path.abspath(path))):
        try:
            mode = os.stat(folder).st_mode
        except OSError:
            continue
        if not mode & (stat.S_IWGRP | stat.S_IWOTH) or (folder != path and mode & stat.S_ISVTX):
            continue
        what = "checkpoint folder" if folder == path else f"folder holding checkpoint {os.path.basename(path)},"
        log.warning(
            "%s %s can be written by users other than its owner (mode %04o): they can change what this run "
            "loads; chmod go-w %s",
            what,
            folder,
            stat.S_IMODE(mode),
            folder,
        )


def unverified(path: str) -> str | None:
    """What cannot be verified of the checkpoint at `path`, or None: a checkpoint saved before
    manifests (trainer/checkpoint/checksums.py) has no checksum of its small files. The decision (issue 32):
    such a checkpoint is still loaded, verified where it can be, with this said once."""
    if os.path.lexists(os.path.join(path, checksums.MANIFEST)):
        return None
    return (
        f"checkpoint {path} was saved before manifests (by an older trainer): {_shards_checked(path)}, its "
        f".metadata by the restricted unpickler, its random states and optimizer groups by their types and "
        f"shapes, but a change to its meta.json, .metadata or rng files that keeps them valid is not detected; "
        f"its next save writes a manifest"
    )


def _shards_checked(path: str) -> str:
    """What checks the shard files of the checkpoint `path` (saved before manifests), in words: their
    .xxh3 records, the .crc32 records of a trainer before XXH3, or none (issue 41 item 12: the line
    said .xxh3 records where there were none, and 38 damaged variants loaded other weights)."""
    found = checksums.shard_records(path)
    total = sum(map(len, found.values()))
    parts = [f"{len(found[k])} by their .{k} records" for k in ("xxh3", "crc32") if found[k]]
    if not found["none"]:
        return f"its {total} shard file(s) are checked, " + " and ".join(parts)
    unchecked = (
        f"{len(found['none'])} of its {total} shard file(s) have no checksum record (saved before checksums): "
        f"damage to their bytes loads unnoticed"
    )
    return unchecked + (", the others are checked, " + " and ".join(parts) if parts else "")


def _warn_if_unverified(path: str) -> None:
    why = unverified(path)
    if why:
        log.warning("%s", why)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class ModelState:
    """The model's weights, a sharded part: each rank saves and loads its shards (torchtitan's ModelWrapper)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's state, a sharded part, keyed by parameter name. `problem` names what makes a
    state read from a checkpoint unfit before anything is set: its param_groups, which DCP reads as
    they were pickled, against those of the state_dict() the read was made into.

    Under pipeline parallelism (`stages`: the pipeline's process group) each stage's optimizer holds
    its own parameters, but DCP keeps one copy of the param_groups (one rank's): they name every
    stage's parameters, so that a checkpoint of any number of stages loads into any other; a stage
    loads its own of them."""

    def __init__(self, model, optimizer, stages: dist.ProcessGroup | None = None):
        self.model, self.optimizer, self.stages = model, optimizer, stages
        self.groups: list[dict] = []  # the param_groups of the last state_dict(), as this run has them
        self.every_stage: list[list] | None = None  # each group's parameters on every stage, in stage order
        self.own: set[str] = set()  # this stage's parameters (`stages`)

    def state_dict(self) -> dict:
        state = get_optimizer_state_dict(self.model, self.optimizer)
        if self.stages is not None:
            groups = state.get("param_groups", [])
            self.own = {p for g in groups for p in g["params"]}
            if self.every_stage is None:  # gathered once: the stages' parameters do not change
                every: list = [None] * dist.get_world_size(self.stages)
                dist.all_gather_object(every, [list(g["params"]) for g in groups], group=self.stages)
                self.every_stage = [[p for stage in every for p in stage[i]] for i in range(len(groups))]
            state["param_groups"] = [{**g, "params": list(p)} for g, p in zip(groups, self.every_stage)]
        self.groups = [dict(g) for g in state.get("param_groups", [])]
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.stages is not None:  # this stage's parameters of each group
            groups = [{**g, "params": [p for p in g["params"] if p in self.own]} for g in state["param_groups"]]
            state = {**state, "param_groups": groups}
        set_optimizer_state_dict(self.model, self.optimizer, state)

    def problem(self, state: dict) -> str | None:
        return _param_groups_problem(state.get("param_groups"), self.groups)


class RandomStates:
    """This rank's random number generators, a per-rank part (rng/rank_N.pt): read with
    torch.load(weights_only=True) and checked by `problem` before anything is set."""

    def state_dict(self) -> dict:
        return _rng_state()

    def load_state_dict(self, rng: dict) -> None:
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])

    @staticmethod
    def problem(rng) -> str | None:
        try:
            _check_rng(rng)
        except ValueError as e:
            return str(e)
        return None


# The (rank, world size) the process-based async save's background process was made for: DCP starts
# one per trainer process, at its first such save, with a process group of that size, and keeps it.
_SAVER_PROCESS_FOR: tuple[int, int] | None = None


def _stager(rank: int, world_size: int) -> dict:
    """Arguments for dcp.async_save: one stager kept for the whole run, copying the state in a
    background thread into buffers it reuses from save to save (allocating them anew each time is
    what makes an async save stall the loop), pinned where CUDA is. Where the installed torch has
    it, the save itself runs in DCP's background process (AsyncCheckpointerType.PROCESS): the
    planning, the writes and their checksums (ChecksumWriter is pickled to it, and writes its
    .xxh3 records there) hold no lock of the training's Python. The staged copy is then in shared
    memory, which the process reads without another copy. DCP keeps one such process per trainer
    process, with a process group of the first save's size: a later Checkpointer of another
    (rank, world size) in the same process (tests, the bench) saves with the thread instead.
    Older torch without DefaultStager: its default (the thread, a fresh copy per save)."""
    global _SAVER_PROCESS_FOR
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return {}
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        process = AsyncCheckpointerType.PROCESS
    except (ImportError, AttributeError):
        process = None
    if "async_checkpointer_type" not in inspect.signature(dcp.async_save).parameters:
        process = None
    if process is not None and _SAVER_PROCESS_FOR not in (None, (rank, world_size)):
        log.info(
            "async saves of this %d-rank checkpointer run in a thread: DCP's save process is for another", world_size
        )
        process = None
    cuda = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=process is not None,
        use_async_staging=True,
        use_non_blocking_copy=cuda,
    )
    if process is None:
        return {"async_stager": DefaultStager(options)}
    _SAVER_PROCESS_FOR = (rank, world_size)
    return {"async_stager": DefaultStager(options), "async_checkpointer_type": process}


@functools.cache
def _stager_reusable() -> bool:
    """Whether one DefaultStager stages more than once. torch 2.11's empties its copier table at the
    end of every stage (to break a reference cycle), so its second stage raises KeyError(type): with
    it every async save after the first failed. 2.14's keeps it. Tried once, on a tiny state."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        stager.close()
    return True


def _check_rng(rng) -> None:
    """Raise ValueError unless `rng` (an rng/rank_N.pt as read) is what a save writes and each of its
    states is one its generator takes: tried on a scratch generator, so nothing is set yet."""
    if not (isinstance(rng, dict) and torch.is_tensor(rng.get("torch"))):
        raise ValueError("not the random states a save writes")
    kinds = [("torch", "cpu")] + ([("cuda", "cuda")] if "cuda" in rng and torch.cuda.is_available() else [])
    for key, device in kinds:
        state = rng[key]
        if not torch.is_tensor(state) or state.dtype != torch.uint8 or state.dim() != 1:
            raise ValueError(f"its {key} random state is not a flat uint8 tensor")
        if key == "torch" and state.shape != torch.get_rng_state().shape:
            raise ValueError(f"its torch random state has shape {list(state.shape)}, not the generator's")
        try:
            torch.Generator(device=device).set_state(state)
        except RuntimeError as e:
            raise ValueError(f"its {key} random state is refused by the generator ({e})") from None


def _same_kind(loaded, wanted) -> bool:
    """Whether an optimizer setting read from a checkpoint can stand where this run's `wanted` does."""
    if isinstance(wanted, bool) or wanted is None:
        return isinstance(loaded, bool) or loaded is None
    if isinstance(wanted, (int, float)):
        return isinstance(loaded, (int, float)) and not isinstance(loaded, bool) and math.isfinite(loaded)
    if isinstance(wanted, (tuple, list)):
        return (
            isinstance(loaded, (tuple, list))
            and len(loaded) == len(wanted)
            and all(_same_kind(a, b) for a, b in zip(loaded, wanted))
        )
    return isinstance(loaded, type(wanted))


def _param_groups_problem(loaded, expected: list[dict]) -> str | None:
    """Why the optimizer's `param_groups` as read from a checkpoint cannot replace this run's
    (`expected`, as get_state_dict gives them: parameters by name), or None: as many groups, each a
    dict with every setting the optimizer uses and of its kind, the same parameters in all."""
    if not isinstance(loaded, list) or len(loaded) != len(expected):
        held = f"{len(loaded)} group(s)" if isinstance(loaded, list) else f"a {type(loaded).__name__}"
        return f"param_groups holds {held}, not {len(expected)} group(s)"
    names = set()
    for index, (group, wanted) in enumerate(zip(loaded, expected)):
        if not isinstance(group, dict):
            return f"param_groups[{index}] is a {type(group).__name__}, not a dict"
        params = group.get("params")
        if not isinstance(params, list) or not all(isinstance(p, (str, int)) for p in params):
            return f"param_groups[{index}]['params'] is not a list of parameters"
        names.update(params)
        for key, value in wanted.items():
            if key == "params":
                continue
            if key not in group:
                return f"param_groups[{index}] lacks {key!r}, which the optimizer needs"
            if not _same_kind(group[key], value):
                return f"param_groups[{index}][{key!r}] is {group[key]!r:.40}, not a {type(value).__name__}"
    wanted_names = {p for g in expected for p in g.get("params", [])}
    if names != wanted_names:
        return f"param_groups name {len(names)} parameters, not this model's {len(wanted_names)}"
    return None


# meta.json's keys the checkpointer writes itself (and `progress`'s); no part may be named like one.
OWN_KEYS = (
    "step",
    "sharded",
    "world_size",
    "optimizer",
    "shapes",
    "torch",
    "trainer",
    "saved_at",
    "samples",
    "config",
    "manifest",
    "run_id",
)


def _sharded_names(path: str, meta: dict) -> list[str]:
    """The sharded parts the checkpoint at `path` holds, as its meta.json lists them; one saved
    before the list was kept holds the model and the optimizer."""
    names = meta.get("sharded", ["model", "optim"])
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names) and {"model", "optim"} <= set(names)):
        raise CheckpointError(
            f"checkpoint {path}: meta.json's 'sharded' is {str(names)[:60]}, not the list of parts a save writes; "
            f"give another checkpoint as checkpoint.resume_from, or move it away"
        )
    return names


class Checkpointer:
    reader = ShardReader  # the DCP StorageReader loads read with (the bench swaps in DCP's own to compare)
    # Asked by rank 0 right before it commits or deletes a checkpoint; False: this run lost the run
    # dir to another run (trainer/rundir/lease.py), so it leaves the folders alone. None: always go on.
    still_owner: Callable[[], bool] | None = None

    def __init__(
        self,
        args: CheckpointArgs,
        run_dir: str,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup,
        model,
        optimizer,
        parts: dict[str, Stateful] | None = None,
        sharded: dict[str, Stateful] | None = None,
        stages: dist.ProcessGroup | None = None,
        staging: remote.Staging | None = None,
    ):
        """What a checkpoint holds, each part a `Stateful` saved under its name: `model` and `optimizer`
        (the sharded parts "model" and "optim") and `sharded`, more states of (D)tensors that DCP saves
        and reshards like them (EMA weights, a second optimizer); each rank's random states ("rng");
        and `parts`, states small enough for meta.json (the scheduler, the loss scaler, ...). A new
        part is one more entry; a checkpoint saved before it existed loads without it. `stages`: the
        process group of a pipeline's stages (parallel.pp), whose ranks hold different parameters of
        one model (each under its whole-model name): meta.json's shapes are all of theirs. `staging`:
        an s3:// run dir's (remote.py): `run_dir` is then this node's staging folder, each node's
        local rank 0 makes its folders, and a save is uploaded before it counts."""
        self.remote = staging
        self.leader = rank == 0 if staging is None else staging.leader  # makes this node's folders
        # local folder -> the name a user knows it by (`shown`): an s3:// run dir's staging folder its URL;
        # a checkpoint downloaded from a bucket for checkpoint.resume_from its URL (trainer/train.py adds it)
        self.aliases: dict[str, str] = {staging.local: staging.url} if staging is not None else {}
        self.args, self.run_dir, self.rank, self.world_size, self.group = args, run_dir, rank, world_size, group
        self.model, self.optimizer, self.stages = model, optimizer, stages
        self.whole_shapes: dict[str, list[int]] | None = None  # every stage's parameters' shapes (`_shapes`)
        self.parts = {name: part for name, part in (parts or {}).items() if part is not None}
        taken = set(self.parts) & set(OWN_KEYS)
        if taken:
            raise ValueError(f"checkpoint part names {sorted(taken)} are meta.json's own keys; choose other names")
        self.sharded: dict[str, Stateful] = {
            "model": ModelState(model),
            "optim": OptimizerState(model, optimizer, stages),
        }
        self.per_rank: dict[str, Stateful] = {"rng": RandomStates()}
        extra = {name: part for name, part in (sharded or {}).items() if part is not None}
        taken = set(extra) & (set(self.sharded) | set(self.per_rank) | set(self.parts))
        if taken:
            raise ValueError(f"sharded checkpoint part names {sorted(taken)} are taken by other parts; choose others")
        self.sharded.update(extra)
        self.pending: tuple[Future, int, str, dict] | None = None  # an async save not yet committed
        self.staging: Future | None = None  # its copy of the state, until the copy is done
        self.last_saved: int | None = None
        self.metadata: dcp.metadata.Metadata | None = None  # of the checkpoint `choose` chose, as rank 0 read it
        self.chunk_index: dict | None = None  # load_plan.index of that metadata, made by rank 0 with it
        self.indexed: Indexed | None = None  # rank 0: the chosen checkpoint's chunk index, until sent
        self.plan_key = (
            f"trainer.checkpoint.manager/{uuid.uuid4().hex}/{world_size}"  # this one's save plans (`_planner`)
        )
        self.planned_by: str | None = None  # how the last save was planned: "layout" (save_plan.py) or "dcp"
        self.said: set[tuple[str, str]] = set()  # (folder, why) of the checkpoints skipped so far: said once
        self.stager = _stager(rank, world_size) if args.async_save else None
        # checkpoints/, held open by every rank for the whole run (files.HeldFolder): every folder a
        # save makes, renames or deletes is made, renamed or deleted in it, and DCP writes into it by
        # its descriptor, so that a neighbour who renames it and puts a link or a folder of theirs
        # under its name redirects nothing; rank 0 stops the run when it sees that (`_held`).
        self.held: files.HeldFolder | None = None
        # rank 0: the background writer of .metadata for stock DCP, after a commit without it (stock.py)
        self.stock: stock.Writer | None = None
        if self.leader:
            os.makedirs(run_dir, exist_ok=True)
            files.make_folder(folder(run_dir), 0o777)  # as os.makedirs: the umask decides; a link is refused
            self.held = files.HeldFolder(folder(run_dir))
            self.stock = stock.Writer(self.held) if rank == 0 else None
            for name in self.held.listdir():
                # leftovers of a killed save or delete
                if name.startswith((".tmp_", ".trash_")) and self._remove(name):
                    log.info("removed unfinished %s", self.shown(os.path.join(folder(run_dir), name)))
        try:  # recorded in every save's meta.json
            self.run_id = run_id(run_dir, create=True) if rank == 0 else None
        except CheckpointError as e:  # an s3:// run dir's run_id object: named by its URL
            raise CheckpointError(self.shown(str(e))) from None
        if staging is None:
            identity = [self.held.identity[1] if self.held else None]
            dist.broadcast_object_list(identity, src=0, group=group)
        else:  # each node's own staging folder: compared with its node's leader's
            nodes: list = [None] * world_size
            dist.all_gather_object(nodes, (staging.node, self.held.identity[1] if self.held else None), group=group)
            identity = [next(inode for node, inode in nodes if node == staging.node and inode is not None)]
        if not self.leader:  # its own descriptor of the same folder (the inode: st_dev differs between NFS clients)
            self.held = files.HeldFolder(folder(run_dir))
            if self.held.identity[1] != identity[0]:
                raise CheckpointError(
                    f"{folder(run_dir)} on rank {rank} is another folder than rank 0's: it was replaced while the "
                    f"run started; see who renamed it (ls -la {run_dir}) and start again"
                )

    def _later(self, path: str) -> frozenset[str]:
        """The files of the checkpoint folder `path` still in an s3:// run dir's bucket (remote.Staging.later)."""
        return self.remote.later(path) if self.remote is not None else frozenset()

    def shown(self, path: str) -> str:
        """`path` as the user knows it: under an alias's local folder (an s3:// run dir's staging copy,
        a checkpoint downloaded from a bucket) its URL, s3://BUCKET/PREFIX/...; else `path` itself."""
        for local, url in self.aliases.items():
            if path == local or path.startswith(local + os.sep):
                return url + path[len(local) :].replace(os.sep, "/")
        return path

    # -- when to save -------------------------------------------------------------------------------

    def plan(self, total_steps: int, start_step: int, auto: AutoInterval | None = None, say=log.info) -> None:
        """Before the first step: the run ends at `total_steps` and starts at `start_step`; `auto` is
        checkpoint.interval=auto's state (None: the fixed interval); `say` shows its lines."""
        self.total_steps, self.auto, self.say = total_steps, auto, say
        self.segment = (start_step, time.perf_counter())  # the step and time of the last save (or the start)

    def due(self, step: int, stopping: bool) -> bool:
        """Whether a save belongs after `step`: a stop, the last step, the interval, or auto's interval
        (chosen once the first step's time is known). Every rank calls it after every step and gets
        the same answer. It also commits a finished async save."""
        self.poll()
        since, started = self.segment
        if self.auto is None:
            due = bool(self.args.interval) and step % self.args.interval == 0
        else:
            if self.auto.steps is None:  # the first step's time is known: choose with the estimated save cost
                (step_s,) = self._agreed_max((time.perf_counter() - started) / (step - since))
                self.auto.choose(step_s)
                self.say(self.auto.line(step, step_s, since + self.auto.steps))
            due = step - since >= self.auto.steps
        return stopping or step == self.total_steps or due

    def save_due(self, step: int, progress: dict, stopping: bool) -> None:
        """The save `due` asked for: blocking at a stop and at the end (or without async_save), timed;
        a blocking save's cost goes into status.json (make submit sizes the stop warning with it), and
        auto's interval is chosen again when the measured cost differs from the one it used."""
        since, started = self.segment
        elapsed, steps = time.perf_counter() - started, step - since
        last = step == self.total_steps
        blocking = stopping or last or not self.args.async_save
        begun = time.perf_counter()
        self.save(step, progress, blocking=blocking)
        save_s = time.perf_counter() - begun  # what the save blocked training (all of it, unless async)
        if blocking and self.rank == 0 and (self.still_owner is None or self.still_owner()):
            layout.write_status(self.run_dir, save_s=round(save_s, 3))
        if self.auto is not None and steps and not last and not stopping:
            save_s, step_s = self._agreed_max(save_s, elapsed / steps)  # every rank the same
            if self.auto.measured(save_s):
                self.auto.choose(step_s)
                self.say(self.auto.line(step, step_s, step + self.auto.steps))
        self.segment = (step, time.perf_counter())

    def _agreed_max(self, *values: float) -> list[float]:
        """The largest of each value over the ranks: decisions every rank must take alike."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    # -- load ---------------------------------------------------------------------------------------

    def choose(self, unreadable: tuple[str, ...] = ()) -> str | None:
        """The checkpoint to resume from, decided by rank 0 and told to all: the run's newest complete
        one not found `unreadable` (by the load, or by `unusable` here, newest first: only the one
        chosen is read), else checkpoint.resume_from for a run without its own."""
        choice, metadata = [None], None
        if self.rank == 0:
            listed = complete(self.run_dir, self.said, shown=self.shown, later=self._later)
            found = []
            for step, path in reversed(listed):
                if path in unreadable:
                    continue
                why, metadata = _checked_metadata(path, self._later(path))
                if why is None:
                    found = [(step, path)]
                    break
                log.warning("skipping checkpoint %s: %s", self.shown(path), why)
                unreadable += (path,)
            # Checkpoints damaged after their commit (DCP's .metadata is there, a shard is not whole),
            # found out when listed or when read: with none readable left the run does not silently
            # start over in their place. A step folder without .metadata or chunks.npz was never a checkpoint.
            unreadable += tuple(
                path
                for step, path in layout.step_folders(self.run_dir)
                if (step, path) not in listed
                and any(os.path.isfile(os.path.join(path, n)) for n in (".metadata", save_plan.INDEX))
            )
            if found:  # the run's own checkpoints win: resume_from is only where a new run starts
                choice = [found[-1][1]]
                if self.args.resume_from:
                    log.info(
                        "checkpoint.resume_from=%s is not used: this run dir has checkpoints of its own, "
                        "and a restart continues from its newest (step %d)",
                        self.args.resume_from,
                        found[-1][0],
                    )
            elif unreadable:
                choice = [
                    (
                        "error",
                        f"no readable checkpoint is left in {self.shown(self.run_dir)} (unreadable: "
                        f"{', '.join(map(self.shown, unreadable))}); "
                        f"move them away and start again with checkpoint.start_over=true to start from scratch",
                    )
                ]
            elif (saved := earlier_save(self.run_dir)) and not self.args.start_over:
                choice = [
                    (
                        "error",
                        f"no checkpoint in {self.shown(folder(self.run_dir))}, but {self.shown(saved)}: its "
                        f"checkpoints were moved or "
                        f"deleted; put them back to resume, or start again with checkpoint.start_over=true to "
                        f"train from step 0",
                    )
                ]
            elif self.args.resume_from:
                why, metadata = _checked_metadata(self.args.resume_from)
                resume_from = self.shown(self.args.resume_from)
                choice = (
                    [("error", f"checkpoint.resume_from={resume_from} is not a usable checkpoint: {why}")]
                    if why
                    else [self.args.resume_from]
                )
        if self.rank == 0 and self.args.start_over:  # for this start only: config.yaml keeps false for the next
            self.args.start_over = False
            saved = earlier_save(self.run_dir) if choice[0] is None or choice[0] == self.args.resume_from else None
            if saved:
                start = "step 0" if choice[0] is None else f"checkpoint.resume_from={self.shown(choice[0])}"
                log.warning("checkpoint.start_over=true: training from %s, although %s", start, self.shown(saved))
                layout.write_status(self.run_dir, saved=None)
        if self.rank == 0 and isinstance(choice[0], str):
            if self.shown(choice[0]) == choice[0]:  # not a copy of a bucket's in the private staging root (0700)
                _warn_if_others_can_write(choice[0])
            _warn_if_unverified(choice[0])
        # With the choice, the metadata rank 0 read (the restricted unpickler, once): no other rank
        # reads or unpickles the file (at 16k ranks a 1 GB .metadata, minutes of each rank's time);
        # and the index of its chunks that each rank's load plan looks up (load_plan.py), made once.
        # Where the checkpoint has a chunk index, only whether it has: each rank gets its own part
        # of it once its state is known (`_index_slices`).
        chosen = metadata if isinstance(choice[0], str) else None
        self.indexed = chosen if isinstance(chosen, Indexed) else None
        if self.indexed is not None:
            choice += ["indexed", None]
        else:
            choice += [chosen, load_plan.index(chosen) if chosen is not None else None]
        choice.append(self.run_dir)  # rank 0's: an s3:// run dir's staging folder may lie elsewhere on each node
        dist.broadcast_object_list(choice, src=0, group=self.group)
        if isinstance(choice[0], tuple):
            raise CheckpointError(choice[0][1])
        self.metadata, self.chunk_index = choice[1], choice[2]
        if self.remote is not None and isinstance(choice[0], str) and choice[0].startswith(choice[3] + os.sep):
            return self.run_dir + choice[0][len(choice[3]) :]  # the same checkpoint in this node's staging folder
        return choice[0]

    def _index_slices(self, state: dict) -> None:
        """With a checkpoint that has a chunk index (`choose` said so): rank 0, which read it, sends
        every rank its own part (save_plan.slices: of each tensor whose saved chunks are the current
        layout's, the rank's own chunk's record; of anything else every record), and each rank
        makes DCP's metadata of that part to plan its reads from. The current layout is rank 0's
        description of its state where every rank describes the same (one all-reduce of its
        digest); else every rank gets every record, as from .metadata."""
        try:
            items = save_plan.describe(torch_compat.flatten(state), self.world_size)
        except (AttributeError, TypeError, ValueError):
            items = None
        digest = save_plan.digest(items)
        halves = (digest >> 32, digest & 0xFFFFFFFF)
        agreed = self._agreed_max(*halves, *(-h for h in halves))
        same = digest and agreed[:2] == [float(h) for h in halves] and agreed[2:] == [float(-h) for h in halves]
        now = save_plan.Chunks(items, self.world_size) if same else None  # every rank's chunks, each rank's own
        common, parts = [None], None
        if self.rank == 0:
            indexed, self.indexed = self.indexed, None
            shared, own_items, parts = save_plan.slices(indexed.header, indexed.arrays, now, self.world_size)
            common = [(indexed.header, shared, own_items)]
        dist.broadcast_object_list(common, src=0, group=self.group)
        own: list = [None]
        dist.scatter_object_list(own, parts, src=0, group=self.group)
        self.metadata = save_plan.metadata_of(*common[0], own[0], now, self.rank)
        self.chunk_index = None

    def _shapes(self, model_state: dict) -> dict[str, list[int]]:
        """The whole model's parameter shapes: this rank's, and under pipeline parallelism (`stages`)
        every stage's, gathered once over the pipeline's group (they do not change during a run)."""
        if self.stages is None:
            return shapes(model_state)
        if self.whole_shapes is None:
            every: list = [None] * dist.get_world_size(self.stages)
            dist.all_gather_object(every, shapes(model_state), group=self.stages)
            self.whole_shapes = {key: shape for stage in every for key, shape in stage.items()}
        return self.whole_shapes

    def load(self) -> dict | None:
        """Restore every part from the newest usable checkpoint: the sharded ones (model, optimizer,
        ...), the small ones from meta.json, and the per-rank ones (random states) where as many ranks
        saved it; returns its meta (step, samples), or None. A checkpoint that turns out unreadable is
        skipped with a warning for the next older one."""
        optimizer = self.optimizer
        unreadable: tuple[str, ...] = ()
        while True:
            path = self.choose(unreadable)
            if path is None:
                return None
            shown = self.shown(path)  # in the lines: an s3:// run dir's URL, not its staging copy
            meta = read_meta(path)
            names = _sharded_names(shown, meta)
            state = {name: part.state_dict() for name, part in self.sharded.items() if name in names}
            if self.metadata == "indexed":
                self._index_slices(state)
            check_compatible(shown, meta["shapes"], self._shapes(state["model"]))
            saved_optimizer = meta.get("optimizer", type(optimizer).__name__)
            if saved_optimizer != type(optimizer).__name__:
                raise CheckpointError(
                    f"checkpoint {shown} holds the state of optimizer {saved_optimizer}, but this run uses "
                    f"{type(optimizer).__name__} (optim.name): resume with the same optim.name, or start a "
                    f"new run_dir"
                )
            started = time.perf_counter()
            same_ranks = meta["world_size"] == self.world_size
            per_rank = {
                name: os.path.join(path, name, f"rank_{self.rank:05d}.pt")
                for name in self.per_rank
                if same_ranks and os.path.isfile(os.path.join(path, name, f"rank_{self.rank:05d}.pt"))
            }
            why, own = self._read_shards(path, state, per_rank)
            if why is None:
                break
            if path == self.args.resume_from:
                raise CheckpointError(f"checkpoint.resume_from={shown} is unreadable: {why}")
            if self.rank == 0:  # every rank has the same `why`: said once
                log.warning("skipping checkpoint %s: %s; trying the next older one", shown, why)
            unreadable += (path,)
            if self.remote is not None and self.remote.staged_here(path):  # the next older one staged in its place
                if self.leader:
                    self._remove(os.path.basename(path))
                self.remote.resume(self.group, below=self.remote.staged[0])
        for name, part in self.sharded.items():
            if name in state:
                part.load_state_dict(state[name])
            else:
                log.info("checkpoint %s holds no %s state (saved before it was kept): it starts afresh", shown, name)
        for name, part in self.parts.items():
            bad = getattr(part, "problem", lambda _: None)(meta[name]) if name in meta else None
            if bad:  # meta.json is untrusted as any file: a part may say what it cannot take
                raise CheckpointError(
                    f"checkpoint {shown}: meta.json's {name} state cannot be restored: {bad}; give another "
                    f"checkpoint as checkpoint.resume_from, or move this one away"
                )
            if name in meta:
                part.load_state_dict(meta[name])
            else:
                log.info("checkpoint %s holds no %s state (saved before it was kept): it starts afresh", shown, name)
        for name, value in own.items():
            self.per_rank[name].load_state_dict(value)
        meta["load_time_s"] = time.perf_counter() - started
        meta["path"] = shown  # as the user knows it: the "resumed from" line, the metrics' resume row
        self.last_saved = meta["step"]
        return meta

    def _read_shards(self, path: str, state: dict, per_rank: dict[str, str]) -> tuple[str | None, dict]:
        """Fill `state`'s tensors (this rank's shards of each sharded part) from the checkpoint at
        `path`, and read this rank's file of each per-rank part named in `per_rank` (name: file);
        (None, those parts' states read), or on every rank (why some rank could not, {}) (the tensors
        may then be partly overwritten: load them again). Nothing is set before every rank has read
        all: a per-rank file is read here so that one torch.load cannot read makes the checkpoint
        unreadable like a shard, instead of failing the start; a part's `problem` (if it has one)
        names a state read that it cannot take.

        Each rank plans its own reads (`no_dist`): DCP's default load plan needs no coordination (its
        global step hands every rank its own plan back), and routing the plans through rank 0 took
        0.3 s of a 1 s load (125m, 2 processes, cache warm; more with more ranks). What the collective
        gave, every rank failing with the error of any, is done here with one small all-gather.
        The reading itself is `self.reader`'s: `ShardReader` (shard_reader.py)."""
        error = None
        own: dict = {}
        what = "its shards"
        later = self._later(path)  # shards still in the bucket: fetched once the plan says which
        fetch = remote.ReadFetch(self.remote, self.group) if self.remote and self.remote.staged_here(path) else None
        try:
            with warnings.catch_warnings():  # no_dist warns that it assumes one process; it is each rank alone
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                reader = self.reader(path, rank=self.rank, world_size=self.world_size)
                chunk_index = None  # the planner indexes a metadata its reader read itself
                if isinstance(reader, ShardReader):
                    reader.metadata, chunk_index = self.metadata, self.chunk_index  # as rank 0 read it in `choose`
                    # each file fetched was checked against the manifest as it was downloaded
                    reader.fetch, reader.check = fetch, reader.check and fetch is None
                elif fetch is not None:  # another reader (the bench's): every shard, before it reads
                    fetch(name for name in later if name.endswith(".distcp"))
                dcp.load(state, storage_reader=reader, planner=load_plan.Planner(chunk_index), no_dist=True)
            for name, value in state.items():
                what = "its optimizer state" if name == "optim" else f"its {name} state"
                bad = getattr(self.sharded[name], "problem", lambda _: None)(value)
                if bad:
                    raise ValueError(bad)
            for name, file in per_rank.items():
                what = os.path.relpath(file, path)
                own[name] = torch.load(file, weights_only=True)  # tensors and containers: never code
                bad = getattr(self.per_rank[name], "problem", lambda _: None)(own[name])
                if bad:
                    raise ValueError(bad)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure stops every rank, with its cause
            cause = e.failures[min(e.failures)][0] if isinstance(e, CheckpointException) and e.failures else e
            log.debug("rank %d: reading checkpoint %s failed: %s: %s", self.rank, path, type(cause).__name__, cause)
            first_line = (str(cause).strip().splitlines() or [""])[0]
            if isinstance(cause, remote.Unusable):  # a file fetched from the bucket: the same line on every rank
                error = first_line
            else:
                error = f"rank {self.rank} could not read {what} ({type(cause).__name__}: {first_line[:160]})"
        if fetch is not None and not fetch.done:  # failed before its reads: its error joins the fetch's collective
            with contextlib.suppress(remote.Unusable):
                fetch((), error)
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        failed = next((e for e in errors if e), None)
        if failed:
            return failed, {}
        return None, own

    # -- save ---------------------------------------------------------------------------------------

    def save(self, step: int, progress: dict, blocking: bool = False) -> None:
        """Save every part's state after `step`, with `progress` (samples consumed, the config) in
        meta.json. Async unless configured otherwise or `blocking`."""
        if step == self.last_saved:
            return  # already on disk (e.g. stopped right after resuming)
        self.wait()  # at most one save in flight
        tmp = self.held.join(f".tmp_step_{step:08d}")  # in the folder held, whatever its name leads to now
        if self.remote is not None:  # rank 0 marks the step's prefix as this run's before any rank uploads
            refused: list = [None]
            if self.rank == 0:
                try:
                    with self.remote.store.until(*self.remote.deadline(self.args.timeout_s)):  # the others wait
                        refused = [(CheckpointError, self.remote.begin_save(step, self.run_id))]
                except objects.StoreError as e:  # its line names the object
                    refused = [(objects.StoreError, str(e))]
                except (OSError, objects.PreconditionFailed) as e:
                    refused = [(objects.StoreError, f"the object store failed ({type(e).__name__}: {e})")]
            dist.broadcast_object_list(refused, src=0, group=self.group)
            if refused[0] and refused[0][1]:
                kind, line = refused[0]
                raise kind(f"saving the checkpoint of step {step} to {self.remote.url}: {line}")
        if self.leader:  # made here, never through a link someone else placed: mkdir fails on any leftover
            self._held()
            self._remove(os.path.basename(tmp))
            # Writable by this user only, whatever the umask (a group's 002): nobody else can put a file
            # in a save between its writes and the manifest that records them, nor in it once committed.
            self.held.mkdir(os.path.basename(tmp), 0o755)
            for name in self.per_rank:
                os.mkdir(os.path.join(tmp, name), 0o755)
        dist.barrier(group=self.group)
        for name, part in self.per_rank.items():
            torch.save(part.state_dict(), os.path.join(tmp, name, f"rank_{self.rank:05d}.pt"))
        state = {name: part.state_dict() for name, part in self.sharded.items()}
        meta = {
            **progress,
            "step": step,
            "world_size": self.world_size,
            **{name: part.state_dict() for name, part in self.parts.items()},
            "sharded": list(state),
            "optimizer": type(self.optimizer).__name__,
            "shapes": self._shapes(state["model"]),
            "torch": torch.__version__,
            "trainer": __version__,  # the trainer that saved it (trainer/__init__.py)
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.last_saved = step
        if self.args.async_save and not blocking and self.remote is None:  # an upload needs every rank
            if self.stager and not _stager_reusable():  # a fresh one per save where it cannot be reused
                used = self.stager["async_stager"]
                used.close()
                self.stager["async_stager"] = torch_compat.fresh_stager(used)
            planner, writer = self._planner(state, tmp)
            response = dcp.async_save(
                state,
                storage_writer=writer,
                planner=planner,
                process_group=self.group,
                **self.stager,
            )
            future = getattr(response, "upload_completion", response)
            self.staging = getattr(response, "staging_completion", None)
            self.pending = (future, step, tmp, meta)
        else:
            planner, writer = self._planner(state, tmp)
            with _write_errors(step, tmp, self.held, self.remote):
                dcp.save(state, storage_writer=writer, planner=planner, process_group=self.group)
            if self.remote is None:
                self._commit(step, tmp, meta)
            else:
                self._commit_remote(step, tmp, meta)

    def _commit_remote(self, step: int, tmp: str, meta: dict) -> None:
        """An s3:// run dir's commit (remote.py): every rank uploads the files it wrote, rank 0
        commits the staging folder, uploads the rest and the manifest last; every rank raises the
        same objects.StoreError if any part failed (the checkpoints uploaded before stay the latest).
        Every request to the store ends within its share of checkpoint.timeout_s from here
        (remote.Staging.deadline): a hung PUT fails on its rank with the object, the endpoint and the
        time waited, before the other ranks give up on the collectives that follow."""
        assert self.remote is not None
        records, error = {}, None
        deadline = self.remote.deadline(self.args.timeout_s)
        try:
            with self.remote.store.until(*deadline):
                records = self.remote.upload_own(tmp, step)
        except Exception as e:  # noqa: BLE001 - said on every rank
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (records, error), group=self.group)
        error = next((e for _, e in gathered if e), None)
        if error is None and self.rank == 0:
            try:
                with self.remote.store.until(*deadline):  # the same: the others wait in the broadcast below
                    if self._commit(step, tmp, meta):
                        self.remote.publish(step_path(self.run_dir, step), step, [r for r, _ in gathered], self.run_id)
                        if self.still_owner is None or self.still_owner():  # keep <= 0: all kept, orphans deleted
                            keep = (lambda steps: self._kept(steps, meta)) if self.args.keep > 0 else set
                            self.remote.retain(keep, self.run_id, step)
            except (OSError, objects.StoreError, objects.PreconditionFailed) as e:
                error = f"rank 0: {type(e).__name__}: {e}"
        said = [error]
        dist.broadcast_object_list(said, src=0, group=self.group)
        if self.leader and self.rank != 0:  # another node's copy: its files are in the bucket now
            self._remove(os.path.basename(tmp))
        if said[0]:  # the store, not the input: a restart resumes from the checkpoint before (outcomes.py)
            raise objects.StoreError(
                f"uploading the checkpoint of step {step} to {self.remote.url} failed ({said[0][:600]}); the "
                f"checkpoints uploaded before are intact; check the object store, then start again to resume"
            )

    def _planner(self, state: dict, tmp: str) -> tuple[DefaultSavePlanner, ChecksumWriter]:
        """The save's planner and storage writer. Where every rank describes the same layout
        (save_plan.describe: DTensors over the whole group, plain tensors, values; agreed by one
        all-reduce of its digest), each rank plans the whole save by itself (save_plan.Planner: no
        plan gathered on rank 0, none scattered, the write results gathered compact) and rank 0
        writes DCP's .metadata from the plan's arrays. Otherwise DCP's own planner, caching its
        plans where the installed torch can: a rank whose plan is as at the last save sends none,
        and rank 0 reuses its global plan and metadata. DCP keys its cache by the planner's class,
        in class-level dicts; here the key is this Checkpointer's own (`plan_key`), so a cached
        plan is never used for another layout."""
        try:
            items = save_plan.describe(torch_compat.flatten(state), self.world_size)
        except (AttributeError, TypeError, ValueError):  # a torch or a value it cannot describe
            items = None
        digest = save_plan.digest(items)
        halves = (digest >> 32, digest & 0xFFFFFFFF)
        agreed = self._agreed_max(*halves, *(-h for h in halves))
        if digest and agreed[:2] == [float(h) for h in halves] and agreed[2:] == [float(-h) for h in halves]:
            self.planned_by = "layout"
            writer = save_plan.IndexWriter(tmp)
            writer.metadata_first = self.remote is not None  # the bucket gets no later file (stock.py)
            return save_plan.Planner(items, self.rank, self.world_size), writer
        self.planned_by = "dcp"
        if not _PLAN_CACHING:
            return DefaultSavePlanner(), ChecksumWriter(tmp)
        planner = DefaultSavePlanner(enable_plan_caching=True)
        torch_compat.cache_plans_under(planner, self.plan_key)
        return planner, ChecksumWriter(tmp)

    def wait_staged(self) -> None:
        """Block until an async save has copied the state; call before the optimizer changes it."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def poll(self) -> None:
        """Commit a finished async save, start a waiting .metadata writer (cheap; call once per step)."""
        if self.pending and self.pending[0].done():
            self.wait()
        if self.stock:
            self.stock.poll()

    def wait(self) -> None:
        """Block until the save in flight is written, then commit it."""
        self.wait_staged()
        if self.pending:
            future, step, tmp, meta = self.pending
            self.pending = None
            with _write_errors(step, tmp, self.held):
                future.result()  # raises if any rank failed to write
            self._commit(step, tmp, meta)

    def close(self) -> None:
        """Finish and commit the save in flight and release the stager's buffers and cached plans."""
        self.wait()
        if self.stock:
            self.stock.close()
        if self.stager:
            self.stager["async_stager"].close()
        torch_compat.drop_cached_plans(self.plan_key)
        if self.held:
            self.held.close()

    def _held(self) -> None:
        """CheckpointError, in one line, when checkpoints/ is no longer the folder this run holds
        (renamed away, a link or another folder put under its name): the run stops with nothing
        committed or deleted, before the next folder is made, renamed or deleted in it."""
        why = self.held.problem()
        if why:
            raise CheckpointError(
                f"{self.held.name} {why}: the run stops with nothing deleted (its saves so far are in the folder it "
                f"held, now elsewhere in {self.run_dir}); see who changed it (ls -la {self.run_dir}), put the run's "
                f"own checkpoints folder back under its name and start again"
            )

    def _remove(self, name: str) -> bool:
        """`remove` of `name` in checkpoints/, by the descriptor held."""
        failed = self.held.remove(name)
        if failed:
            log.warning("could not remove %s: %s", os.path.join(self.held.name, name), "; ".join(failed[:3]))
        return not failed

    def _discard(self, name: str) -> None:
        """`discard` of the step folder `name` in checkpoints/, by the descriptor held."""
        trash = f".trash_{name}_{uuid.uuid4().hex[:8]}"
        self.held.rename(name, trash)
        self._remove(trash)

    def _commit(self, step: int, tmp: str, meta: dict) -> bool:
        """Whether it committed (rank 0, still the owner)."""
        # DCP's save returns on a rank only after the coordinator wrote .metadata (or chunks.npz, with
        # .metadata after the commit: stock.py), which it does only after every rank reported its
        # shards (and its rng file, written before) as done.
        if self.rank != 0 or (self.still_owner and not self.still_owner()):
            return False
        self._held()
        meta_file = os.path.join(tmp, "meta.json")
        # saying that a manifest follows: a checkpoint that lost it is no old one
        files.write_json(meta_file, {**meta, "manifest": checksums.MANIFEST, "run_id": self.run_id}, sort_keys=False)
        checksums.write_manifest(tmp, self.run_id)
        _fsync(tmp)
        final = step_path(self.run_dir, step)
        name = os.path.basename(final)
        if self.held.exists(name):  # a broken folder of the same name (skipped when listing), or a link
            other = _saved_by_another(self.held.join(name), self.run_id)
            if other:  # never discarded: kept whole under a name no listing takes for a checkpoint
                aside = f"{name}.another-run-{other[:8]}-{uuid.uuid4().hex[:8]}"
                self.held.rename(name, aside)
                log.warning(
                    "%s was saved by another run (run id %s), not this one: moved aside, whole, to %s",
                    self.shown(final),
                    other,
                    self.shown(os.path.join(self.held.name, aside)),
                )
            else:
                self._discard(name)
        self._held()
        self.held.rename(os.path.basename(tmp), name)
        self.held.fsync()
        if self.remote is None:  # an s3:// run dir's says it once uploaded, by its URL (remote.publish)
            log.info("saved checkpoint %s", final)
        self.stock.committed(name)  # .metadata for stock DCP, where the save left it for after the commit
        layout.write_status(self.run_dir, saved=step)  # a later start that finds none says so (earlier_save)
        self._retain(meta)
        return True

    def _kept(self, steps: list[int], meta: dict) -> set[int]:
        """Which of the committed `steps` (oldest first) the retention keeps, after the commit of `meta`."""
        kept = set(steps[-self.args.keep :])
        kept.update(
            s for name, part in self.parts.items() for s in getattr(part, "pinned", lambda _: ())(meta.get(name))
        )
        return kept | {s for s in steps if self.args.keep_every and s % self.args.keep_every == 0}

    def _retain(self, meta: dict) -> None:
        """Delete old checkpoints: keep the `keep` newest, every `keep_every`-th, and every step a part
        pins in the checkpoint just committed (`meta`: a part's `pinned(its state)`, e.g. the best
        eval loss's checkpoint, trainer/early_stop.py); never the newest."""
        if self.args.keep <= 0:
            return
        self._held()
        steps = [step for step, _ in complete(self.run_dir, self.said, self.held, later=self._later)]  # own only
        kept = self._kept(steps, meta)
        for step in steps:
            if step in kept:
                continue
            if self.still_owner and not self.still_owner():
                return
            self.stock.stop(os.path.basename(step_path(self.run_dir, step)))  # its .metadata writer, if running
            self._discard(os.path.basename(step_path(self.run_dir, step)))
