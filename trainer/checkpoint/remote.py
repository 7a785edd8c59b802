"""Checkpoints of an s3:// run dir (trainer/rundir/objects.py): uploaded from, and downloaded into, each
node's staging copy of the run dir, where the folder code of manager.py runs unchanged.

A save (manager.Checkpointer.save, blocking: the upload needs every rank at once) writes into the
local `.tmp_step_N/` as on a filesystem; then each rank uploads the files it wrote (its .distcp
shards with their .xxh3 records, its rng/rank_N.pt) to `checkpoints/step_N/` and reports their
sizes and XXH3 (one small all-gather); rank 0 commits locally, uploads the rest (.metadata,
chunks.npz, meta.json) and the manifest of every rank's files last, with If-None-Match: *. Then it
uploads the run's files (run_id, config.yaml, metrics.jsonl, status.json), applies the retention to
the bucket's checkpoints of this run (the manifest deleted first) and deletes the prefixes that
never got a manifest whose `owner` is this run.

A resume lists `checkpoints/` with a delimiter (no object read), reads the manifests (bounded) newest
first, and on each node the local rank 0 downloads the chosen one's small files into the staging
folder (meta.json and its node's ranks' per-rank files; on rank 0's node also the chunk index, or
.metadata for a checkpoint without one: rank 0 reads it for every rank), checking each
against the manifest's size and XXH3 as it writes. The shard files (.distcp) stay in the bucket until
the load knows which of them each rank reads: every rank's ShardReader.read_data hands the files of
its load plan to `ReadFetch` (one all-gather), and each node's local rank 0 downloads those of its
ranks, checked in the same way (with the same layout, a node fetches its own ranks' shards and the
few files of replicated state; resharded, what the plans say). A mismatch or a missing file on any
node, before or during the load, makes that checkpoint unusable and the next older one is taken
(manager.Checkpointer.load stages it with `resume(below=...)` and loads it again), as on a
filesystem; nothing in the bucket is deleted.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import tempfile
import time

import torch.distributed as dist

from trainer import early_stop, hf
from trainer.checkpoint import checksums, save_plan
from trainer.rundir import files, layout, objects

log = logging.getLogger("trainer")

# The run's files, uploaded at each commit and at the end, downloaded at a start (a resumed run appends).
RUN_FILES = (layout.RUN_ID_FILE, layout.CONFIG_FILE, layout.METRICS_FILE, layout.STATUS_FILE)
RUN_FILE_BYTES = 1 << 30  # the most a run file is downloaded (metrics.jsonl of a very long run)
MARK = ".trainer-staging"  # in a staging folder the trainer made: only such a folder is ever emptied
OWNER = "owner"  # in a step prefix: the run id of the save that writes there, before any shard
# The share of checkpoint.timeout_s a save's requests to the store get, from their start: the ranks
# that wait for them in the collective that follows give up at checkpoint.timeout_s, and a rank whose
# upload hangs must have said so first (objects.Store.until).
UPLOAD_SHARE = 0.75
_WRITER = re.compile(r"^(?:__(\d+)_.*|rank_(\d+)\.pt)$")  # DCP's shard files, the per-rank parts' files


def writer_of(relative: str) -> int | None:
    """The rank that wrote the checkpoint file `relative`, None for rank 0's shared files."""
    match = _WRITER.match(relative.rsplit("/", 1)[-1])
    return int(match.group(1) or match.group(2)) if match else None


