"""A checksum of every shard file, recorded when it is written and checked when it is read.

Flipped bytes inside a tensor of a `.distcp` file load without any error through DCP's reader and
through ours alike (each checks less than the other in places): only a checksum makes a damaged
file visible. Each rank, right after writing its shard files (from the page cache), records
`<file>.xxh3` beside each: {"size": bytes, "xxh3_64": value}. The load (trainer/checkpoint/reader.py)
recomputes it while it reads, in its read-ahead thread, and a mismatch makes the whole checkpoint
unreadable, so that resume takes the next older one (trainer/checkpoint/manager.py). Export checks it too.

XXH3-64 (the xxhash package) rather than zlib's CRC-32: 9 GB/s against 2.3 GB/s on the project's
VM, where with CRC-32 a checked load took 1.5 to 1.8 times an unchecked one. What the check costs
the load is measured by `make bench` (`checksum_load_overhead`, docs/benchmarks.md).
It detects accidental damage (flipped bytes, torn writes); it is not a defence against tampering.

Every other file of a checkpoint is covered too (issue 27): at the commit rank 0 writes
`manifest.json` last, {"files": {relative path: {"size", "xxh3_64"}}, "xxh3_64": of "files"},
listing each file of the folder (a shard with its record's values, not hashed again). Listing
checkpoints checks the sizes only (`manifest_problem`); before a checkpoint is loaded rank 0 hashes
every listed file whose checksum the load does not check itself (`deep`): .metadata, meta.json,
rng/*, the .xxh3 records. meta.json names the manifest: a checkpoint without one whose meta.json
does not name it was saved before manifests and is read as before; one whose meta.json does lost it.
"""

from __future__ import annotations

import json
import os
import zlib

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemWriter

from trainer.rundir import files, objects

SUFFIX = ".xxh3"
# The record of trainers before XXH3 (1392210 to ca05b7f): {"size": bytes, "crc32": zlib's CRC-32}.
# Still checked where it is a checkpoint's only record.
CRC32_SUFFIX = ".crc32"
MANIFEST = objects.MANIFEST
_CHUNK = 16 << 20
MANIFEST_BYTES = 256 << 20  # the most a manifest.json is read: about 3 million files' entries


class ChecksumError(OSError):
    """A shard file is not what was written: its size or checksum differs from the record."""


def hasher():
    return xxhash.xxh3_64()


class _Crc32:
    """zlib's CRC-32 with a hasher's update/intdigest, for the .crc32 records of older trainers."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def hasher_for(want: dict):
    """A hasher of the kind of the record `want` (record()'s answer): XXH3-64, or CRC-32 for a .crc32."""
    return xxhash.xxh3_64() if "xxh3_64" in want else _Crc32()


def _kind(want: dict) -> str:
    return "xxh3_64" if "xxh3_64" in want else "crc32"


def checksum_file(path: str) -> tuple[int, int]:
    """(size, checksum) of the file at `path`."""
    h, size = hasher(), 0
    with open(path, "rb", buffering=0) as f:
        block = memoryview(bytearray(_CHUNK))
        while n := f.readinto(block):
            h.update(block[:n])
            size += n
    return size, h.intdigest()


def record(path: str) -> dict | None:
    """The checksum recorded for the shard file at `path`: its .xxh3 record ({"size", "xxh3_64"}),
    else the .crc32 record of a trainer before XXH3 ({"size", "crc32"}), or None (a checkpoint saved
    before checksums existed)."""
    for suffix, key in ((SUFFIX, "xxh3_64"), (CRC32_SUFFIX, "crc32")):
        try:
            want = files.read_json(path + suffix)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise ChecksumError(f"{os.path.basename(path + suffix)} is unreadable ({_short(e)})") from None
        if not (isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get(key), int)):
            raise ChecksumError(f"{os.path.basename(path + suffix)} is damaged: not a size and checksum record")
        return {"size": want["size"], key: want[key]}
    return None


def shard_records(folder: str) -> dict[str, list[str]]:
    """The shard files (*.distcp) of checkpoint `folder` by what records their checksum: "xxh3" (a
    .xxh3 record), "crc32" (only a .crc32 record, by a trainer before XXH3), "none" (saved before
    checksums: nothing tells a damaged byte of it)."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))
    found: dict[str, list[str]] = {"xxh3": [], "crc32": [], "none": []}
    for name in names:
        path = os.path.join(folder, name)
        kind = "xxh3" if os.path.lexists(path + SUFFIX) else "crc32" if os.path.lexists(path + CRC32_SUFFIX) else "none"
        found[kind].append(name)
    return found


def _short(e: Exception) -> str:
    """An error's words without the full path that UnsafeFile puts first."""
    return e.why if isinstance(e, files.UnsafeFile) else str(e)


def verify(path: str, size: int, digest: int) -> None:
    """Raise ChecksumError if (size, digest), computed over the file at `path`, differ from its record."""
    want = record(path)
    if want is not None and (want["size"], want[_kind(want)]) != (size, digest):
        raise ChecksumError(
            f"{os.path.basename(path)} is damaged: {size} bytes with checksum {digest:016x}, but "
            f"{want['size']} bytes with {want[_kind(want)]:016x} were written"
        )


