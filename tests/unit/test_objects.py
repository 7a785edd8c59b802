"""An s3:// run dir's store and lease (trainer/rundir/objects.py) against a real local S3 server (moto's,
tests/helpers/s3.py): the conditional writes the commit and the lease stand on, the lease's refusal,
takeover, loss and re-creation, bounded reads, the keys a manifest may name. The slower cases (the
verified download, each bad input's line) are in tests/system/test_s3.py."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from trainer.launchers import torchrun
from trainer.rundir import lease as file_lease
from trainer.rundir import objects


def _store(bucket: str, prefix: str = "runs/one") -> objects.Store:
    return objects.Store(f"s3://{bucket}/{prefix}")


def test_conditional_writes_are_enforced(s3):
    _, bucket = s3
    store = _store(bucket)
    first = store.put("lease.json", b"a", if_none_match=True)
    with pytest.raises(objects.PreconditionFailed):
        store.put("lease.json", b"b", if_none_match=True)
    second = store.put("lease.json", b"c", if_match=first)
    with pytest.raises(objects.PreconditionFailed):
        store.put("lease.json", b"d", if_match=first)  # stale: another writer changed it
    assert store.get("lease.json", 10) == (b"c", second)


def test_small_objects_are_read_bounded_and_keys_checked(s3):
    _, bucket = s3
    store = _store(bucket)
    store.put("status.json", b"x" * 100)
    with pytest.raises(objects.StoreError) as e:
        store.get("status.json", 10)
    assert str(e.value) == (
        f"s3://{bucket}/runs/one/status.json holds 100 bytes, more than such an object can (10): not the trainer's; "
        f"remove it"
    )
    assert store.get("absent.json", 10) is None
    for bad in ("../other/x", "/abs", "a//b", "a/./b"):
        assert objects.key_problem(bad) == f"names {bad!r}, not a key inside the run's prefix"
        with pytest.raises(objects.StoreError):
            store.key(bad)
    assert objects.key_problem("rng/rank_00001.pt") is None


def test_run_dir_urls():
    assert objects.split("s3://bucket/runs/a/") == ("bucket", "runs/a")
    with pytest.raises(objects.StoreError) as e:
        objects.split("s3://bucket")
    assert str(e.value) == (
        "run_dir: s3://bucket needs a prefix of plain names under the bucket (s3://bucket/runs/NAME): "
        "letters, digits, . _ = + -"
    )
    with pytest.raises(objects.StoreError) as e:
        objects.split("s3://b/x")
    assert "does not name a bucket" in str(e.value)


def test_lease_refuses_a_second_run_and_is_released(s3):
    _, bucket = s3
    first = objects.ObjectLease(_store(bucket))
    first.acquire()
    try:
        second = objects.ObjectLease(_store(bucket))
        with pytest.raises(file_lease.LeaseError) as e:
            second.acquire()
        assert str(e.value).startswith(
            f"run_dir s3://{bucket}/runs/one is in use by process {os.getpid()} on {first.me['host']} (lease renewed "
        )
        assert str(e.value).endswith("s ago); stop that run first, or use another run_dir")
        assert first.check() and first.lost is None
    finally:
        first.release()
    assert _store(bucket).get("lease.json", 1 << 16) is None  # released: the next run takes it at once


def _plant(store: objects.Store, renewed_ago: float) -> None:
    """A lease of a process on another host, last renewed `renewed_ago` seconds ago."""
    owner = {"host": "elsewhere", "pid": 1, "token": "theirs", "renewed": time.time() - renewed_ago}
    store.put("lease.json", json.dumps(owner).encode())


def test_lease_of_another_host_is_taken_over_only_once_stale(s3, caplog):
    _, bucket = s3
    store = _store(bucket)
    _plant(store, renewed_ago=5)
    with pytest.raises(file_lease.LeaseError) as e:
        objects.ObjectLease(store).acquire()
    assert f"s3://{bucket}/runs/one is in use by process 1 on elsewhere (lease renewed " in str(e.value)
    _plant(store, renewed_ago=file_lease.STALE_S + 1)
    lease = objects.ObjectLease(store)
    lease.acquire()
    try:
        assert json.loads(store.get("lease.json", 1 << 16)[0])["token"] == lease.me["token"]
        said = f"taking over the lease of s3://{bucket}/runs/one: process 1 on elsewhere did not renew it"
        assert said in caplog.text
    finally:
        lease.release()


def test_lease_taken_by_another_run_is_lost(s3):
    _, bucket = s3
    store = _store(bucket)
    lease = objects.ObjectLease(store)
    lease.acquire()
    try:
        _plant(store, renewed_ago=0)  # another run took it over (as after a long stall of this one)
        lease.renew()
        assert lease.lost == "to process 1 on elsewhere"
        assert not lease.check()
    finally:
        lease.release()
    assert json.loads(store.get("lease.json", 1 << 16)[0])["token"] == "theirs"  # left alone


def test_lease_object_removed_mid_run_is_created_again(s3, caplog):
    _, bucket = s3
    store = _store(bucket)
    lease = objects.ObjectLease(store)
    lease.acquire()
    try:
        store.delete("lease.json")
        lease.renew()
        assert lease.lost is None
        assert json.loads(store.get("lease.json", 1 << 16)[0])["token"] == lease.me["token"]
        assert f"the lease object s3://{bucket}/runs/one/lease.json had disappeared: created again" in caplog.text
    finally:
        lease.release()


def test_a_staging_folder_the_trainer_did_not_make_is_never_emptied(tmp_path, monkeypatch, group):
    """TRAINER_S3_STAGING=/ with run_dir s3://home/me would name /home/me: refused, nothing removed."""
    from trainer.checkpoint import remote

    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path))
    precious = tmp_path / "home" / "me" / "notes.txt"
    precious.parent.mkdir(parents=True)
    precious.write_text("mine")
    staging = remote.Staging("s3://home/me", rank=0, local_rank=0, local_world_size=1)
    with pytest.raises(objects.StoreError) as e:
        staging.prepare(group)
    assert str(e.value) == (
        f"{tmp_path}/home/me is there but is no staging folder the trainer made (no .trainer-staging): nothing in "
        f"it is removed; set TRAINER_S3_STAGING to a folder of its own"
    )
    assert precious.read_text() == "mine"