def _files(folder: str) -> list[str]:
    """The regular files under `folder`, relative with '/', no link followed."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for name in names:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                found.append(os.path.relpath(path, folder).replace(os.sep, "/"))
    return sorted(found)


def _record(folder: str, relative: str) -> dict:
    path = os.path.join(folder, *relative.split("/"))
    want = checksums.record(path) if relative.endswith(".distcp") else None
    size, digest = (want["size"], want["xxh3_64"]) if want and "xxh3_64" in want else checksums.checksum_file(path)
    return {"size": size, "xxh3_64": digest}


def _shard(name: str) -> bool:
    """Whether the checkpoint file `name` is a shard file, fetched when a load reads it, or its .xxh3
    record, never fetched (the download checks the shard against the manifest)."""
    return name.endswith(".distcp") or name.endswith(".distcp" + checksums.SUFFIX)


class Unusable(Exception):
    """A checkpoint file that a load reads could not be fetched as its manifest lists it (damaged,
    missing, the store failed): the checkpoint is unusable; the same line on every rank."""


def _node(rank: int, local_world_size: int) -> int:
    return int(os.environ.get("GROUP_RANK", rank // max(local_world_size, 1)))


class Staging:
    """An s3:// run dir as this process works in it: the store, this node's staging folder, and
    whether this process is its node's local rank 0 (which makes the node's folders and downloads)."""

    def __init__(self, url: str, rank: int, local_rank: int, local_world_size: int):
        self.url, self.rank = url, rank
        self.store = objects.Store(url)
        self.local = objects.staging_dir(url)
        self.leader = local_rank == 0
        self.node = _node(rank, local_world_size)
        # (step, manifest, the files left in the bucket) of the checkpoint `resume` staged: its shards
        # are fetched when a load reads them (ReadFetch)
        self.staged: tuple[int, dict, frozenset[str]] | None = None

    @classmethod
    def reader(cls, url: str) -> Staging:
        """The bucket alone, for one process that only reads it (committed, manifest): no staging
        folder is made or named (newest_committed, the launcher's look before any rank starts)."""
        staging = cls.__new__(cls)
        staging.url, staging.rank, staging.store = url, 0, objects.Store(url)
        staging.local, staging.leader, staging.node, staging.staged = None, True, 0, None
        return staging

    # -- a start -------------------------------------------------------------------------------

    def _agree(self, group, error: str | None) -> None:
        """Raise StoreError on every rank with the first rank's `error`, if any (collective)."""
        errors: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        first = next((e for e in errors if e), None)
        if first:
            raise objects.StoreError(first)

    def prepare(self, group) -> None:
        """Every node's leader makes a fresh staging folder (what an earlier run left there is not
        the truth) and downloads the run's files into it; collective."""
        error = None
        if self.leader:
            try:
                if os.path.lexists(self.local):
                    if not os.path.isfile(os.path.join(self.local, MARK)) or os.path.islink(self.local):
                        raise objects.StoreError(
                            f"{self.local} is there but is no staging folder the trainer made (no {MARK}): "
                            f"nothing in it is removed; set {objects.STAGING_ENV} to a folder of its own"
                        )
                    shutil.rmtree(self.local)
                os.makedirs(self.local, mode=0o700)
                files.write_text(os.path.join(self.local, MARK), self.url + "\n")
                for name in RUN_FILES:
                    self.download_file(name, os.path.join(self.local, name), RUN_FILE_BYTES)
            except objects.StoreError as e:  # its line names the folder or the object
                error = str(e)
            except OSError as e:
                error = f"run_dir {self.url}: downloading the run's files into {self.local} failed: {e}"
        self._agree(group, error)

    def download_file(self, relative: str, local: str, limit: int) -> bool:
        """The run file `relative` into `local` by one GET (False where the bucket has none);
        StoreError for one larger than the trainer writes, of which no more than `limit` and a
        block is read."""
        try:
            got, _ = self.store.stream(relative, local, limit)
        except FileNotFoundError:
            return False
        if got > limit:
            os.unlink(local)
            raise objects.StoreError(
                f"{self.store.where(relative)} holds more than such an object can ({limit} bytes): not the trainer's; "
                f"remove it"
            )
        return True

    def committed(self, run_id: str | None, below: int | None = None) -> tuple[int, dict] | None:
        """(step, manifest) of the newest checkpoint of the bucket older than `below` that this run
        can take: a prefix with a manifest that checks (its digest, its keys, its run id `run_id`
        where one is known), found by one LIST and the manifests read newest first, only as far as
        the first good one. Rank 0's view; every prefix without a manifest is invisible."""
        for step in reversed(self.store.steps()):
            if below is not None and step >= below:
                continue
            manifest, why = self.manifest(step, run_id)
            if manifest is not None:
                return step, manifest
            if why:
                log.warning("skipping checkpoint %s: %s", self.store.where(objects.step_key(step)), why)
        return None

    def manifest(self, step: int, run_id: str | None) -> tuple[dict | None, str | None]:
        """(the manifest of step_N, None) or (None, why it is unusable; None where it has none)."""
        got = self.store.get_json(objects.step_key(step, checksums.MANIFEST), checksums.MANIFEST_BYTES)
        if got is None:
            return None, None
        manifest = got[0]
        listed = manifest.get("files")
        if not isinstance(listed, dict) or manifest.get("xxh3_64") != checksums._digest(listed):
            return None, f"{checksums.MANIFEST} is damaged: it is not what the commit wrote"
        for name, want in listed.items():
            why = objects.key_problem(name)
            if why:
                return None, f"{checksums.MANIFEST} {why}"
            if not (
                isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("xxh3_64"), int)
            ):
                return None, f"{checksums.MANIFEST} is damaged: {name} has no size and checksum"
        if run_id is not None and manifest.get("run_id") != run_id:
            return None, f"saved by another run (run id {str(manifest.get('run_id'))[:32]}), not this one ({run_id})"
        return manifest, None

    def fetch(self, step: int, manifest: dict, later: frozenset[str] = frozenset()) -> str | None:
        """The leader's download of checkpoint `step` into checkpoints/step_N of the staging folder,
        each file checked against `manifest` as written, but those named in `later` (left in the
        bucket: `fetch_read` gets them); why it is unusable, or None."""
        folder = layout.checkpoints_dir(self.local)
        os.makedirs(folder, mode=0o755, exist_ok=True)
        final = layout.step_path(self.local, step)
        tmp = os.path.join(folder, f".tmp_download_{step:08d}")
        for path in (tmp, final):
            if os.path.lexists(path):
                shutil.rmtree(path)
        os.mkdir(tmp, 0o755)
        for name, want in sorted(manifest["files"].items()):
            if name not in later:
                why = self._download(step, name, want, tmp)
                if why:
                    return why
        files.write_json(os.path.join(tmp, checksums.MANIFEST), manifest)
        os.rename(tmp, final)
        return None

    def _download(self, step: int, name: str, want: dict, folder: str) -> str | None:
        """The file `name` of checkpoint `step` into `folder`, checked against the manifest's `want`
        as written (under a temporary name, renamed once whole and checked); why not, or None."""
        local = os.path.join(folder, *name.split("/"))
        os.makedirs(os.path.dirname(local), mode=0o755, exist_ok=True)
        part = local + ".part"
        if os.path.lexists(part):
            os.unlink(part)
        h = checksums.hasher()
        try:
            size, _ = self.store.stream(objects.step_key(step, name), part, want["size"], h)
        except FileNotFoundError:
            return f"{name} is missing"
        if size != want["size"] or h.intdigest() != want["xxh3_64"]:
            os.unlink(part)
            return (
                f"{name} is damaged: {size} bytes with checksum {h.intdigest():016x}, but the manifest says "
                f"{want['size']} bytes with {want['xxh3_64']:016x}"
            )
        os.rename(part, local)
        return None

    def fetch_read(self, group, needed: set[str], error: str | None) -> None:
        """The files of the staged checkpoint (`staged`) that this rank's load reads, `needed`, or
        `error`, what kept this rank from its reads (collective over `group`, once per load: ReadFetch):
        every rank's are gathered, and each node's leader downloads those of its node's ranks not yet
        in its staging folder, each checked against the manifest as written. Unusable, with the same
        line on every rank, for any rank's `error` or any node's failed download."""
        assert self.staged is not None
        step, manifest, _ = self.staged
        said: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(said, (self.node, sorted(needed), error), group=group)
        first = next((e for _, _, e in said if e), None)
        if first:
            raise Unusable(first)
        why = None
        if self.leader:
            final = layout.step_path(self.local, step)
            wanted = sorted({name for node, names, _ in said if node == self.node for name in names})
            try:
                for name in wanted:
                    if name not in manifest["files"]:
                        why = f"the load reads {name}, which {checksums.MANIFEST} does not list"
                    elif not os.path.isfile(os.path.join(final, *name.split("/"))):
                        why = self._download(step, name, manifest["files"][name], final)
                    if why:
                        break
            except Exception as e:  # noqa: BLE001 - said on every rank: none may miss the all-gather below
                why = f"{type(e).__name__}: {e}"
        said = [None] * dist.get_world_size(group)
        dist.all_gather_object(said, why, group=group)
        first = next((w for w in said if w), None)
        if first:
            raise Unusable(first)

    def resume(self, group, below: int | None = None) -> int | None:
        """The newest committed checkpoint of the bucket of this run (the run id downloaded with the
        run's files) older than `below`, staged on every node (collective): its small files
        downloaded, its shards left in the bucket for the load to fetch (`staged`, fetch_read); its
        step, or None where none is usable (the load then says what the folder code says)."""
        run_id = layout.read_run_id(self.local) if self.rank == 0 else None
        ranks: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, (self.node, self.rank), group=group)
        mine = {rank for node, rank in ranks if node == self.node}  # this node's ranks: their per-rank files
        first = 0 in mine  # rank 0's node: only rank 0 reads DCP's metadata, and hands it to every rank
        self.staged = None
        while True:
            candidate, error = None, None
            if self.rank == 0:
                try:
                    candidate = self.committed(run_id, below)
                except (OSError, objects.StoreError) as e:
                    error = f"run_dir {self.url}: listing its checkpoints failed: {e}"
            self._agree(group, error)
            shared = [candidate]
            dist.broadcast_object_list(shared, src=0, group=group)
            if shared[0] is None:
                return None
            step, manifest = shared[0]
            below = step  # if it fails, the next candidate is older
            why = None
            later = frozenset(name for name in manifest["files"] if self._later(name, manifest, mine, first))
            if self.leader:
                try:
                    why = self.fetch(step, manifest, later)
                except (OSError, objects.StoreError) as e:
                    why = f"{type(e).__name__}: {e}"
            said: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(said, why, group=group)
            failed = next((w for w in said if w), None)
            if failed is None:
                self.staged = (step, manifest, later)
                return step
            if self.rank == 0:
                log.warning(
                    "skipping checkpoint %s: %s; trying the next older one",
                    self.store.where(objects.step_key(step)),
                    failed,
                )
            if self.leader:
                shutil.rmtree(layout.step_path(self.local, step), ignore_errors=True)

    @staticmethod
    def _later(name: str, manifest: dict, mine: set[int], first: bool) -> bool:
        """Whether a resume leaves the file `name` of the checkpoint of `manifest` in the bucket on a
        node whose ranks are `mine` (`first`: rank 0's): a shard (fetched when the load reads it),
        another node's per-rank file, and DCP's metadata where rank 0 does not read it: on every
        other node, and on rank 0's where its chunk index stands for it (manager._checked_metadata)."""
        if _shard(name) or writer_of(name) not in (None, *mine):
            return True
        if name == save_plan.INDEX or name == ".metadata":
            return not first or (name == ".metadata" and save_plan.INDEX in manifest["files"])
        return False

    def staged_here(self, path: str) -> bool:
        """Whether `path` is the checkpoint folder that `resume` staged, its shards still in the bucket."""
        return self.staged is not None and path == layout.step_path(self.local, self.staged[0])

    def later(self, path: str) -> frozenset[str]:
        """The files of the checkpoint folder `path` that are still in the bucket: the staged one's
        shards and other nodes' per-rank files (the folder checks let them be absent), else none."""
        return self.staged[2] if self.staged_here(path) else frozenset()

    # -- a save --------------------------------------------------------------------------------

    def deadline(self, timeout_s: float) -> tuple[float, str]:
        """(when, why) for objects.Store.until: a save's requests to the store end within UPLOAD_SHARE
        of `timeout_s` (checkpoint.timeout_s) from now, or fail with one line."""
        return time.monotonic() + UPLOAD_SHARE * timeout_s, (
            f"a save's requests get {UPLOAD_SHARE:g} of checkpoint.timeout_s={timeout_s:g} s, which the other "
            f"ranks wait: raise it for a slower store"
        )

    def begin_save(self, step: int, run_id: str | None) -> str | None:
        """Rank 0, before any rank uploads a file of step `step`: why the save cannot go there
        (another run's committed checkpoint), else None after marking the prefix as this run's
        (`owner`) and removing a manifest of this run's own there (a checkpoint of that step that a
        resume found unusable: its files are about to be replaced)."""
        manifest = self.store.get_json(objects.step_key(step, checksums.MANIFEST), checksums.MANIFEST_BYTES)
        if manifest is not None and manifest[0].get("run_id") not in (None, run_id):
            return (
                f"{self.store.where(objects.step_key(step))} holds a checkpoint of another run "
                f"(run id {str(manifest[0].get('run_id'))[:32]}); use another run_dir"
            )
        if manifest is not None:
            self.store.delete(objects.step_key(step, checksums.MANIFEST))
        self.store.put(objects.step_key(step, OWNER), (run_id or "").encode())
        return None

    def upload_own(self, tmp: str, step: int) -> dict:
        """Upload the files this rank wrote into the save's folder `tmp`; their records."""
        records = {}
        for name in _files(tmp):
            if writer_of(name) == self.rank:
                records[name] = _record(tmp, name)
                self.store.upload(os.path.join(tmp, *name.split("/")), objects.step_key(step, name))
        return records

    def publish(self, final: str, step: int, gathered: list[dict], run_id: str | None) -> None:
        """Rank 0, after the local commit of `final`: the shared files, then the manifest of every
        rank's files last (If-None-Match: *), then the run's files."""
        listed: dict = {}
        for records in gathered:
            listed.update(records)
        for name in _files(final):
            if writer_of(name) is None and name != checksums.MANIFEST:
                listed[name] = _record(final, name)
                self.store.upload(os.path.join(final, *name.split("/")), objects.step_key(step, name))
        manifest = {"files": listed, "xxh3_64": checksums._digest(listed), **({"run_id": run_id} if run_id else {})}
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        self.store.put(objects.step_key(step, checksums.MANIFEST), body, if_none_match=True)
        log.info("saved checkpoint %s", self.store.where(objects.step_key(step)))  # committed: in the bucket
        self.upload_run_files()

    def upload_run_files(self) -> None:
        for name in RUN_FILES:
            path = os.path.join(self.local, name)
            if os.path.isfile(path) and not os.path.islink(path):
                self.store.upload(path, name)

    def retain(self, keep, run_id: str | None, now: int) -> None:
        """Rank 0, after a commit at step `now`: delete this run's checkpoints in the bucket that
        `keep(steps)` (the manager's retention over the committed steps, oldest first) does not
        keep, the manifest first; and the prefixes without a manifest. Only prefixes whose `owner`
        names this run: one LIST and one tiny GET per step prefix, no manifest read."""
        committed, orphans = [], []
        for step in self.store.steps():
            if step == now:
                continue
            owner = self.store.get(objects.step_key(step, OWNER), 256)
            if owner is None or owner[0].decode(errors="replace") != (run_id or ""):
                continue  # another run's, or a copy: never deleted by this one
            _, names = self.store.listdir(objects.step_key(step))
            (committed if checksums.MANIFEST in names else orphans).append(step)
        committed = sorted([*committed, now])
        kept = keep(committed)
        for step in [s for s in committed if s not in kept] + orphans:
            self.delete(step)

    def delete(self, step: int) -> None:
        """Delete the prefix of step `step`: its manifest first, so that it is never half a checkpoint."""
        self.store.delete(objects.step_key(step, checksums.MANIFEST))
        for name in self.store.walk(objects.step_key(step)):
            if objects.key_problem(name) is None:
                self.store.delete(objects.step_key(step, name))
        log.info("deleted checkpoint %s", self.store.where(objects.step_key(step)))


