"""The DCP reader that reads tensors straight into their shards: the same result as DCP's own
reader for every kind of item, its fast path really taken, and the stock path for all it does not know."""

import errno
import os
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint import checksums
from trainer.checkpoint import reader as shard_reader
from trainer.checkpoint.reader import ShardReader


def saved(path) -> dict:
    """A state of every kind DCP stores, saved to `path` by one process."""
    state = {
        "matrix": torch.randn(64, 33),
        "bf16": torch.randn(8, 5).bfloat16(),
        "steps": torch.arange(17),
        "mask": torch.rand(9) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4).t(),  # DCP keeps the strides: not readable as plain bytes
        "extra": {"epoch": 3},  # not a tensor: stored pickled, a bytes item
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return state


def blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) if torch.is_tensor(v) else {"epoch": 0} for k, v in state.items()}


def load(target: dict, path, monkeypatch) -> list[str]:
    """Load `path` into `target` with ShardReader; the names the stock reader had to read."""
    stock = []
    read_data = FileSystemReader.read_data

    def spy(self, plan, planner):
        stock.extend(item.dest_index.fqn for item in plan.items)
        return read_data(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=ShardReader(path), no_dist=True)
    return sorted(stock)


def test_every_item_reads_back_equal_and_plain_tensors_skip_torch_load(tmp_path, monkeypatch):
    state = saved(tmp_path)
    target = blank(state)
    target["matrix"] = torch.zeros(33, 64).t()  # a destination that is not contiguous itself
    stock = load(target, tmp_path, monkeypatch)
    for name, value in state.items():
        if torch.is_tensor(value):
            assert target[name].dtype == value.dtype and torch.equal(target[name], value), name
    assert target["extra"] == {"epoch": 3}
    assert stock == ["extra.epoch", "strided"]  # the rest went straight into their tensors


def test_a_tensor_whose_zip_disagrees_is_left_to_the_stock_reader(tmp_path, monkeypatch):
    state = saved(tmp_path)
    reader = FileSystemReader(tmp_path)
    metadata = reader.read_metadata()
    info = next(i for index, i in metadata.storage_data.items() if index.fqn == "matrix")
    data_file = tmp_path / info.relative_path
    with open(data_file, "rb") as f:
        stored = shard_reader._locate(f, info.offset, info.length)
    descriptor_size = stored.start + state["matrix"].nbytes + 8  # after signature and CRC
    raw = bytearray(data_file.read_bytes())
    raw[descriptor_size] ^= 0xFF  # the zip now says the data ends elsewhere; torch.load does not check
    data_file.write_bytes(bytes(raw))

    target = blank(state)
    stock = load(target, tmp_path, monkeypatch)
    assert "matrix" in stock
    assert torch.equal(target["matrix"], state["matrix"])


def test_a_missing_file_is_an_error_not_a_hang(tmp_path, monkeypatch):
    state = saved(tmp_path)
    for name in os.listdir(tmp_path):
        if name.endswith(".distcp"):
            os.remove(tmp_path / name)
    with pytest.raises(CheckpointException) as failed:
        load(blank(state), tmp_path, monkeypatch)
    assert isinstance(failed.value.failures[0][0], FileNotFoundError)  # (exception, traceback)
    assert not any(t.name == "dcp-read-ahead" for t in threading.enumerate())


def test_read_ahead_stays_within_its_budget_and_stops_when_told(tmp_path):
    data = tmp_path / "data"
    data.write_bytes(os.urandom(3 << 20))
    ahead = shard_reader._ReadAhead({str(data): [(0, 3 << 20)]}, ahead=1 << 20)
    with ahead:
        with ahead.cond:
            assert ahead.cond.wait_for(lambda: ahead.waiting, timeout=10)  # blocked, the budget used up
        assert ahead.read == 1 << 20
    assert not ahead.thread.is_alive()


def _recorded(path, size: int | None = None) -> None:
    """Record the checksum of the file at `path` as a save does; `size` overrides the size."""
    size_now, digest = checksums.checksum_file(str(path))
    (path.parent / (path.name + checksums.SUFFIX)).write_text(
        f'{{"size": {size if size is not None else size_now}, "xxh3_64": {digest}}}'
    )


