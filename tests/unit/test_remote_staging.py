"""An s3:// run dir's resume stages a checkpoint's small files and leaves its shards in the bucket until
the load names them (trainer/checkpoint/remote.py: Staging.resume, ReadFetch), against moto's server
(tests/helpers/s3.py), on one gloo process: which files are downloaded, what the folder checks let be
absent, each shard fetched once and checked against the manifest, a damaged one's line."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist
import xxhash

from trainer.checkpoint import checksums, manager, remote
from trainer.rundir import layout, objects

RUN_ID = "a" * 32
STEP = 4


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _put_checkpoint(store: objects.Store) -> dict[str, bytes]:
    """A committed checkpoint of two writers in the bucket (the files a save lists, small stand-ins);
    its files by name."""
    meta = {"step": STEP, "samples": 8, "world_size": 2, "scheduler": {}, "shapes": {}, "manifest": checksums.MANIFEST}
    written = {
        "__0_0.distcp": b"rank 0's shard" * 50,
        "__0_0.distcp.xxh3": b"{}",
        "__1_0.distcp": b"rank 1's shard" * 50,
        "__1_0.distcp.xxh3": b"{}",
        ".metadata": b"stock DCP's metadata",
        "chunks.npz": b"the chunk index",
        "meta.json": json.dumps({**meta, "run_id": RUN_ID}).encode(),
        "rng/rank_00000.pt": b"rank 0's random states",
        "rng/rank_00001.pt": b"rank 1's random states",
    }
    listed = {name: {"size": len(body), "xxh3_64": xxhash.xxh3_64_intdigest(body)} for name, body in written.items()}
    for name, body in written.items():
        store.put(objects.step_key(STEP, name), body)
    manifest = {"files": listed, "xxh3_64": checksums._digest(listed), "run_id": RUN_ID}
    store.put(objects.step_key(STEP, checksums.MANIFEST), json.dumps(manifest).encode())
    store.put(layout.RUN_ID_FILE, (RUN_ID + "\n").encode())
    return written


def test_resume_stages_the_small_files_and_the_load_fetches_its_shards_once(s3, group, tmp_path, monkeypatch):
    _, bucket = s3
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    url = f"s3://{bucket}/runs/lazy"
    written = _put_checkpoint(objects.Store(url))
    staging = remote.Staging(url, rank=0, local_rank=0, local_world_size=1)
    staging.prepare(group)
    assert staging.resume(group) == STEP
    path = layout.step_path(staging.local, STEP)
    here = sorted(os.path.relpath(os.path.join(root, name), path) for root, _, names in os.walk(path) for name in names)
    # rank 0's node (the only rank: rank 1's rng file is no node's here): the chunk index stands for .metadata
    assert here == ["chunks.npz", checksums.MANIFEST, "meta.json", "rng/rank_00000.pt"]
    later = staging.later(path)
    assert later == {
        "__0_0.distcp",
        "__0_0.distcp.xxh3",
        "__1_0.distcp",
        "__1_0.distcp.xxh3",
        ".metadata",
        "rng/rank_00001.pt",
    }
    assert staging.later(layout.step_path(staging.local, STEP + 1)) == frozenset()
    # the folder checks let the staged files in the bucket be absent, and only those
    assert layout.checkpoint_problem(path, STEP, RUN_ID, tuple(later)) is None
    assert manager.problem(path, later) is None
    assert manager.problem(path, later - {"__0_0.distcp"}) == "shard file __0_0.distcp missing or truncated"
    assert manager.problem(path) == ".metadata is missing"

    fetch = remote.ReadFetch(staging, group)
    fetch({"__1_0.distcp"})
    fetch({"__0_0.distcp"})  # a load's fetch is one collective: a second call does nothing
    assert open(os.path.join(path, "__1_0.distcp"), "rb").read() == written["__1_0.distcp"]
    assert not os.path.exists(os.path.join(path, "__0_0.distcp"))
    remote.ReadFetch(staging, group)({"__1_0.distcp", "__0_0.distcp"})  # the one there is not fetched again
    assert open(os.path.join(path, "__0_0.distcp"), "rb").read() == written["__0_0.distcp"]
    assert sorted(n for n in os.listdir(path) if n.endswith(".part")) == []

    # a rank's error (it failed before its reads) is every rank's line; a name the manifest lacks is refused
    with pytest.raises(remote.Unusable, match=r"^rank 0 could not read its shards \(boom\)$"):
        remote.ReadFetch(staging, group)((), "rank 0 could not read its shards (boom)")
    with pytest.raises(remote.Unusable, match=r"^the load reads __2_0.distcp, which manifest.json does not list$"):
        remote.ReadFetch(staging, group)({"__2_0.distcp"})

    # a shard damaged in the bucket: the line names it, nothing of it stays under its name
    os.unlink(os.path.join(path, "__1_0.distcp"))
    flipped = bytearray(written["__1_0.distcp"])
    flipped[10] ^= 1
    objects.Store(url).put(objects.step_key(STEP, "__1_0.distcp"), bytes(flipped))
    want = xxhash.xxh3_64_intdigest(written["__1_0.distcp"])
    with pytest.raises(remote.Unusable) as raised:
        remote.ReadFetch(staging, group)({"__1_0.distcp"})
    assert str(raised.value) == (
        f"__1_0.distcp is damaged: {len(flipped)} bytes with checksum {xxhash.xxh3_64_intdigest(bytes(flipped)):016x}, "
        f"but the manifest says {len(flipped)} bytes with {want:016x}"
    )
    assert sorted(n for n in os.listdir(path) if n.startswith("__1_0")) == []
