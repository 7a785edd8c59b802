"""A DCP reader that reads each stored tensor straight into the shard it fills.

DCP stores every tensor of a `.distcp` file as a small `torch.save` archive (an uncompressed zip).
The stock `FileSystemReader` loads each archive with `torch.load` into new memory and then copies
it into the shard: per tensor a pickle, a zip parse, a fresh allocation and two memory copies,
while the disk waits. On a 2-core VM that CPU work took about 40% of the disk's time (#6).

`ShardReader` finds where the tensor's bytes sit in its archive (the zip headers and the few
hundred bytes of pickle, parsed without building any object) and `readinto`s the destination
itself, while a thread reads ahead so the disk never waits for the CPU. Any tensor it does not
recognise as a plain contiguous one that fills its destination whole (a resharded slice, another
dtype, strides, compression, storage transforms) goes to the stock reader unchanged, so the
result is always what `FileSystemReader` would have produced.

Every shard file with a recorded checksum is checked by exactly one rank, the one that wrote it
when that rank is loading (files of ranks beyond the world are dealt out by the writer's number):
the others read only the parts they need. With every rank hashing every file it touched, a rank
that needs a few hundred bytes of replicated state from rank 0's file read all of it, and at N
ranks that file was read N times.

Nothing read here runs code a checkpoint carries (issue 27): DCP's own reader unpickles `.metadata`
with `pickle.load` and its planner the pickled (bytes) items with `torch.load(weights_only=False)`,
so a file made for it runs anything on every rank that loads it. Here `.metadata` is unpickled
with nothing but the classes DCP's metadata is made of (`load_metadata`), and a bytes item must
load with `torch.load(weights_only=True)` before DCP's planner gets it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import math
import mmap
import os
import pathlib
import pickle
import re
import struct
import sys
import threading
import zipfile
from collections import OrderedDict
from concurrent.futures import Future

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from trainer import torch_compat
from trainer.checkpoint import checksums
from trainer.rundir import files

# The storage classes a pickled tensor names, by dtype (torch.serialization's own list).
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header (PKWARE APPNOTE 4.3.7)
_LOCAL_SIG, _DESCRIPTOR_SIG = b"PK\x03\x04", b"PK\x07\x08"
_DESCRIPTOR_SIZES = (struct.Struct("<2L"), struct.Struct("<2Q"))  # after signature and CRC: sizes, or zip64's
_HEAD_BYTES = 4096  # read from an archive's start: its small records and the tensor's header fit in it
_AHEAD_BYTES = 256 << 20  # how far the read-ahead may run in front of the load
_BLOCK_BYTES = 16 << 20  # the read-ahead's read size


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where and how one archived tensor's bytes lie in its file."""

    start: int  # file offset of the first byte of the tensor's data
    dtype: torch.dtype
    shape: tuple[int, ...]


class Refused(pickle.UnpicklingError):
    """A checkpoint file that names something its kind of file never holds: it is not read."""