@pytest.mark.parametrize("mapped", [True, False])
def test_a_checked_file_is_hashed_within_the_budget_and_whole(tmp_path, monkeypatch, mapped):
    """A file with a checksum is hashed from a mapping of it (or read, where its filesystem cannot
    map files), no further in front of the load than the budget; leaving the block hashes the rest
    and the sum is the recorded one."""
    if not mapped:

        def unmappable(*args, **kwargs):
            raise OSError(errno.ENODEV, "No such device")

        monkeypatch.setattr(shard_reader.mmap, "mmap", unmappable)
    data = tmp_path / "data"
    data.write_bytes(os.urandom((3 << 20) + 123))
    _recorded(data)
    ahead = shard_reader._ReadAhead({str(data): [(0, 1 << 20)]}, check=[str(data)], ahead=1 << 20)
    with ahead:
        with ahead.cond:
            assert ahead.cond.wait_for(lambda: ahead.waiting, timeout=10)
        assert ahead.read == 1 << 20
    assert ahead.sums[str(data)] == checksums.checksum_file(str(data))


def test_bytes_past_the_recorded_size_fail_the_check(tmp_path):
    data = tmp_path / "data"
    data.write_bytes(os.urandom(1 << 20))
    _recorded(data)
    with open(data, "ab") as f:
        f.write(b"\0")
    with (
        pytest.raises(checksums.ChecksumError, match="data is damaged: 1048577 bytes"),
        shard_reader._ReadAhead({str(data): [(0, 1 << 20)]}, check=[str(data)]),
    ):
        pass


def _random_tensor(g: torch.Generator) -> torch.Tensor:
    """A tensor of a random dtype, shape and layout (views, strides, a negative view)."""
    dtype = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool][
        int(torch.randint(7, (), generator=g))
    ]
    shape = [int(n) for n in torch.randint(0, 5, (int(torch.randint(0, 4, (), generator=g)),), generator=g)]
    t = (torch.randn(*shape, 3, generator=g) * 10).to(dtype)
    kind = int(torch.randint(6, (), generator=g))
    if kind == 1 and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif kind == 2:
        t = t[..., ::2]  # stride 2 in the last dimension (a one-element tensor is still "contiguous")
    elif kind == 3 and t.is_floating_point():
        t = torch._neg_view(t)  # saved with its negative bit
    elif kind == 4:
        t = t.reshape(-1)[:1]
    return t


def _destination(t: torch.Tensor, kind: int) -> torch.Tensor:
    """A zero tensor of t's shape and dtype: plain (0), last dimension strided by 2 (1), or a
    negative view (2)."""
    if kind == 1 and t.dim():
        return torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)[..., ::2]
    if kind == 2 and t.is_floating_point():
        return torch._neg_view(torch.zeros(t.shape, dtype=t.dtype))
    return torch.zeros(t.shape, dtype=t.dtype)


@pytest.mark.parametrize("seed", range(4))
def test_differential_against_dcps_reader_on_random_layouts(tmp_path, seed):
    """Ours against DCP's own reader, both ways: never wrong where DCP's is right, never raising
    where DCP's loads. 4 x 25 random state dicts (dtypes, shapes, views, negative bits, writer options)."""
    g = torch.Generator().manual_seed(seed)
    print(f"seed {seed}")
    for trial in range(25):
        state = {f"t{i}": _random_tensor(g) for i in range(int(torch.randint(1, 6, (), generator=g)))}
        path = tmp_path / f"{trial}"
        writer = dcp.FileSystemWriter(
            path,
            single_file_per_rank=bool(torch.randint(2, (), generator=g)),
            thread_count=int(torch.randint(1, 3, (), generator=g)),
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=writer, no_dist=True)
        kinds = {k: int(torch.randint(3, (), generator=g)) for k in state}
        results = {}
        for reader in (FileSystemReader, ShardReader):
            dest = {k: _destination(v, kinds[k]) for k, v in state.items()}
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(dest, storage_reader=reader(path), no_dist=True)
                results[reader] = {k: v.resolve_neg().clone() for k, v in dest.items()}
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - compared below
                results[reader] = e
        stock, ours = results[FileSystemReader], results[ShardReader]
        layouts = {k: (v.dtype, tuple(v.shape), v.stride(), v.is_neg()) for k, v in state.items()}
        if isinstance(stock, Exception):
            continue
        assert not isinstance(ours, Exception), (
            f"seed {seed} trial {trial}: ours raised {ours!r} where DCP's loads; {layouts}"
        )
        for k in state:
            assert torch.equal(ours[k], stock[k]), f"seed {seed} trial {trial}: {k} differs; {layouts[k]}"
            assert torch.equal(ours[k], state[k].resolve_neg()), f"seed {seed} trial {trial}: {k} is not what was saved"


