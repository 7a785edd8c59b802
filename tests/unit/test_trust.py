"""Checkpoints from an untrusted place (issue 27): loading or listing one never runs code it carries,
never writes or deletes through a symbolic link, and a damaged file of any kind makes the
checkpoint unreadable, named, skipped for the next older one. Most of it in this process (one
gloo process group of one); the payloads that ran on every rank before also through the trainer."""

import dataclasses
import io
import json
import logging
import os
import pickle
import re
import warnings
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.api import CheckpointException

from tests.helpers.checkpoints import load_metadata, point_index, rerecord, small_parts, small_step, without_index
from tests.helpers.run import ROOT
from trainer.checkpoint import manager, save_plan
from trainer.checkpoint.reader import ShardReader


class Payload:
    """Unpickled, it creates the file `path` (what any code could do in its place)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def said(caplog) -> str:
    """What the trainer logged (DCP's own debug records left out)."""
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "trainer")


def as_saved_before_manifests(folder) -> None:
    """Make `folder` a checkpoint as saved before issue 27: no manifest.json, and a meta.json that
    does not say its commit wrote one (nor the run id, younger still)."""
    os.remove(os.path.join(folder, "manifest.json"))
    meta_file = os.path.join(folder, "meta.json")
    meta = json.load(open(meta_file))
    del meta["manifest"]
    meta.pop("run_id", None)  # run ids came after manifests
    json.dump(meta, open(meta_file, "w"), indent=1)


def plant_metadata(folder, marker) -> None:
    """DCP's .metadata of `folder`, still good for DCP, now also creating `marker` when unpickled."""
    metadata = load_metadata(folder)
    metadata.storage_meta.modules = [Payload(marker)]
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    rerecord(folder)


def plant_bytes_item(folder, marker, suffix: str) -> None:
    """The first pickled (bytes) item whose name ends with `suffix` pointed at a torch.save of the
    payload appended to its shard file, .metadata and checksums rewritten to match."""
    metadata = load_metadata(folder)
    index, info = next(
        (i, s) for i, s in sorted(metadata.storage_data.items(), key=lambda e: e[0].fqn) if i.fqn.endswith(suffix)
    )
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    shard = os.path.join(folder, info.relative_path)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    if os.path.exists(os.path.join(folder, save_plan.INDEX)):  # which a load reads in place of .metadata
        point_index(folder, index.fqn, offset, len(payload.getvalue()))
    rerecord(folder)


# -- in this process: a process group of one, a tiny model ----------------------------------------


def saved_run(run_dir, group, steps=(1, 2), **args) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints of `steps` in `run_dir`, saved by the trainer's Checkpointer; the model's weights by step."""
    model, optimizer, scheduler = small_parts(0)
    ckpt = manager.Checkpointer(
        manager.CheckpointArgs(keep=0, **args),
        str(run_dir),
        0,
        1,
        group,
        model,
        optimizer,
        parts={"scheduler": scheduler},
    )
    weights = {}
    for step in range(1, max(steps) + 1):
        small_step(model, optimizer, scheduler)
        if step in steps:
            ckpt.save(step, {"samples": step * 3}, blocking=True)
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def resumed(run_dir, group, **args) -> tuple[dict | None, dict]:
    """What a restart in `run_dir` loads: its meta and the model's weights."""
    model, optimizer, scheduler = small_parts(1)
    ckpt = manager.Checkpointer(
        manager.CheckpointArgs(keep=0, **args),
        str(run_dir),
        0,
        1,
        group,
        model,
        optimizer,
        parts={"scheduler": scheduler},
    )
    meta = ckpt.load()
    return meta, model.state_dict()