class ShardReader(FileSystemReader):
    """`FileSystemReader` that reads plain tensors into their destination without `torch.load`,
    checks the checksums of the shard files that are `rank`'s of `world_size` to check, and never
    runs code from the checkpoint. `_extension_registry`: DCP's, for checkpoints written with its
    storage extensions (compression); None: DCP's default registry. `check=False` skips the
    checksums: only bench/checkpoint_io.py's unchecked load, which measures what the check costs."""

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry=None,
        *,
        rank: int = 0,
        world_size: int = 1,
        check: bool = True,
    ):
        super().__init__(path, _extension_registry=_extension_registry)
        self.share = (rank, world_size)  # not self.rank: DCP sets that in set_up_storage_reader
        self.check = check  # hash this rank's share of the shard files against their records
        # Given by the caller: `.metadata` as rank 0 read it with `load_metadata` and broadcast it
        # (trainer/checkpoint/manager.py), so that this rank neither reads nor unpickles it. None: read it.
        self.metadata: dcp_metadata.Metadata | None = None
        # Given by the caller where the shard files are still in an s3:// run dir's bucket: called with
        # the files this rank's plan reads before any is opened (trainer/checkpoint/remote.py ReadFetch).
        self.fetch = None

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        metadata = self.metadata or load_metadata(torch_compat.metadata_path(self, kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def checked_here(self) -> list[str]:
        """The shard files (relative paths) this rank checks: `__<writer>_<n>.distcp` by rank
        writer % world_size, any other name by its place in the sorted list."""
        if not self.check:
            return []
        rank, world_size = self.share
        names = sorted({info.relative_path for info in self.storage_data.values()})
        return [name for index, name in enumerate(names) if _checker(name, index, world_size) == rank]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for items in per_file.values():
            items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
        if self.fetch is not None:  # every file read below, known exactly from the plan
            self.fetch(set(per_file) | set(self.checked_here()))
        spans = {
            os.path.join(self.path, path): [
                (self.storage_data[i.storage_index].offset, self.storage_data[i.storage_index].length) for i in items
            ]
            for path, items in per_file.items()
        }
        checked = [os.path.join(self.path, name) for name in self.checked_here()]
        spans.update({path: [] for path in checked if path not in spans})  # last: read only to be checked
        rest: list[ReadItem] = []
        with _ReadAhead(spans, checked) as ahead:
            for path, items in per_file.items():
                with files.open_regular(os.path.join(self.path, path), buffering=0) as f:
                    for item in items:
                        if not self._read_direct(f, item, planner):
                            rest.append(item)
                        ahead.consumed(self.storage_data[item.storage_index].length)
        return super().read_data(dataclasses.replace(plan, items=rest), _PlainBytes(planner, self.storage_data))

    def _read_direct(self, f, item: ReadItem, planner: LoadPlanner) -> bool:
        """Read `item` straight into its destination; False if it needs the stock reader."""
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None):
            return False
        stored = _locate(f, info.offset, info.length)
        if stored is None or any(item.storage_offsets) or tuple(item.lengths) != stored.shape:
            return False
        target = planner.resolve_tensor(item).detach()
        if target.dtype != stored.dtype or tuple(target.shape) != stored.shape:
            return False
        # Written in place only where its bytes are exactly the flat data: PyTorch calls a tensor
        # contiguous whose flat view still has another stride (one element viewed with stride 2),
        # and a negative or conjugate view holds its values with a flag the bytes do not carry.
        direct = (
            target.device.type == "cpu"
            and target.is_contiguous()
            and target.reshape(-1).stride() == (1,)
            and not target.is_neg()
            and not target.is_conj()
        )
        dest = target if direct else torch.empty(stored.shape, dtype=stored.dtype)
        _read_exactly(f, stored.start, dest)
        if not _is_descriptor(f.read(24), dest.nbytes):  # the zip agrees where the data ends
            return False  # the stock reader reads it again, over what was read here
        if not direct:
            target.copy_(dest)
        planner.commit_tensor(item, target)
        return True


def _layout(name: str) -> torch.layout:
    """torch.serialization._get_layout's answer, without its reach into all of torch: a layout by name."""
    found = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
    if name not in found:
        raise Refused(f"unknown layout {name!r}")
    return found[name]


# Everything DCP's .metadata is made of (torch 2.x): its dataclasses, torch.Size, dtypes and layouts
# (torch.layout pickles through torch.serialization._get_layout) and the checkpoint's path.
_METADATA_CLASSES = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): torch_compat.storage_info_class(),
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    **{
        (module, name): getattr(pathlib, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    },
}