def test_a_start_downloads_the_run_files_whole_and_refuses_one_larger_than_the_trainer_writes(
    s3, tmp_path, monkeypatch, group
):
    """The run's files come by one GET each, exactly; one past the bound is one line, no part of it kept."""
    from trainer.checkpoint import remote

    _, bucket = s3
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path))
    url = f"s3://{bucket}/runs/files"
    store = objects.Store(url)
    store.put("config.yaml", b"model: {name: mnist_cnn}\n")
    store.put("metrics.jsonl", b'{"step": 1}\n' * 4)
    staging = remote.Staging(url, rank=0, local_rank=0, local_world_size=1)
    staging.prepare(group)
    assert (Path(staging.local) / "metrics.jsonl").read_bytes() == b'{"step": 1}\n' * 4
    assert not (Path(staging.local) / "status.json").exists()  # none in the bucket, none made

    monkeypatch.setattr(remote, "RUN_FILE_BYTES", 30)
    with pytest.raises(objects.StoreError) as e:
        remote.Staging(url, rank=0, local_rank=0, local_world_size=1).prepare(group)
    assert str(e.value) == (
        f"{url}/metrics.jsonl holds more than such an object can (30 bytes): not the trainer's; remove it"
    )
    assert not (Path(staging.local) / "metrics.jsonl").exists()


def test_a_checkpoints_url_names_its_run_dir_and_step():
    assert objects.checkpoint_of("s3://b/runs/x/checkpoints/step_00000012") == ("s3://b/runs/x", 12)
    assert objects.checkpoint_of("s3://b/checkpoints/step_00000012/") == ("s3://b", 12)
    for other in (
        "s3://b/runs/x",
        "s3://b/runs/x/checkpoints/last",
        "/runs/x/checkpoints/step_00000012",
        "s3:///checkpoints/step_1",
    ):
        assert objects.checkpoint_of(other) is None, other