def _digest(listed: dict) -> int:
    return xxhash.xxh3_64_intdigest(json.dumps(listed, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(folder: str, run_id: str | None = None) -> None:
    """Record the size and checksum of every file in `folder` (a checkpoint being committed) in
    its manifest.json, fsynced, with the id of the run that saved it (`run_id`, when given).
    Symbolic links are not followed, nor listed."""
    listed = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative == MANIFEST or os.path.islink(path):
                continue
            want = record(path)  # a shard file: its writer hashed it already
            size, digest = (want["size"], want["xxh3_64"]) if want and "xxh3_64" in want else checksum_file(path)
            listed[relative.replace(os.sep, "/")] = {"size": size, "xxh3_64": digest}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        saved_by = {"run_id": run_id} if run_id else {}
        json.dump({"files": listed, "xxh3_64": _digest(listed), **saved_by}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def listed(folder: str, name: str) -> dict | None:
    """The manifest's record ({"size", "xxh3_64"}) of file `name` of checkpoint `folder`, or None
    (not listed, no manifest, an unreadable one: `manifest_problem` says which)."""
    try:
        record = files.read_json(os.path.join(folder, MANIFEST), MANIFEST_BYTES)["files"].get(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def manifest_problem(
    folder: str, deep: bool = False, unread: tuple[str, ...] = (), absent: tuple[str, ...] = ()
) -> str | None:
    """Why the files of checkpoint `folder` are not those its manifest.json lists, or None (also
    without a manifest: a checkpoint saved before them). Sizes only, unless `deep`: then the
    checksum of every file that is not a shard with its own record (those are checked as read),
    nor named in `unread` (files the caller does not read, or checks as it reads them). A file
    named in `absent` may be missing (the one the caller writes; an s3:// run dir's shard files,
    fetched from the bucket when a load reads them: trainer/checkpoint/remote.py)."""
    try:
        manifest = files.read_json(os.path.join(folder, MANIFEST), MANIFEST_BYTES)
        listed = manifest["files"]
        intact = manifest["xxh3_64"] == _digest(listed) and all(
            isinstance(w, dict) and isinstance(w.get("size"), int) and isinstance(w.get("xxh3_64"), int)
            for w in listed.values()
        )
    except FileNotFoundError:
        return _lost_manifest(folder)
    except files.UnsafeFile as e:
        return f"{MANIFEST} {_short(e)}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        intact = False
    if not intact:
        return f"{MANIFEST} is damaged: it is not what the commit wrote"
    for name, want in listed.items():
        path = os.path.join(folder, *name.split("/"))
        if name.startswith("/") or ".." in name.split("/"):
            return f"{MANIFEST} names {name}, a file outside the checkpoint"
        try:
            size = os.lstat(path).st_size if os.path.isfile(path) and not os.path.islink(path) else None
        except OSError:
            size = None
        if size is None and name in absent:
            continue
        if name.endswith(".distcp") and (size is None or size < want["size"]):
            return f"shard file {name} missing or truncated"  # the words of a check older than manifests
        if size is None:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} is damaged: {size} bytes, but {want['size']} were written"
        if deep and name not in unread and not (name.endswith(".distcp") and name + SUFFIX in listed):
            _, digest = checksum_file(path)
            if digest != want["xxh3_64"]:
                return f"{name} is damaged: checksum {digest:016x}, but {want['xxh3_64']:016x} was written"
    return None


def _lost_manifest(folder: str) -> str | None:
    """Why a checkpoint without manifest.json is not usable: its meta.json says its commit wrote one
    (since the trainer wrote them all), so it was lost; or None, for a checkpoint saved before them."""
    try:
        named = files.read_json(os.path.join(folder, "meta.json")).get("manifest")
    except (OSError, ValueError, AttributeError):
        return None  # an unreadable meta.json is named by the listing's own check (trainer/rundir/layout.py)
    return f"{MANIFEST} is missing, though meta.json says its commit wrote one" if named else None


class ChecksumWriter(FileSystemWriter):
    """DCP's `FileSystemWriter` that also records the checksum of each shard file this rank wrote."""

    def write_data(self, plan, planner):
        # Each tensor is a torch.save zip inside the file, whose records get a CRC-32 by default:
        # nothing reads it (neither torch.load nor ShardReader checks it), and computing it costs
        # the save about as much as this file's checksum. The checksum here covers every byte.
        crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            future = super().write_data(plan, planner)  # a torch.futures.Future, already done
        finally:
            torch.serialization.set_crc32_options(crc32)
        for name in sorted({result.storage_data.relative_path for result in future.wait()}):
            path = os.path.join(self.path, name)
            size, digest = checksum_file(path)
            with open(path + SUFFIX, "w") as f:
                json.dump({"size": size, "xxh3_64": digest}, f)
                if self.sync_files:
                    f.flush()
                    os.fsync(f.fileno())
        return future