def test_a_metadata_payload_never_runs_when_listing_or_loading(tmp_path, group, caplog):
    """A .metadata that creates a file when unpickled, in the newest checkpoint and an older one
    (with the checksums rewritten to match): listing never creates it; a checkpoint with a chunk
    index (chunks.npz) loads from the index and never reads its .metadata; without the index (a
    checkpoint DCP's own planner saved) the restart skips both with a line naming the file and
    loads the good one; the same without manifest.json (a checkpoint saved before it existed,
    listed through its .metadata)."""
    marker = tmp_path / "marker"
    weights = saved_run(tmp_path / "run", group, steps=(1, 2, 3))
    step1, step2, step3 = (manager.step_path(tmp_path / "run", s) for s in (1, 2, 3))
    plant_metadata(step2, marker)
    plant_metadata(step3, marker)
    caplog.set_level(logging.INFO, "trainer")
    manager.complete(str(tmp_path / "run"))
    assert not marker.exists(), "listing unpickled a .metadata"
    meta, state = resumed(tmp_path / "run", group)
    assert not marker.exists(), "loading through the chunk index unpickled a .metadata"
    assert meta["step"] == 3 and all(torch.equal(state[k], weights[3][k]) for k in state)
    for step in (step2, step3):  # as DCP's own planner saves them: no index, .metadata read
        without_index(step)
    caplog.clear()
    meta, state = resumed(tmp_path / "run", group)
    assert not marker.exists(), "loading unpickled a .metadata"
    assert meta["step"] == 1 and all(torch.equal(state[k], weights[1][k]) for k in state)
    for step in (step2, step3):
        assert (
            f"skipping checkpoint {step}: .metadata is refused: it names io.open, which is not part of "
            f"DCP's checkpoint metadata"
        ) in said(caplog), said(caplog)
    for step in (step2, step3):
        as_saved_before_manifests(step)
    caplog.clear()
    assert [step for step, _ in manager.complete(str(tmp_path / "run"))] == [1]
    assert not marker.exists()
    assert f"skipping checkpoint {step3}: .metadata is refused: it names io.open" in said(caplog)


def test_a_bytes_item_payload_is_refused_not_run(tmp_path):
    """A pickled (bytes) item of a DCP checkpoint pointed at a payload: DCP's planner reads it with
    torch.load(weights_only=False); the reader refuses it naming the item and the file."""
    marker = tmp_path / "marker"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"w": torch.randn(3), "extra": {"epoch": 3}}, checkpoint_id=tmp_path / "c", no_dist=True)
        plant_bytes_item(tmp_path / "c", marker, "extra.epoch")
        with pytest.raises(CheckpointException) as failed:
            dcp.load(
                {"w": torch.zeros(3), "extra": {"epoch": 0}}, storage_reader=ShardReader(tmp_path / "c"), no_dist=True
            )
    assert not marker.exists()
    cause = failed.value.failures[0][0]
    assert str(cause).startswith("__0_0.distcp: item extra.epoch is refused: it names io.open"), cause


def _flip(path) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def _change_a_shape(path) -> None:  # still valid JSON: only a checksum tells
    meta = json.load(open(path))
    meta["shapes"]["0.weight"][0] += 1
    json.dump(meta, open(path, "w"), indent=1)


def _rename_a_tensor(path) -> None:  # still a valid pickle of the same size
    data = open(path, "rb").read()
    open(path, "wb").write(data.replace(b"1.weight", b"1.weighT", 1))


@pytest.mark.parametrize(
    "name, damage, before",
    [
        ("rng/rank_00000.pt", _flip, None),
        ("meta.json", _change_a_shape, None),
        (save_plan.INDEX, _flip, None),
        (".metadata", _rename_a_tensor, without_index),  # with an index, .metadata is never read
    ],
)
def test_any_damaged_file_makes_the_checkpoint_unreadable(tmp_path, group, caplog, name, damage, before):
    weights = saved_run(tmp_path, group)
    newest = manager.step_path(tmp_path, 2)
    if before:
        before(newest)
    damage(os.path.join(newest, name))
    caplog.set_level(logging.INFO, "trainer")
    meta, state = resumed(tmp_path, group)
    assert f"skipping checkpoint {newest}: {name} is damaged" in said(caplog), said(caplog)
    assert meta["step"] == 1 and all(torch.equal(state[k], weights[1][k]) for k in state)
    manifest = json.load(open(os.path.join(newest, "manifest.json")))["files"]
    assert {".metadata", "meta.json", "rng/rank_00000.pt", "__0_0.distcp", "__0_0.distcp.xxh3"} <= set(manifest)