def _enum_member(cls, name):
    """What `getattr` may do in DCP's metadata: give a member of one of its Enum classes
    (_MEM_FORMAT_ENCODING), as some Python versions pickle an Enum member (getattr(class, name)),
    e.g. the Debian 3.11 of the CUDA image. Anything else is refused."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls in _METADATA_CLASSES.values()):
        raise Refused(f"it names builtins.getattr of {getattr(cls, '__name__', type(cls).__name__)}")
    if not isinstance(name, str) or name not in cls.__members__:
        raise Refused(f"it names {cls.__name__}.{name!s:.40}, not one of its members")
    return cls[name]


_DTYPE_NAMES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))
_COPYING = {
    torch.Size,
    *(getattr(pathlib, name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}
_WORK_PER_BYTE = 8  # elements a `.metadata` may make its allowed calls copy, per byte of the file
_WORK_FLOOR = 1 << 16
_NOT_DCP = ", which is not part of DCP's checkpoint metadata"  # ... and at least this many, for the smallest files


class _MetadataPickle(pickle._Unpickler):  # the Python one: BUILD and calls are checked one by one
    """Unpickles DCP's metadata and nothing else: a name outside _METADATA_CLASSES and torch's
    dtypes is refused before anything is imported or called; BUILD sets attributes of instances,
    never of a class (a change to a class would outlive the refused file); and the elements the
    allowed calls and BUILDs copy are counted against `budget` (a memoised list wrapped in
    torch.Size hundreds of times is a small file that fills memory)."""

    def __init__(self, f, budget: int):
        super().__init__(f)
        self.budget = budget

    def _spend(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise Refused("it makes far more objects than its size holds")

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            found = _METADATA_CLASSES[module, name]
            return self._counted(found) if found in _COPYING else found
        if module == "torch" and name in _DTYPE_NAMES:  # never getattr(torch, name): that imports
            return vars(torch)[name]
        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # an Enum member pickled by name: getattr(its class, its name)
        raise Refused(f"it names {module}.{name}")

    def _counted(self, cls):
        """`cls` (torch.Size, a path), whose call copies its arguments: each element is paid for."""

        def call(*args):
            self._spend(sum(len(a) if isinstance(a, (str, bytes, tuple, list)) else 1 for a in args) + 1)
            return cls(*args)

        return call

    def load_build(self):
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, type):
            raise Refused(f"it sets attributes of the class {inst.__name__} itself")
        parts = state if isinstance(state, tuple) else (state,)
        self._spend(sum(len(p) if isinstance(p, (dict, tuple, list)) else 1 for p in parts) + 1)
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)  # the Python unpickler's table, with BUILD checked
    dispatch[pickle.BUILD[0]] = load_build

    def persistent_load(self, pid):
        raise Refused("it names a persistent object")


def load_metadata(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """DCP's metadata from the file at `path` (a checkpoint's `.metadata`), unpickled with nothing
    but the classes it is made of. Refused (one line naming the file) if it names anything else;
    FileNotFoundError saying how to write it where the checkpoint committed without it."""
    try:
        opened = files.open_regular(path)  # never a link, never blocking on a FIFO
    except FileNotFoundError:
        folder = os.path.dirname(os.fspath(path))
        if os.path.lexists(os.path.join(folder, "chunks.npz")) and not checksums.listed(folder, ".metadata"):
            raise FileNotFoundError(
                f"{path} is not written (yet): the checkpoint committed without it, its chunks.npz stands for it; "
                f"`python -m trainer.checkpoint.stock {folder}` writes it"
            ) from None
        raise
    with opened as f:
        try:
            metadata = _MetadataPickle(f, _WORK_FLOOR + _WORK_PER_BYTE * os.fstat(f.fileno()).st_size).load()
        except Refused as e:
            raise Refused(
                f"{os.path.basename(path)} is refused: {e}{_NOT_DCP if str(e).startswith('it names') else ''}; "
                f"load it only if you trust where it came from"
            ) from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
        raise Refused(
            f"{os.path.basename(path)} is refused: it holds a {type(metadata).__name__}, not DCP's checkpoint metadata"
        )
    for info in metadata.storage_data.values():  # DCP's shard files lie in the checkpoint folder itself
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise Refused(
                f"{os.path.basename(path)} is refused: it names shard file {name!r}, not a file of its folder"
            )
    return metadata


class _PlainBytes:
    """`planner` for the stock reader, except that a pickled (bytes) item must load with
    weights_only=True (plain data and tensors only); the planner gets a torch.save of what that
    gave. DCP's planner loads what it gets with weights_only=False, which runs whatever it names.
    `storage_data`: the reader's, to name the file an item was refused from."""

    def __init__(self, planner: LoadPlanner, storage_data: dict):
        self.planner, self.storage_data = planner, storage_data

    def __getattr__(self, name: str):
        return getattr(self.planner, name)

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL (\S+) was not an allowed global", str(e))
            raise Refused(
                f"{self.storage_data[item.storage_index].relative_path}: item {item.dest_index.fqn} is refused: "
                f"{f'it names {named.group(1)}' if named else 'it is not plain data'}, which plain data never does"
            ) from None
        value = io.BytesIO()
        torch.save(plain, value)
        value.seek(0)
        self.planner.load_bytes(item, value)


def _checker(name: str, index: int, world_size: int) -> int:
    """The rank that checks shard file `name`, `index`th in name order: its writer's, dealt out."""
    written_by = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    return (int(written_by.group(1)) if written_by else index) % world_size


def _read_exactly(f, start: int, dest: torch.Tensor) -> None:
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
    f.seek(start)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"{f.name}: ends inside a tensor at byte {start + done}")
        done += n