def test_an_s3fs_too_old_is_one_line(monkeypatch):
    """CI's clean venv got s3fs 0.4.2 once (moto's newest boto3 against aiobotocore's botocore pin),
    which has no call_s3: every s3:// test failed with an AttributeError. Now one line, naming the fix."""
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setattr(s3fs, "__version__", "0.4.2")
    with pytest.raises(objects.StoreError) as e:
        objects.Store("s3://my-bucket/runs/x")
    assert str(e.value) == (
        "run_dir: s3://my-bucket/runs/x needs s3fs 2025.1 or later; 0.4.2 is installed: pip install -U "
        "'s3fs>=2025.1' (or the project's 's3' extra)"
    )


def _checkpointer(url: str, group, timeout_s: int = 60):
    """A Checkpointer of one rank on the s3:// run dir `url` (its staging folder prepared), with
    checkpoint.timeout_s=`timeout_s`; (it, its model)."""
    from trainer.checkpoint import manager, remote

    staging = remote.Staging(url, rank=0, local_rank=0, local_world_size=1)
    staging.prepare(group)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    args = manager.CheckpointArgs(timeout_s=timeout_s, async_save=False)
    return manager.Checkpointer(args, staging.local, 0, 1, group, model, optimizer, staging=staging), model


def test_a_hung_upload_fails_within_the_saves_deadline(s3, tmp_path, monkeypatch, group):
    """A PUT that never gets an answer took about 6 minutes to fail (read_timeout 60 s x botocore's 2
    attempts x s3fs's 3 tries): with a shorter checkpoint.timeout_s the other ranks timed out first
    in the collective after the uploads, and their line blamed a stuck rank. Now every request of a
    save ends within its share of checkpoint.timeout_s: the rank whose PUT hangs says which object,
    which endpoint and how long it waited, in the line every rank raises (exit code: FAILED)."""
    from tests.helpers.s3 import Proxy
    from trainer.resilience import outcomes

    server, bucket = s3
    shard = "/checkpoints/step_00000001/__0_0.distcp "
    held = Proxy(server, delay=lambda line: 60.0 if line.startswith("PUT ") and shard in line else 0.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", held.url)
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    url = f"s3://{bucket}/runs/hung"
    try:
        ckpt, _ = _checkpointer(url, group, timeout_s=2)  # its PUTs answer in ~0.05 s
        with pytest.raises(objects.StoreError) as e:
            ckpt.save(1, {"samples": 0}, blocking=True)
        ckpt.close()
    finally:
        held.stop()
    said = re.sub(r"after \d+ s", "after N s", str(e.value))
    assert said == (
        f"uploading the checkpoint of step 1 to {url} failed (rank 0: StoreError: {url}/checkpoints/step_00000001/"
        f"__0_0.distcp: no answer from the object store at {held.url} after N s (a save's requests get 0.75 of "
        f"checkpoint.timeout_s=2 s, which the other ranks wait: raise it for a slower store)); the checkpoints "
        f"uploaded before are intact; check the object store, then start again to resume"
    )
    assert outcomes.of_exception(e.value) is outcomes.FAILED
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)  # nothing of the step in the bucket counts
    assert _store(bucket, "runs/hung").get("checkpoints/step_00000001/manifest.json", 1 << 20) is None