def test_a_checkpoint_whose_manifest_was_deleted_is_skipped_not_taken_for_an_old_one(tmp_path, group, caplog):
    """Without its manifest.json a checkpoint looked like one saved before manifests, and was loaded
    without the checksums of its meta.json, .metadata and rng files. meta.json says that its commit
    wrote one: the checkpoint is skipped with a line naming the file, and the one before is loaded."""
    weights = saved_run(tmp_path, group)
    newest = manager.step_path(tmp_path, 2)
    os.remove(os.path.join(newest, "manifest.json"))
    caplog.set_level(logging.INFO, "trainer")
    meta, state = resumed(tmp_path, group)
    assert f"skipping checkpoint {newest}: manifest.json is missing" in said(caplog), said(caplog)
    assert meta["step"] == 1 and all(torch.equal(state[k], weights[1][k]) for k in state)


def test_a_checkpoint_saved_before_manifests_is_loaded_with_one_line_saying_what_is_unverified(tmp_path, group, caplog):
    """Issue 32 item 14: a checkpoint saved before manifests was loaded with no word that its
    meta.json, .metadata and rng files carry no checksum. It is still loaded (verified where it can
    be: shards by their .xxh3 records, .metadata by the restricted unpickler, random states and the
    optimizer's groups by their types and shapes), and one line says what is not verified."""
    weights = saved_run(tmp_path, group)
    newest = manager.step_path(tmp_path, 2)
    as_saved_before_manifests(newest)
    caplog.set_level(logging.INFO, "trainer")
    meta, state = resumed(tmp_path, group)
    assert meta["step"] == 2 and all(torch.equal(state[k], weights[2][k]) for k in state)
    lines = [line for line in said(caplog).splitlines() if "saved before manifests" in line]
    assert lines == [_before_manifests(newest, "its 1 shard file(s) are checked, 1 by their .xxh3 records")]


def _before_manifests(folder, shards: str) -> str:
    return (
        f"checkpoint {folder} was saved before manifests (by an older trainer): {shards}, its .metadata by the "
        f"restricted unpickler, its random states and optimizer groups by their types and shapes, but a change to "
        f"its meta.json, .metadata or rng files that keeps them valid is not detected; its next save writes a "
        f"manifest"
    )