def _locate(f, offset: int, length: int) -> _Stored | None:
    """Find the tensor in the `torch.save` archive at [offset, offset+length) of `f`: None unless
    it is one contiguous little-endian tensor whose storage is exactly its data.

    The archive's records are walked from its start (data.pkl and byteorder come before the
    tensor's data), so the disk is only ever read forward: going to the zip directory at the end
    first costs a seek back per tensor, which on a cold cache took longer than the data itself.
    `torch.save` streams its records, so each one's size is in a descriptor after its data."""
    f.seek(offset)
    head = f.read(min(length, _HEAD_BYTES))
    records: dict[str, bytes] = {}
    pos = 0
    while pos + _LOCAL_HEADER.size <= len(head):
        sig, _, _, flags, method, _, _, _, size, _, name_len, extra_len = _LOCAL_HEADER.unpack_from(head, pos)
        name = head[pos + _LOCAL_HEADER.size : pos + _LOCAL_HEADER.size + name_len].decode(errors="replace")
        start = pos + _LOCAL_HEADER.size + name_len + extra_len
        if sig != _LOCAL_SIG or method != zipfile.ZIP_STORED or start > len(head):
            return None
        name = name.partition("/")[2]  # "<archive>/data.pkl" -> "data.pkl"
        if name.startswith("data/"):
            return _tensor(records, name, offset + start, offset + length)
        if flags & 0x08:  # size unknown until the descriptor after the data
            end, pos = _descriptor(head, start)
        elif size != 0xFFFFFFFF:
            end = pos = start + size
        else:
            return None
        if end is None or end > len(head):
            return None
        records[name] = head[start:end]
    return None


def _descriptor(head: bytes, start: int) -> tuple[int | None, int]:
    """(end of the data, start of the next record) for a record whose data starts at `start`:
    the first data descriptor after it that gives exactly that size."""
    at = head.find(_DESCRIPTOR_SIG, start)
    while at != -1:
        for sizes in _DESCRIPTOR_SIZES:
            if at + 8 + sizes.size <= len(head) and sizes.unpack_from(head, at + 8) == (at - start, at - start):
                return at, at + 8 + sizes.size
        at = head.find(_DESCRIPTOR_SIG, at + 1)
    return None, 0


def _is_descriptor(tail: bytes, nbytes: int) -> bool:
    """Whether `tail`, read right after a record's data, is the descriptor of `nbytes` of data."""
    return tail[:4] == _DESCRIPTOR_SIG and any(
        len(tail) >= 8 + sizes.size and sizes.unpack_from(tail, 8) == (nbytes, nbytes) for sizes in _DESCRIPTOR_SIZES
    )


def _tensor(records: dict[str, bytes], name: str, start: int, end: int) -> _Stored | None:
    """The tensor of record `name`, its data at file offset `start`, if the pickle makes it plain."""
    if "data.pkl" not in records or records.get("byteorder", b"little") != b"little" or sys.byteorder != "little":
        return None
    try:
        key, dtype, numel, storage_offset, shape, stride = _TensorPickle(io.BytesIO(records["data.pkl"])).load()
    except (_NotPlain, pickle.UnpicklingError, TypeError, ValueError):
        return None
    contiguous = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    if (
        name != f"data/{key}"
        or storage_offset != 0
        or numel != math.prod(shape)
        or stride != contiguous
        or start + numel * dtype.itemsize > end
    ):
        return None
    return _Stored(start, dtype, shape)