def test_a_large_save_to_a_bucket_has_its_metadata_in_the_manifest(s3, tmp_path, monkeypatch, group):
    """Past save_plan.METADATA_BEFORE_COMMIT chunk records (0 here) a save on a filesystem commits
    without DCP's .metadata, which a background process writes after the commit (stock.py); nothing
    uploaded that later file, so a bucket's checkpoint had none for stock DCP. With an s3:// run dir
    it is written before the commit whatever the size: uploaded, listed in the manifest with its size
    and checksum, and stock torch.distributed.checkpoint.load reads a copy of the bucket's checkpoint."""
    import torch.distributed.checkpoint as dcp
    import xxhash

    from tests.helpers.s3 import download
    from trainer.checkpoint import save_plan

    server, bucket = s3
    monkeypatch.setattr(save_plan, "METADATA_BEFORE_COMMIT", 0)
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    ckpt, model = _checkpointer(f"s3://{bucket}/runs/big", group)
    ckpt.save(1, {"samples": 0}, blocking=True)
    ckpt.close()
    assert ckpt.planned_by == "layout"  # the trainer's planner, which leaves .metadata for after a large commit
    step = download(server, bucket, "runs/big", tmp_path / "copy") / "checkpoints" / "step_00000001"
    written = (step / ".metadata").read_bytes()
    listed = json.loads((step / "manifest.json").read_text())["files"]
    assert listed[".metadata"] == {"size": len(written), "xxh3_64": xxhash.xxh3_64_intdigest(written)}
    state = {"model": {name: torch.zeros_like(value) for name, value in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(step), no_dist=True)  # stock DCP: its own reader, .metadata
    for name, value in model.state_dict().items():
        assert torch.equal(state["model"][name], value), name


def test_a_bad_run_id_in_a_bucket_is_named_by_its_url(s3, tmp_path, monkeypatch, group):
    """The run's files are downloaded into the staging copy, where the checkpoint manager reads them:
    its line names the object a user can fix, not the node-local copy."""
    from trainer.checkpoint import manager

    _, bucket = s3
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    _store(bucket, "runs/bad").put("run_id", b"not mine\n")
    with pytest.raises(manager.CheckpointError) as e:
        _checkpointer(f"s3://{bucket}/runs/bad", group)
    assert str(e.value) == (
        f"s3://{bucket}/runs/bad/run_id holds 'not mine', not a run id the trainer writes; remove it (its "
        f"checkpoints are then loaded only through checkpoint.resume_from), or start a new run_dir"
    )


def _committed(store: objects.Store, step: int, meta: dict, run_id: str = "r" * 32) -> bytes:
    """A committed checkpoint of step `step` in the bucket as a save leaves it, as far as a launcher
    reads one (the run id, meta.json and the manifest that lists it); meta.json's bytes."""
    from trainer.checkpoint import checksums

    store.put("run_id", (run_id + "\n").encode())
    body = json.dumps(meta).encode()
    h = checksums.hasher()
    h.update(body)
    listed = {"meta.json": {"size": len(body), "xxh3_64": h.intdigest()}}
    store.put(f"checkpoints/step_{step:08d}/meta.json", body)
    manifest = {"files": listed, "xxh3_64": checksums._digest(listed), "run_id": run_id}
    store.put(f"checkpoints/step_{step:08d}/manifest.json", json.dumps(manifest).encode())
    return body


def test_a_restart_of_a_run_in_a_bucket_is_a_row_of_its_metrics(s3, capsys):
    """The launcher's restart row of an s3:// run (torchrun.write_row, with the step torchrun.newest_step
    reads from the bucket): appended to the bucket's metrics.jsonl, which the ranks download at their
    start and append to. A run that has uploaded no metrics yet gets none, as a folder not yet written."""
    from trainer.launchers import torchrun

    _, bucket = s3
    store = _store(bucket)
    url = f"s3://{bucket}/runs/one"
    assert torchrun.newest_step(url) is None
    torchrun.write_row(url, {"event": "restart", "step": 0})
    assert store.get("metrics.jsonl", 1000) is None
    store.put("metrics.jsonl", b'{"step": 1, "loss": 2.0}\n')
    _committed(store, 6, {"step": 6})
    assert torchrun.newest_step(url) == 6
    torchrun.write_row(url, {"event": "restart", "step": 6, "rank": 1})
    first, row = (json.loads(line) for line in store.get("metrics.jsonl", 1000)[0].splitlines())
    assert first == {"step": 1, "loss": 2.0}
    assert row.pop("time") > 0 and row == {"event": "restart", "step": 6, "rank": 1}
    assert capsys.readouterr().err == ""


def test_the_launchers_nothing_to_do_reads_the_buckets_early_stop_record(s3, tmp_path, monkeypatch, caplog):
    """startup.finished for an s3:// run dir (issue 47): the newest committed checkpoint of this run
    and its meta.json's early_stop part, read from the bucket with nothing downloaded; a meta.json
    that is not what the manifest says is not trusted (the step alone counts)."""
    from tests.helpers.run import TINY
    from trainer import config
    from trainer.checkpoint import checksums
    from trainer.preflight import startup

    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    _, bucket = s3
    store = _store(bucket)
    record = {"best": 1.0, "best_step": 2, "since": 2, "stopped": 6, "reason": "patience"}
    meta = _committed(store, 6, {"step": 6, "early_stop": record})

    def cfg(*more):
        url = f"s3://{bucket}/runs/one"
        return config.load(None, [f"run_dir={url}", "train.early_stop_patience=2", "eval.interval=2", *more])

    assert startup.finished(cfg("train.steps=10")) == (
        "nothing to do: the run stopped early at step 6 (train.early_stop_patience=2); to train on, restart with "
        "train.early_stop_patience=0 or a larger patience"
    )
    assert startup.finished(cfg("train.steps=10", "train.early_stop_patience=0")) is None
    damaged = meta.replace(b'"since": 2', b'"since": 3')
    store.put("checkpoints/step_00000006/meta.json", damaged)  # same size, not what the commit wrote
    assert startup.finished(cfg("train.steps=10")) is None
    assert startup.finished(cfg("train.steps=6")) == (
        "nothing to do: step 6 reached train.steps=6; raise train.steps to continue"
    )
    assert not (tmp_path / "staging").exists()  # nothing downloaded, no staging folder made
    # a store that fails there (a manifest larger than any commit writes): a warning once the checks
    # passed, and the ranks start and decide
    store.put("checkpoints/step_00000009/manifest.json", b" " * (checksums.MANIFEST_BYTES + 1))
    url = f"s3://{bucket}/runs/one"
    asks = startup.Target(
        startup.API, 1, node_size=1, stop_if_finished=True
    )  # the launcher's question, no memory check
    ready = startup.preflight(asks, None, [f"run_dir={url}", *TINY])
    assert isinstance(ready, startup.Ready)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"warning: run_dir {url}: reading its newest checkpoint failed ({url}/checkpoints/step_00000009/manifest.json "
        f"holds {checksums.MANIFEST_BYTES + 1} bytes, more than such an object can ({checksums.MANIFEST_BYTES}): not "
        f"the trainer's; remove it); the ranks start and decide"
    ]