def _damage_a_weight(folder, weight: torch.Tensor) -> None:
    """Flip one bit inside the stored bytes of `weight` in the shard file: without a checksum, a load
    takes other weights without a word."""
    shard = os.path.join(folder, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    at = bytes(data).index(weight.numpy().tobytes())
    data[at + 2] ^= 0x10
    open(shard, "wb").write(bytes(data))


def test_a_checkpoint_with_crc32_records_has_its_shards_checked_by_them(tmp_path, group, caplog):
    """Issue 41 item 12: checkpoints of the trainers that wrote `.crc32` records (before XXH3) were not
    checked at all: only `.xxh3` was read, so a damaged shard loaded other weights. A .crc32 record is
    checked where it is the only one: the damaged checkpoint is skipped, naming the file."""
    import zlib

    weights = saved_run(tmp_path, group)
    newest = manager.step_path(tmp_path, 2)
    as_saved_before_manifests(newest)
    shard = os.path.join(newest, "__0_0.distcp")
    os.remove(shard + ".xxh3")
    data = open(shard, "rb").read()
    json.dump({"size": len(data), "crc32": zlib.crc32(data)}, open(shard + ".crc32", "w"))
    caplog.set_level(logging.INFO, "trainer")
    meta, state = resumed(tmp_path, group)  # intact: loaded, and the line says how it was checked
    assert meta["step"] == 2 and all(torch.equal(state[k], weights[2][k]) for k in state)
    assert _before_manifests(newest, "its 1 shard file(s) are checked, 1 by their .crc32 records") in said(caplog)
    _damage_a_weight(newest, weights[2]["0.weight"])
    caplog.clear()
    meta, state = resumed(tmp_path, group)
    assert (
        f"skipping checkpoint {newest}: rank 0 could not read its shards (ChecksumError: __0_0.distcp is damaged"
        in (said(caplog))
    )
    assert meta["step"] == 1 and all(torch.equal(state[k], weights[1][k]) for k in state)


def test_a_checkpoint_with_no_checksum_records_says_its_shards_are_unchecked(tmp_path, group, caplog):
    """Issue 41 item 12: a checkpoint saved before checksums (no .xxh3, no .crc32) loaded with a line
    saying its shards were checked by their .xxh3 records. The decision (docs/security.md): it still
    loads, as refusing it would strand every run saved by the first trainers, and the line says
    exactly that damage to its shard bytes loads unnoticed."""
    weights = saved_run(tmp_path, group)
    newest = manager.step_path(tmp_path, 2)
    as_saved_before_manifests(newest)
    os.remove(os.path.join(newest, "__0_0.distcp.xxh3"))
    caplog.set_level(logging.INFO, "trainer")
    meta, state = resumed(tmp_path, group)
    assert meta["step"] == 2 and all(torch.equal(state[k], weights[2][k]) for k in state)
    unchecked = (
        "1 of its 1 shard file(s) have no checksum record (saved before checksums): damage to their bytes loads "
        "unnoticed"
    )
    lines = [line for line in said(caplog).splitlines() if "saved before manifests" in line]
    assert lines == [_before_manifests(newest, unchecked)], said(caplog)


def test_a_truncated_rng_file_of_an_old_checkpoint_is_skipped_not_a_crash(tmp_path, group, caplog):
    """A checkpoint saved before manifests (no checksum of its rng files): an rng file torch.load
    cannot read makes it unreadable like a shard it cannot read."""
    saved_run(tmp_path, group)
    newest = manager.step_path(tmp_path, 2)
    as_saved_before_manifests(newest)
    rng = os.path.join(newest, "rng", "rank_00000.pt")
    open(rng, "r+b").truncate(os.path.getsize(rng) // 2)
    caplog.set_level(logging.INFO, "trainer")
    meta, _ = resumed(tmp_path, group)
    assert meta["step"] == 1 and f"skipping checkpoint {newest}: rank 0 could not read rng/rank_00000.pt" in said(
        caplog
    )


def test_symbolic_links_in_checkpoints_are_never_followed(tmp_path, group, caplog):
    """.tmp_/.trash_ links to an outside folder: removed, the folder untouched, at the start and when
    a save finds one; a step_N link is neither listed nor loaded nor deleted."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    saved_run(run, group, steps=(1,))
    other = tmp_path / "other"
    saved_run(other, group, steps=(5,))
    for name in (".tmp_step_00000001", ".trash_step_00000009_0"):
        (ckpts / name).symlink_to(outside, target_is_directory=True)
    (ckpts / "step_00000005").symlink_to(manager.step_path(other, 5), target_is_directory=True)
    model, optimizer, scheduler = small_parts(0)
    ckpt = manager.Checkpointer(
        manager.CheckpointArgs(keep=1), str(run), 0, 1, group, model, optimizer, parts={"scheduler": scheduler}
    )
    assert sorted(os.listdir(ckpts)) == ["step_00000001", "step_00000005"]
    (ckpts / ".tmp_step_00000002").symlink_to(outside, target_is_directory=True)  # appears after the start
    caplog.set_level(logging.INFO, "trainer")
    assert ckpt.load()["step"] == 1  # the linked step 5 is not this run's
    ckpt.save(2, {"samples": 6}, blocking=True)
    assert sorted(os.listdir(outside)) == ["keep"] and (outside / "keep").read_text() == "mine"
    assert sorted(os.listdir(ckpts)) == ["step_00000002", "step_00000005"]
    assert (ckpts / "step_00000005").is_symlink() and os.listdir(manager.step_path(other, 5))
    assert f"skipping checkpoint {ckpts / 'step_00000005'}: a symbolic link" in said(caplog)


def test_what_could_not_be_removed_is_said(tmp_path, group, caplog, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    (ckpts / ".trash_step_00000001_0" / "x").mkdir(parents=True)
    rmdir = os.rmdir

    def refuse(path, *args, **kwargs):
        if "trash" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", refuse)
    caplog.set_level(logging.INFO, "trainer")
    manager.Checkpointer(manager.CheckpointArgs(), str(tmp_path), 0, 1, group, *small_parts(0)[:2])
    assert f"could not remove {ckpts / '.trash_step_00000001_0'}" in said(caplog) and "Permission denied" in said(
        caplog
    )


def test_resuming_from_a_folder_others_can_write_warns(tmp_path, group, caplog):
    saved_run(tmp_path, group, steps=(1,))
    step = manager.step_path(tmp_path, 1)
    os.chmod(step, 0o775)
    caplog.set_level(logging.INFO, "trainer")
    meta, _ = resumed(tmp_path, group)
    assert meta["step"] == 1
    assert (
        f"checkpoint folder {step} can be written by users other than its owner (mode 0775): they can change "
        f"what this run loads; chmod go-w {step}"
    ) in said(caplog), said(caplog)
    os.chmod(step, 0o755)
    caplog.clear()
    resumed(tmp_path, group)
    assert "other than its owner" not in said(caplog)


# -- DCP's storage extensions -------------------------------------------------------------------


class Zlib(StreamTransformExtension):
    """A stream transform of DCP's extension API, with the standard library's zlib."""

    @staticmethod
    def registry_name():
        return "stream.test-zlib"

    @staticmethod
    def from_descriptor(version):
        return Zlib()

    def get_descriptor(self):
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def __init__(self):
                self.z = zlib.compressobj()

            def writable(self):
                return True

            def write(self, b):
                output.write(self.z.compress(bytes(b)))
                return len(b)

            def close(self):
                output.write(self.z.flush())
                super().close()

        return Writer()

    def transform_from(self, input):
        return io.BytesIO(zlib.decompress(input.read()))


@pytest.mark.parametrize("kind", ["zlib", "zstd"])
def test_a_compressed_checkpoint_loads_as_through_dcps_reader(tmp_path, kind):
    """Written with one of DCP's storage extensions (zstd: DCP's own, in its default registry; zlib:
    one of the test's, in a registry given as DCP's readers take it): loads through ShardReader."""
    if kind == "zstd":
        if not ZStandard.is_available():
            pytest.skip("DCP's ZStandard extension needs the zstandard or pyzstd package")
        extension, registry = ZStandard(), None
    else:
        extension, registry = Zlib(), ExtensionRegistry()
        registry.register(Zlib)
    state = {"a": torch.randn(64, 8), "b": torch.arange(5), "extra": {"epoch": 3}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(tmp_path, _extensions=[extension]), no_dist=True)
        for reader in (
            FileSystemReader(tmp_path, _extension_registry=registry),
            ShardReader(tmp_path, _extension_registry=registry),
        ):
            dest = {"a": torch.zeros(64, 8), "b": torch.zeros(5, dtype=torch.int64), "extra": {"epoch": 0}}
            dcp.load(dest, storage_reader=reader, no_dist=True)
            assert torch.equal(dest["a"], state["a"]) and torch.equal(dest["b"], state["b"]), type(reader)
            assert dest["extra"] == {"epoch": 3}


def test_metadata_with_enum_members_pickled_by_name_loads_and_getattr_stays_closed(tmp_path):
    """Some Pythons (the CUDA image's Debian 3.11) pickle an Enum member as getattr(its class, its
    name): the image's own checkpoints were refused. getattr may give such a member and nothing else."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    from trainer.checkpoint.reader import Refused, load_metadata

    encoding = dcp_metadata._MEM_FORMAT_ENCODING
    properties = dcp_metadata.TensorProperties(dtype=torch.float32)
    meta = dcp_metadata.Metadata(
        state_dict_metadata={"w": dcp_metadata.TensorStorageMetadata(properties, torch.Size([2]), [])},
        storage_data={},
    )

    def by_name(self, proto):
        return getattr, (self.__class__, self._name_)

    original = encoding.__reduce_ex__
    encoding.__reduce_ex__ = by_name
    try:
        data = pickle.dumps(meta)
    finally:
        encoding.__reduce_ex__ = original
    assert b"getattr" in data
    (tmp_path / ".metadata").write_bytes(data)
    loaded = load_metadata(tmp_path / ".metadata")
    assert loaded.state_dict_metadata["w"].properties.memory_format == torch.contiguous_format

    for target, name, why in (
        (dcp_metadata.Metadata, "__init__", "builtins.getattr of Metadata"),
        (encoding, "__class__", "_MEM_FORMAT_ENCODING.__class__, not one of its members"),
        (encoding, "mro", "_MEM_FORMAT_ENCODING.mro, not one of its members"),
    ):
        args = pickle.dumps((target, name), protocol=2)[2:-1]  # the argument tuple, without PROTO and STOP
        (tmp_path / ".metadata").write_bytes(b"\x80\x02cbuiltins\ngetattr\n" + args + b"R.")
        with pytest.raises(Refused, match=rf"\.metadata is refused: it names {re.escape(why)}"):
            load_metadata(tmp_path / ".metadata")


def _refused_config(run, why: str) -> None:
    """load_run refuses the run dir's config.yaml as a whole, in the one line that says `why`."""
    from trainer.config import ConfigError, load_run

    saved = run / "config.yaml"
    with pytest.raises(ConfigError) as e:
        load_run(None, [f"run_dir={run}"])
    assert str(e.value) == (
        f"{saved}: not used, because {why}, so someone else may have written it (its values set the run: learning "
        f"rate, checkpoints kept, commands); if it is yours, read it and continue with it by naming it: --config "
        f"{saved} (make: CONFIG={saved}), and keep the run dir writable by you only (chmod go-w)"
    )


def test_a_run_dirs_config_is_used_only_when_only_we_can_write_it(tmp_path):
    """Issue 41 item 3: the run dir's config.yaml is the base of every later start, and each of its
    values sets the run: a neighbour's `checkpoint.keep: 1` and `optim.lr: 1000` trained at lr 1000
    and retention deleted steps 2 and 4, and only health.command and model.family were checked. A
    config.yaml someone else could have written (another owner, group- or world-writable, a link, in
    a run dir others can write) is refused as a whole, in one line naming its owner and how to
    adopt it: naming it as one's own --config file."""
    from trainer.config import dump, load, load_run

    marker = tmp_path / "ran"
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    saved = run / "config.yaml"
    dump(load(None, [f"run_dir={run}", f"health.command=touch {marker}", "checkpoint.keep=1", "optim.lr=1000"]), saved)
    os.chmod(saved, 0o644)
    cfg, _, lines = load_run(None, [f"run_dir={run}"])  # ours, writable by us only: used
    assert cfg.health.command == f"touch {marker}" and cfg.optim.lr == 1000 and lines == []

    os.chmod(saved, 0o664)
    _refused_config(run, "group or others can write it (mode 664)")
    with pytest.raises(Exception, match="not used, because"):  # the command line's values do not adopt it
        load_run(None, [f"run_dir={run}", "health.command=exit 0", "optim.lr=0.001"])
    cfg, _, _ = load_run(str(saved), [])  # named as the user's own --config: adopted, as given
    assert cfg.optim.lr == 1000 and cfg.health.command == f"touch {marker}"
    os.chmod(saved, 0o644)
    os.chmod(run, 0o775)
    _refused_config(run, f"its folder {run} can be written by group or others (mode 775)")
    os.chmod(run, 0o755)
    if os.geteuid() == 0:  # the neighbour: another uid's file (root can make one)
        os.chown(saved, 4321, -1)
        _refused_config(run, "it is owned by uid 4321, not by you (uid 0)")
        os.chown(saved, 0, -1)
    elsewhere = tmp_path / "elsewhere.yaml"
    saved.rename(elsewhere)
    saved.symlink_to(elsewhere)
    _refused_config(run, "it is a symbolic link")
    assert not marker.exists()


def test_a_config_yaml_linked_to_a_private_file_is_never_read(tmp_path, capsys):
    """Issue 41 item 7: config.yaml was read with a plain open() before the planted-link check: linked
    to the victim's private creds.yaml, the start printed `unknown key 'aws_token'` (under Slurm into
    the group-readable slurm/<job>.out). Now the link is refused before a byte is read, and so is a
    FIFO (no stat-then-open race: the file checked is the file read)."""
    from trainer.preflight import check

    run = tmp_path / "run"
    run.mkdir()
    creds = tmp_path / "creds.yaml"
    creds.write_text("aws_token: AKIA-SECRET-1234\n")
    (run / "config.yaml").symlink_to(creds)
    assert check.main(["--config", str(ROOT / "configs/default.yaml"), f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "because it is a symbolic link" in err and err.count("\n") == 1, err
    assert "aws_token" not in err and "SECRET" not in err


def test_an_oversized_config_is_refused_in_one_line_without_reading_it_all(tmp_path):
    """Issue 41 item 8: a 512 MB config.yaml made `trainer.config --print` peak at 1.07 GB. A config
    file (the user's --config or the run dir's config.yaml) is read up to 1 MiB, and a larger one is
    one line (sparse: the test writes nothing)."""
    import resource

    from trainer.config import ConfigError, load, load_run

    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(512 << 20)
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o755)
    os.replace(big, run / "config.yaml")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for read in (lambda: load(str(run / "config.yaml")), lambda: load_run(None, [f"run_dir={run}"])):
        with pytest.raises(ConfigError) as e:
            read()
        assert str(e.value).startswith(f"{run / 'config.yaml'}: is larger than 1048576 bytes"), e.value
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 64, grown_mb


def test_a_command_moved_into_our_own_file_in_a_shared_run_dir_is_never_run(tmp_path):
    """Issue 32 item 2: the attacker writes `health: {command: ...}` into metrics.jsonl of a
    group-writable run dir; a resume used to move it into a metrics.superseded.jsonl of the victim's,
    which the attacker renames to config.yaml: the next start ran it. Now the line is dropped (never
    copied), and a config.yaml of ours in a run dir others can write is not trusted to run anything."""
    from trainer.config import LogArgs
    from trainer.observe.metrics import Reporter

    marker = tmp_path / "ran"
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o775)  # shared with the group, as docs/security.md allows
    metrics = run / "metrics.jsonl"
    attack = json.dumps({"health": {"command": f"touch {marker}"}})  # JSON is YAML too
    metrics.write_text(json.dumps({"step": 5, "loss": 1.0, "time": 1.0}) + "\n" + attack + "\n")
    Reporter(str(run), LogArgs(progress=False), 9, is_main=True).start(2, None)
    superseded = run / "metrics.superseded.jsonl"
    assert "touch" not in superseded.read_text() and "touch" not in metrics.read_text()
    # Were it copied (it was): a file of ours holding only the attacker's line, renamed to config.yaml.
    superseded.write_text(attack + "\n")
    os.chmod(superseded, 0o644)
    os.replace(superseded, run / "config.yaml")
    _refused_config(run, f"its folder {run} can be written by group or others (mode 775)")
    assert not marker.exists()


def _good_metadata_bytes() -> bytes:
    from torch.distributed.checkpoint import metadata as dcp_metadata

    properties = dcp_metadata.TensorProperties(dtype=torch.float32)
    chunk = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    return pickle.dumps(
        dcp_metadata.Metadata(
            state_dict_metadata={"w": dcp_metadata.TensorStorageMetadata(properties, torch.Size([2]), [chunk])},
            storage_data={},
        )
    )


def test_metadata_that_builds_on_a_class_is_refused_and_leaves_the_class_unchanged(tmp_path):
    """BUILD on the allowed class itself (issue 32, item 12): no code runs, but the change stayed in
    the process after the file was refused and every good checkpoint was misread after it."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    from trainer.checkpoint.reader import Refused, load_metadata

    before = dict(vars(dcp_metadata.Metadata))
    state = pickle.dumps((None, {"__init__": 1, "planner_data": 7}), protocol=2)[2:-1]
    (tmp_path / ".metadata").write_bytes(b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n" + state + b"b.")
    with pytest.raises(Refused, match=r"\.metadata is refused: it sets attributes of the class Metadata itself"):
        load_metadata(tmp_path / ".metadata")
    assert dict(vars(dcp_metadata.Metadata)) == before
    (tmp_path / ".metadata").write_bytes(_good_metadata_bytes())
    assert list(load_metadata(tmp_path / ".metadata").state_dict_metadata) == ["w"]


def test_metadata_that_copies_one_memoised_list_many_times_is_refused_with_memory_bounded(tmp_path):
    """One memoised list wrapped in torch.Size 300 times: a 400 KB file that took 460 MB before it
    was refused (issue 32, item 8). Now the copying is counted against the file's size."""
    import tracemalloc

    from trainer.checkpoint.reader import Refused, load_metadata

    items = 50_000
    body = b"\x80\x02ctorch\nSize\nq\x00" + b"]q\x01(" + b"K\x01" * items + b"e"  # Size, then a memoised list
    body += b"0" + b"h\x00h\x01\x85R0" * 300 + b"N."  # 300 times Size(that list), each popped
    (tmp_path / ".metadata").write_bytes(body)
    tracemalloc.start()
    try:
        with pytest.raises(Refused, match=r"\.metadata is refused: it makes far more objects than its size holds"):
            load_metadata(tmp_path / ".metadata")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes at the peak"  # unbounded: 300 copies of the list, over 100 MB


def test_metadata_naming_a_torch_submodule_is_refused_before_it_is_imported(tmp_path):
    """find_class("torch", "_dynamo") imported 282 modules before refusing (issue 32, item 12)."""
    import subprocess
    import sys

    (tmp_path / ".metadata").write_bytes(b"\x80\x02ctorch\n_dynamo\n.")
    script = (
        "import sys; from trainer.checkpoint.reader import Refused, load_metadata\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        f"try: load_metadata({str(tmp_path / '.metadata')!r})\n"
        "except Refused as e: print(e)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert done.stdout.splitlines()[-2:] == [
        ".metadata is refused: it names torch._dynamo, which is not part of DCP's checkpoint metadata; "
        "load it only if you trust where it came from",
        "False",
    ], done.stdout + done.stderr


def test_tensorboard_events_are_never_written_through_a_planted_link(tmp_path, caplog):
    """Issue 41 item 4: <run_dir>/tensorboard followed a link (it was not among the folders checked):
    after `ln -s ~victim/.config/autostart run/tensorboard` an events file appeared in the victim's
    private folder. Now the start refuses a link there (layout.WRITTEN_FOLDERS: tests/{unit,system}/test_plant.py
    plants one at every name), the tracker refuses one at use with one warning, and a link swapped in
    after the tracker began changes nothing: it writes into the folder it checked and holds."""
    from trainer.config import LogArgs
    from trainer.observe.trackers import Trackers

    private = tmp_path / "autostart"
    private.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").symlink_to(private)
    if os.geteuid() == 0:
        os.lchown(run / "tensorboard", 4321, 4321)  # the neighbour's link
    trackers = Trackers(str(run), LogArgs(progress=False, tensorboard=True), {}, None)
    trackers.log({"step": 1, "loss": 1.0})
    trackers.close()
    assert list(private.iterdir()) == []
    assert f"{run / 'tensorboard'} is a symbolic link" in caplog.text and "no TensorBoard events" in caplog.text

    (run / "tensorboard").unlink()
    trackers = Trackers(str(run), LogArgs(progress=False, tensorboard=True), {}, None)
    (run / "tensorboard").rename(run / "tensorboard.moved")  # swapped while the run trains
    (run / "tensorboard").symlink_to(private)
    trackers.log({"step": 1, "loss": 1.0})
    trackers.log({"step": 2, "loss": 0.5})
    trackers.close()
    assert list(private.iterdir()) == []
    assert [p.name.startswith("events.out.tfevents") for p in (run / "tensorboard.moved").iterdir()] == [True]
