"""A CRC-32 of every shard file, recorded when it is written and checked when it is read.

Flipped bytes inside a tensor of a `.distcp` file load without any error through DCP's reader and
through ours alike (each checks less than the other in places): only a checksum makes a damaged
file visible. Each rank, right after writing its shard files (from the page cache), records
`<file>.crc32` beside each: {"size": bytes, "crc32": value}. The load (trainer/shard_reader.py)
recomputes it while it reads, in its read-ahead thread, and a mismatch makes the whole checkpoint
unreadable, so that resume takes the next older one (trainer/checkpoint.py). Export checks it too.
"""

from __future__ import annotations

import json
import os
import zlib

from torch.distributed.checkpoint import FileSystemWriter

SUFFIX = ".crc32"
_CHUNK = 16 << 20


class ChecksumError(OSError):
    """A shard file is not what was written: its size or CRC-32 differs from the record."""


def crc32_file(path: str) -> tuple[int, int]:
    """(size, CRC-32) of the file at `path`."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        block = memoryview(bytearray(_CHUNK))
        while n := f.readinto(block):
            crc = zlib.crc32(block[:n], crc)
            size += n
    return size, crc


def record(path: str) -> dict | None:
    """The checksum recorded for the shard file at `path`, or None (a checkpoint saved before
    checksums existed)."""
    try:
        with open(path + SUFFIX) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def verify(path: str, size: int, crc: int) -> None:
    """Raise ChecksumError if (size, crc), computed over the file at `path`, differ from its record."""
    want = record(path)
    if want is not None and (want["size"], want["crc32"]) != (size, crc):
        raise ChecksumError(f"{os.path.basename(path)} is damaged: {size} bytes with CRC-32 {crc:08x}, but "
                            f"{want['size']} bytes with {want['crc32']:08x} were written")


class ChecksumWriter(FileSystemWriter):
    """DCP's `FileSystemWriter` that also records the CRC-32 of each shard file this rank wrote."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # a torch.futures.Future, already done
        for name in sorted({result.storage_data.relative_path for result in future.wait()}):
            path = os.path.join(self.path, name)
            size, crc = crc32_file(path)
            with open(path + SUFFIX, "w") as f:
                json.dump({"size": size, "crc32": crc}, f)
                if self.sync_files:
                    f.flush()
                    os.fsync(f.fileno())
        return future