def test_the_plan_reads_the_buckets_step_and_save_times(s3):
    """`make check` and the launchers' grace period (k8s) read an s3:// run dir's logged step times and
    its last save's time from the bucket, bounded, as they read a folder's: before, they looked for a
    local folder named `s3:` and said "duration: unknown" of a run that had logged."""
    from trainer.config import Config
    from trainer.preflight.check import plan_lines
    from trainer.preflight.interval import save_seconds

    _, bucket = s3
    url = f"s3://{bucket}/runs/plan"
    store = objects.Store(url)
    cfg = Config(run_dir=url)
    assert "duration: unknown until a run has logged step times in its run dir" in plan_lines(cfg, 1, 1)
    rows = [{"step": s, "loss": 1.0, "step_time_s": t} for s, t in ((10, 9.0), (20, 2.0), (30, 2.5), (40, 3.0))]
    store.put("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    store.put("status.json", json.dumps({"state": "running", "save_s": 12.5}).encode())
    assert (
        f"duration: about 0.1 h for {cfg.train.steps} steps at 2.5 s per step (the median of 3 logged windows in "
        f"{url}/metrics.jsonl; its ranks and machine may differ)"
    ) in plan_lines(cfg, 1, 1)
    assert save_seconds(cfg, 1, url) == (12.5, f"measured by the last save in {url}")


def test_a_pod_whose_run_in_a_bucket_finished_exits_0(s3, capsys):
    """Under a Kubernetes operator the launcher's exit code says whether the run finished (0) or
    stopped before the end (143: the JobSet restarts the set). It read an s3:// run dir's status.json
    as a local folder's, found none, and gave 143 for a finished run: the whole set restarted once
    more (a restart of maxRestarts spent) and said it would resume "from the start (no checkpoint
    yet)". Both come from the bucket now."""
    import signal

    from trainer.launchers import torchrun
    from trainer.resilience import outcomes

    _, bucket = s3
    store = _store(bucket, "runs/pods")
    url = f"s3://{bucket}/runs/pods"
    _committed(store, 40, {"step": 40})
    rdzv = torchrun.Rendezvous("JobSet (JOB_COMPLETION_INDEX)", 2, 1, "j-node-0-0.j:29500", "j-node-0-0.j", None)
    store.put("status.json", json.dumps({"state": "stopped", "step": 40}).encode())
    assert torchrun.operator_exit(rdzv, 0, url) == outcomes.signal_code(signal.SIGTERM)
    assert capsys.readouterr().err == (
        "launch: stopped before the end of training under JobSet (JOB_COMPLETION_INDEX): exit code 143, so that "
        "the whole set is restarted (the JobSet's failurePolicy) and resumes from step 40, the newest checkpoint\n"
    )
    store.put("status.json", json.dumps({"state": "finished", "step": 100}).encode())
    assert torchrun.operator_exit(rdzv, 0, url) == 0
    assert capsys.readouterr().err == ""


def test_a_pod_stopped_by_sigterm_says_its_run_in_a_bucket_saved(s3, capsys):
    """A pod's launcher stopped by SIGTERM (an eviction, a drained node) says whether the run saved: it
    read an s3:// run dir's status.json as a local folder's, found none, and said "no checkpoint was
    saved by this start" of a run that had saved and uploaded its status."""
    import signal

    from trainer.launchers import torchrun
    from trainer.resilience import outcomes

    _, bucket = s3
    url = f"s3://{bucket}/runs/evicted"
    started = time.time()
    store = _store(bucket, "runs/evicted")
    store.put("status.json", json.dumps({"state": "stopped", "step": 12, "updated": started + 1}).encode())
    assert torchrun._signalled(url, signal.SIGTERM, started, 30) == outcomes.STOPPED.code
    assert capsys.readouterr().err == f"launch: {outcomes.STOPPED.line.format(signal='SIGTERM', step=12)}\n"
    store.put("status.json", json.dumps({"state": "stopped", "step": 8, "updated": started - 60}).encode())
    assert torchrun._signalled(url, signal.SIGTERM, started, 30) == outcomes.signal_code(signal.SIGTERM)
    assert capsys.readouterr().err == f"launch: {outcomes.SIGNALLED.line.format(signal='SIGTERM', shutdown_s=30)}\n"


def test_the_launchers_records_of_a_run_in_a_bucket_are_in_a_folder_of_this_nodes_own(tmp_path, monkeypatch):
    """A hang's dumps of an s3:// run (torchrun.launcher_dir): under the staging root, never a folder named
    s3: under the current one (a pod's read-only /app), never inside the staging copy the ranks remake."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    folder = torchrun.launcher_dir("s3://bucket/runs/a")
    assert folder == str(tmp_path / "staging" / ".launcher" / "bucket" / "runs" / "a") and os.path.isdir(folder)
    assert not folder.startswith(objects.staging_dir("s3://bucket/runs/a"))
    assert sorted(os.listdir(tmp_path)) == ["staging"]
    assert torchrun.launcher_dir(str(tmp_path / "run")) == str(tmp_path / "run")  # a folder: itself