class ReadFetch:
    """One load's fetch of the staged checkpoint's files (Staging.fetch_read), a collective that
    every rank joins exactly once: the reader calls it with the files its plan reads
    (ShardReader.read_data), and a rank that failed before reading joins it afterwards with its
    error (manager.Checkpointer._read_shards), so that no rank waits in it for one that never comes."""

    def __init__(self, staging: Staging, group):
        self.staging, self.group, self.done = staging, group, False

    def __call__(self, needed=(), error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.staging.fetch_read(self.group, set(needed), error)


_COPIES: list[str] = []  # the folders local_copy made in this process


@atexit.register
def remove_copies() -> None:
    """Remove the private folders (local_copy's, hf_copy's; at exit: a command that ends by os._exit
    calls it itself)."""
    while _COPIES:
        shutil.rmtree(_COPIES.pop(), ignore_errors=True)


def private_folder(url: str, kind: str) -> str:
    """A new private folder beside the staging copy of `url` (<root>/<bucket>/.<kind>-<name>-XXXX,
    made 0700 by mkdtemp), removed at exit (remove_copies)."""
    base = objects.staging_dir(url)
    os.makedirs(os.path.dirname(base), mode=0o700, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f".{kind}-{os.path.basename(base)}-", dir=os.path.dirname(base))
    _COPIES.append(path)
    return path


def local_copy(url: str, step: int | None = None, best: bool = False, checkpoint: bool = True) -> str:
    """A private local folder (under the staging root, removed at exit) holding the run's files of
    the s3:// run dir `url` and the checkpoint a tool reads (trainer.export, evaluate, generate):
    its newest committed one, or that of `step`; with `best` also the best eval loss's checkpoint
    that the newest names; none without `checkpoint` (trainer.metrics). Each file is checked
    against its manifest as it is written; the tool
    then reads the folder as a run dir. objects.StoreError, in one line, for what cannot be had."""
    staging = Staging(url, rank=0, local_rank=0, local_world_size=1)
    staging.store.check()  # credentials, bucket, endpoint: one line
    staging.local = private_folder(url, "read")
    for name in RUN_FILES:
        staging.download_file(name, os.path.join(staging.local, name), RUN_FILE_BYTES)
    run_id = layout.read_run_id(staging.local)

    def fetch(wanted: int | None) -> int | None:
        if wanted is None:
            found = staging.committed(run_id)
            if found is None:
                return None
            wanted, manifest = found
        else:
            manifest, why = staging.manifest(wanted, run_id)
            if manifest is None:
                raise objects.StoreError(
                    f"{staging.store.where(objects.step_key(wanted))} is not a committed checkpoint of this run"
                    + (f": {why}" if why else "")
                )
        why = staging.fetch(wanted, manifest)
        if why:
            raise objects.StoreError(f"{staging.store.where(objects.step_key(wanted))}: {why}")
        return wanted

    if not checkpoint:
        return staging.local
    newest = fetch(step)
    if best and step is None and newest is not None:
        try:
            chosen = early_stop.best_step(staging.local, (newest, layout.step_path(staging.local, newest)))
        except ValueError:
            chosen = newest  # the tool says why, reading the copy
        if chosen != newest:
            fetch(chosen)
    return staging.local


def newest_committed(url: str) -> tuple[int, dict | None] | None:
    """(step, its meta.json) of the newest committed checkpoint of the s3:// run dir `url` that rank 0's
    resume would take (Staging.resume: the run id of the bucket's run_id, Staging.committed), read by
    one process with no file downloaded: meta.json read bounded by, and checked against, the manifest's
    size and XXH3 (None where it is not what the commit wrote, or not of that step); None where there
    is no such checkpoint. The launcher's "nothing to do" (trainer/preflight/startup.py finished).
    objects.StoreError or OSError where the store fails."""
    staging = Staging.reader(url)
    got = staging.store.get(layout.RUN_ID_FILE, 256)  # layout.read_run_id's bound
    run_id = (got[0].decode("utf-8", "replace").strip() or None) if got else None
    found = staging.committed(run_id)
    if found is None:
        return None
    step, manifest = found
    want = manifest["files"].get("meta.json")
    got = staging.store.get(objects.step_key(step, "meta.json"), want["size"]) if want else None
    if got is None:
        return step, None
    h = checksums.hasher()
    h.update(got[0])
    if len(got[0]) != want["size"] or h.intdigest() != want["xxh3_64"]:
        return step, None
    try:
        meta = json.loads(got[0])
    except ValueError:
        return step, None
    return step, (meta if isinstance(meta, dict) and meta.get("step") == step else None)


def checkpoint_copy(url: str, group, rank: int, local_rank: int, local_world_size: int) -> str:
    """checkpoint.resume_from naming a checkpoint in a bucket (s3://BUCKET/PREFIX/checkpoints/step_N):
    on every node its local rank 0 downloads it with local_copy (each file checked against the
    manifest as it is written) into a private folder removed by remove_copies; the local folder of
    the checkpoint on every rank, which the folder code then loads (collective). StoreError with the
    first rank's line on every rank."""
    found = objects.checkpoint_of(url)
    path, error = None, None
    if found is None:
        error = (
            f"checkpoint.resume_from={url} is not a checkpoint of an s3:// run dir; give one such as "
            f"s3://BUCKET/PREFIX/checkpoints/step_00000100"
        )
    elif local_rank == 0:
        try:
            path = layout.step_path(local_copy(found[0], step=found[1]), found[1])
        except objects.StoreError as e:
            error = f"checkpoint.resume_from={url}: {e}"
        except OSError as e:
            error = f"checkpoint.resume_from={url}: downloading it failed: {e}"
    said: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, (_node(rank, local_world_size), path, error), group=group)
    first = next((e for _, _, e in said if e), None)
    if first:
        raise objects.StoreError(first)
    return next(p for node, p, _ in said if p is not None and node == _node(rank, local_world_size))