def test_a_save_without_zip_crcs_loads_through_both_readers(tmp_path):
    """ChecksumWriter has torch.save skip the zip records' CRC-32 (nothing reads it; the file's
    checksum covers every byte): both readers load it equal, and torch.save keeps its CRCs after."""
    state = {"a": torch.randn(256, 64), "b": torch.arange(9).bfloat16(), "t": torch.randn(6, 4).t()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=checksums.ChecksumWriter(tmp_path), no_dist=True)
    assert torch.serialization.get_crc32_options()
    for reader in (FileSystemReader, ShardReader):
        dest = blank(state)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(dest, storage_reader=reader(tmp_path), no_dist=True)
        assert all(torch.equal(dest[k], state[k]) for k in state), reader


def test_each_shard_file_is_checked_by_one_rank_its_writer(tmp_path, monkeypatch):
    """A rank that needs a few bytes of another rank's file (replicated state) reads those, not
    the whole file for its checksum: each file is checked once, by the rank that wrote it (or,
    with fewer ranks than writers, dealt out), so at N ranks rank 0's file is not read N times."""
    state = {"a": torch.randn(256, 64), "b": torch.arange(9)}
    hashed = _saved_with_a_byte_no_load_needs_flipped(tmp_path, state, monkeypatch)  # __0_0.distcp

    def load_as(rank: int, world_size: int) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(blank(state), storage_reader=ShardReader(tmp_path, rank=rank, world_size=world_size), no_dist=True)

    load_as(1, 2)  # rank 1 of 2 reads the tensors it needs and leaves writer 0's file to rank 0
    assert hashed == []
    with pytest.raises(CheckpointException) as failed:
        load_as(0, 2)
    assert isinstance(failed.value.failures[0][0], checksums.ChecksumError)
    assert [shard_reader._checker(f"__{w}_0.distcp", w, 3) for w in range(5)] == [0, 1, 2, 0, 1]
    assert shard_reader._checker("other.distcp", 4, 3) == 1


def _saved_with_a_byte_no_load_needs_flipped(tmp_path, state, monkeypatch) -> list:
    """`state` saved in one shard file whose zip directory (at the archive's end, a part no load
    needs) has a byte flipped: only a checksum sees it. Returns the list each hash appends to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=checksums.ChecksumWriter(tmp_path), no_dist=True)
    (shard,) = tmp_path.glob("*.distcp")
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    hashed = []
    hasher = checksums.hasher
    monkeypatch.setattr(checksums, "hasher", lambda: hashed.append(1) or hasher())
    return hashed


def test_check_false_reads_without_hashing_for_the_benchs_unchecked_load(tmp_path, monkeypatch):
    """bench/checkpoint_io.py's unchecked load: ShardReader(check=False) hashes no file (the damage
    it would catch goes unseen: a file no load needs), and reads the tensors as the checked one."""
    state = {"a": torch.randn(64, 8)}
    hashed = _saved_with_a_byte_no_load_needs_flipped(tmp_path, state, monkeypatch)
    target = blank(state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=ShardReader(tmp_path, check=False), no_dist=True)
    assert hashed == [] and torch.equal(target["a"], state["a"])