class _ReadAhead:
    """Reads the byte ranges a load needs, in their order and in large blocks, in a thread that
    keeps at most `ahead` bytes in front of the load: each tensor is then in the page cache when
    the load reaches it, and the disk works while the load's CPU does.

    The files of `check` that have a recorded checksum (trainer/checkpoint/checksums.py) are hashed whole
    from a read-only mapping of the file, beside the load: the pages the hash touches are the
    page cache's own, so checking adds the hashing and no copy of the bytes (where a filesystem
    cannot map files, they are read and hashed instead). Leaving the block
    finishes them and raises ChecksumError for one that is not what was written. Other files are
    only warmed, read into a scratch block: the load reads everything itself, so an error there
    only costs speed."""

    def __init__(self, spans: dict[str, list[tuple[int, int]]], check=(), ahead: int = _AHEAD_BYTES):
        self.verified = {path: checksums.record(path) for path in check}
        self.verified = {path: want for path, want in self.verified.items() if want is not None}
        # file -> its (offset, length)s, in the order the load reads them; whole for verified files
        self.spans = {
            path: [(0, self.verified[path]["size"])] if path in self.verified else s for path, s in spans.items()
        }
        self.ahead = ahead
        self.done = 0  # bytes of `spans` the load has finished
        self.read = 0  # bytes of `spans` read ahead
        self.sums: dict[str, tuple[int, int]] = {}  # verified file -> (size, checksum) as read
        self.error: OSError | None = None
        self.waiting = False  # whether it waits for the load to catch up
        self.stop = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="dcp-read-ahead", daemon=True)

    def __enter__(self) -> _ReadAhead:
        self.thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        with self.cond:
            if exc_type is None and self.verified:
                self.done = math.inf  # the load is through: read the rest of the files to check them
            else:
                self.stop = True
            self.cond.notify_all()
        self.thread.join()
        if exc_type is None:
            for path in self.verified:
                if path not in self.sums:
                    raise self.error or checksums.ChecksumError(f"{os.path.basename(path)} could not be checked")
                checksums.verify(path, *self.sums[path])

    def consumed(self, nbytes: int) -> None:
        with self.cond:
            self.done += nbytes
            self.cond.notify_all()

    def _run(self) -> None:
        block = memoryview(bytearray(_BLOCK_BYTES))
        try:
            for path, spans in self.spans.items():
                with files.open_regular(path, buffering=0) as f:
                    if path in self.verified:
                        if not self._hash(path, f, self.read + spans[0][1], block):
                            return
                        continue
                    for offset, length in spans:
                        if not self._read_span(f, offset, self.read + length, block):
                            return
        except OSError as e:
            self.error = e  # the load itself meets the same error and reports it

    def _room(self, end: int) -> int:
        """Wait until the budget allows reading on; how many bytes (0: told to stop)."""
        with self.cond:
            self.waiting = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.stop or self.read - self.done < self.ahead)
            self.waiting = False
            if self.stop:
                return 0
            return int(min(_BLOCK_BYTES, end - self.read, self.ahead - (self.read - self.done)))

    def _read_span(self, f, offset: int, end: int, block: memoryview) -> bool:
        """Read from `offset` until `self.read` is `end`, within the budget; False once told to stop."""
        f.seek(offset)
        while self.read < end:
            room = self._room(end)
            if not room:
                return False
            n = f.readinto(block[:room])
            if not n:
                break
            self.read += n
        self.read = end
        return True

    def _hash(self, path: str, f, end: int, block: memoryview) -> bool:
        """Hash the whole file `f` (also what lies past its recorded size, for the size to differ),
        within the budget until `self.read` is `end`; False once told to stop. From a read-only
        mapping of it, or read into `block` where its filesystem cannot map files (some FUSE mounts)."""
        h, size = checksums.hasher_for(self.verified[path]), os.fstat(f.fileno()).st_size
        with contextlib.ExitStack() as stack:
            m = view = None
            if size:
                try:
                    m = stack.enter_context(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
                    view = stack.enter_context(memoryview(m))
                    m.madvise(mmap.MADV_SEQUENTIAL)  # faults read ahead in large requests
                except OSError:
                    m = None
            pos = unmapped = 0
            while pos < size:
                room = self._room(end) if self.read < end else _BLOCK_BYTES
                if not room:
                    return False
                n = min(room, size - pos)
                if m is None:
                    n = f.readinto(block[:n])
                    if not n:
                        break
                h.update(view[pos : pos + n] if m is not None else block[:n])
                self.read += n
                pos += n
                hashed = pos // mmap.PAGESIZE * mmap.PAGESIZE
                if (
                    m is not None and hashed - unmapped >= _BLOCK_BYTES
                ):  # out of this process's RSS (Slurm counts it), still cached
                    m.madvise(mmap.MADV_DONTNEED, unmapped, hashed - unmapped)
                    unmapped = hashed
        self.read = max(self.read, end)
        self.sums[path] = (pos, h.intdigest())
        return True


class _NotPlain(Exception):
    """The pickle holds something other than one plain tensor."""


def _rebuild(storage, storage_offset, shape, stride, requires_grad=False, backward_hooks=None, metadata=None, *rest):
    # Anything past the layout changes what the bytes mean (metadata {'neg': True} or {'conj': True}
    # flips signs) or is unknown: the stock reader, which applies it, reads such a tensor.
    if backward_hooks or metadata or rest:
        raise _NotPlain(f"rebuild arguments {backward_hooks!r} {metadata!r} {rest!r}")
    return (*storage, storage_offset, tuple(shape), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    """Reads a pickled tensor's layout (storage key, dtype, numel, offset, shape, stride) and
    refuses anything else: no object named by the pickle is ever imported or built."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain(repr(pid))
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise _NotPlain(repr(dtype))
        return (key, dtype, numel)