def hf_copy(url: str, group, rank: int, local_rank: int, local_world_size: int) -> str:
    """model.init_from naming a Hugging Face folder in a bucket (s3://BUCKET/PREFIX): rank 0 lists and
    checks it once (hf.plan: name -> size, ETag of the files the loader needs) and broadcasts that
    listing; on every node its local rank 0 downloads it into a private folder (private_folder,
    removed at exit), each GET held to rank 0's ETag (If-Match) and checked as written (hf.download).
    So every node has the same bytes, or, where the folder was replaced during the start, every rank
    one line ("changed while it was downloaded"; also where this rank took the model's shape from
    another config.json than rank 0's listing: hf.config_changed): never FSDP shards of two models.
    The local folder on every rank, which hf.load_weights then reads (collective). The first failing
    rank's line on every rank: hf.HFError for the folder (bad input), objects.StoreError for the store
    or the download."""

    def failed(e: Exception, doing: str) -> tuple[str, str]:
        if isinstance(e, hf.HFError):
            return ("folder", str(e))
        if isinstance(e, objects.StoreError):
            return ("store", f"model.init_from: {e}")
        return ("store", f"model.init_from: {doing} failed: {e}")

    planned, error = None, None
    if rank == 0:
        try:
            planned = hf.plan(url)
        except (hf.HFError, objects.StoreError, OSError) as e:
            error = failed(e, f"listing {url}")
    shared = [(planned, error)]
    dist.broadcast_object_list(shared, src=0, group=group)  # rank 0's listing: the one every node downloads
    planned, error = shared[0]
    if error is None and (changed := hf.config_changed(url, planned)):
        error = ("folder", changed)
    path = None
    if error is None and local_rank == 0:
        try:
            path = private_folder(url, "hf")
            hf.download(url, path, planned)
        except (hf.HFError, objects.StoreError, OSError) as e:
            error = failed(e, f"downloading {url} into {path}")
    node = _node(rank, local_world_size)
    said: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, (node, path, error), group=group)
    first = next((e for _, _, e in said if e), None)
    if first:
        raise (hf.HFError if first[0] == "folder" else objects.StoreError)(first[1])
    return next(p for n, p, _ in said if p is not None and n == node)
