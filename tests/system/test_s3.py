"""s3:// run dirs against a local S3 server (moto's, tests/helpers/s3.py), with real ranks: two "nodes"
(two torchruns with different staging roots, so rank 0's staging folder really lacks the other node's
files) save, three ranks resume with the weights of the same run on a filesystem, and two nodes start a
new run from one of its checkpoints (checkpoint.resume_from, each node its own checked copy); two nodes
resume, each downloading only the files its rank reads (its GETs counted by a proxy); kill -9
during a save leaves the previous checkpoint the latest and the half-uploaded one is deleted after the
next commit; a save whose PUTs are cut half-way on one rank and held unanswered on the other stops every
rank in one line naming the held object, within checkpoint.timeout_s (no stuck rank); every line names
the bucket's URL, not the staging copy; a flipped byte in the bucket makes resume take the older
checkpoint; a second job on the same prefix is refused while the first holds the lease; trainer.export
and trainer.metrics read an s3:// run dir; docs/checkpoints.md's commands run as written.
Then the store's slower unit cases: the verified download (flipped bytes) and each bad input's line."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import xxhash

from tests.helpers.outputs import assert_same_losses, assert_same_weights, losses, rows, weights
from tests.helpers.pages import block
from tests.helpers.run import ROOT, TINY, TORCHRUN, command, env, python, run_command, wait_for
from tests.helpers.s3 import Proxy, Server, download, free_port, keys
from trainer.checkpoint import remote
from trainer.resilience import outcomes
from trainer.rundir import objects

pytestmark = pytest.mark.slow

RUN = [*TINY, "train.steps=8", "checkpoint.interval=4", "checkpoint.keep=0"]


def _store(bucket: str, prefix: str = "runs/one") -> objects.Store:
    return objects.Store(f"s3://{bucket}/{prefix}")


def _env(server: Server, staging) -> dict:
    return {**server.env, objects.STAGING_ENV: str(staging)}


def _train(server, staging, url, nproc, *overrides, expect=0) -> subprocess.CompletedProcess:
    proc = run_command(command(url, nproc, overrides), timeout=300, extra_env=_env(server, staging))
    if proc.returncode != expect:
        pytest.fail(
            f"trainer exited {proc.returncode}, expected {expect}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def _replicated_files(folder) -> set[str]:
    """The shard files of the checkpoint `folder` that hold an entry every rank reads: a value (bytes)
    or a tensor saved whole, in one chunk (DCP's metadata, as the export tool reads it)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from trainer.checkpoint import manager

    why, metadata = manager.checked_metadata(str(folder))
    assert why is None, why
    whole = {
        fqn
        for fqn, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, BytesStorageMetadata)
        or (len(meta.chunks) == 1 and list(meta.chunks[0].sizes) == list(meta.size))
    }
    return {info.relative_path for index, info in metadata.storage_data.items() if index.fqn in whole}


def _two_nodes(server, stagings, url, overrides, endpoints=(None, None)) -> list[subprocess.Popen]:
    """Two torchruns of one rank each, as two nodes of one job, each with its own staging root (and
    its own endpoint where `endpoints` names one: a Proxy that records the node's requests)."""
    port = str(free_port())
    args = ["-m", "trainer", "--config", str(ROOT / "configs/default.yaml"), f"run_dir={url}", *overrides]
    return [
        subprocess.Popen(
            [
                TORCHRUN,
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                *args,
            ],
            cwd=ROOT,
            env={
                **env(),
                **_env(server, stagings[node]),
                **({"AWS_ENDPOINT_URL": endpoints[node]} if endpoints[node] else {}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]


def test_two_nodes_save_and_three_ranks_resume_as_on_a_filesystem(s3, tmp_path):
    server, bucket = s3
    reference = tmp_path / "reference"
    _train(server, tmp_path / "unused", str(reference), 2, *RUN)
    url, prefix = f"s3://{bucket}/runs/r", "runs/r"
    stagings = [tmp_path / "node0", tmp_path / "node1"]
    nodes = _two_nodes(server, stagings, url, RUN)
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    # each node's staging folder holds its own ranks' files only: the bucket has both
    local = [root / bucket / "runs" / "r" / "checkpoints" for root in stagings]
    assert sorted(os.listdir(local[0] / "step_00000008")) == [
        ".metadata",
        "__0_0.distcp",
        "__0_0.distcp.xxh3",
        "chunks.npz",
        "manifest.json",
        "meta.json",
        "rng",
    ]
    assert os.listdir(local[1]) == []  # its copy of each save removed once uploaded
    manifest = json.loads(
        server.client()
        .get_object(Bucket=bucket, Key=f"{prefix}/checkpoints/step_00000008/manifest.json")["Body"]
        .read()
    )
    assert {"__0_0.distcp", "__1_0.distcp", "rng/rank_00000.pt", "rng/rank_00001.pt", "meta.json"} <= set(
        manifest["files"]
    )
    copy = download(server, bucket, prefix, tmp_path / "copy")
    assert_same_weights(weights(copy, 8), weights(reference, 8), exact=True)

    # the two nodes resume from step 4 (step 8's manifest removed, as if the job was killed while it
    # uploaded it), each through a proxy that records its GETs: each node downloads the small files
    # its ranks read and the shard files its rank's load plan reads, each once; the run ends as before
    server.client().delete_object(Bucket=bucket, Key=f"{prefix}/checkpoints/step_00000008/manifest.json")
    gets: list[list[str]] = [[], []]
    proxies = [
        Proxy(
            server,
            delay=lambda line, got=got: (
                got.append(line.split()[1].split("?")[0]) or 0.0 if line.startswith("GET ") else 0.0
            ),
        )
        for got in gets
    ]
    try:
        nodes = _two_nodes(server, stagings, url, RUN, endpoints=[p.url for p in proxies])
        outs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for proxy in proxies:
            proxy.stop()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert " at step 4 (saved by 2 processes" in outs[0], outs[0][-3000:]
    step_4 = f"/{bucket}/{prefix}/checkpoints/step_00000004/"
    fetched = [[path[len(step_4) :] for path in got if path.startswith(step_4)] for got in gets]
    for names in fetched:
        assert len(names) == len(set(names)), names  # each file once
    # rank 0 reads the chunk index (for every rank), each rank its own rng file, its own shard file and
    # the files holding the replicated entries (DCP keeps one copy, in the file of the rank it chose)
    replicated = _replicated_files(copy / "checkpoints" / "step_00000004")
    assert "__0_0.distcp" not in replicated  # so node 1 never downloads rank 0's shard file
    assert sorted(fetched[0]) == sorted(
        {"manifest.json", "chunks.npz", "meta.json", "rng/rank_00000.pt", "__0_0.distcp", *replicated, "owner"}
    ), fetched  # `owner` of step 4 read by the retention after the save of step 8
    assert sorted(fetched[1]) == sorted({"meta.json", "rng/rank_00001.pt", "__1_0.distcp", *replicated}), fetched
    assert len({*fetched[0], *fetched[1]} & {"__0_0.distcp", "__1_0.distcp"}) == 2  # every shard, by a node needing it
    resumed = download(server, bucket, prefix, tmp_path / "resumed-two")
    assert_same_weights(weights(resumed, 8), weights(reference, 8), exact=True)

    # checkpoint.resume_from naming the bucket's step 4, on two nodes sharing no filesystem: each node's
    # local rank 0 downloads its own checked copy; the new run (another prefix) ends with step 8's weights
    # of the run it started from, and each node's copy is removed at the end
    other = f"s3://{bucket}/runs/from-r"
    nodes = _two_nodes(server, stagings, other, [*RUN, f"checkpoint.resume_from={url}/checkpoints/step_00000004"])
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert " at step 4 (saved by 2 processes" in outs[0], outs[0][-3000:]
    started = download(server, bucket, "runs/from-r", tmp_path / "from-r")
    assert_same_weights(weights(started, 8), weights(reference, 8), exact=True)
    for root in stagings:  # only the run dirs' own staging folders: no private copy left behind
        assert sorted(os.listdir(root / bucket / "runs")) == ["from-r", "r"], os.listdir(root / bucket / "runs")

    # a byte of step 8 flipped in the bucket: its download fails the manifest's check on the node that
    # fetches it, and 3 ranks resume from step 4
    shard = f"{prefix}/checkpoints/step_00000008/__1_0.distcp"
    data = bytearray(server.client().get_object(Bucket=bucket, Key=shard)["Body"].read())
    data[len(data) // 2] ^= 0x10
    server.client().put_object(Bucket=bucket, Key=shard, Body=bytes(data))
    three = _train(server, tmp_path / "three", url, 3, *RUN)
    out = three.stdout + three.stderr
    assert f"skipping checkpoint {url}/checkpoints/step_00000008: __1_0.distcp is damaged: " in out, out[-3000:]
    assert "at step 4 (saved by 2 processes" in out, out[-3000:]
    resumed = download(server, bucket, prefix, tmp_path / "resumed")
    assert_same_weights(weights(resumed, 8), weights(reference, 8))
    assert_same_losses(losses(resumed), losses(reference))  # metrics.jsonl: downloaded, appended, uploaded
    assert not server.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/lease.json").get("Contents")
    # trainer.export reads the bucket: its newest checkpoint, downloaded and checked, then removed
    exported = run_command(
        [sys.executable, "-m", "trainer.export", url, "--out", str(tmp_path / "model.pt")],
        extra_env=_env(server, tmp_path / "export"),
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert_same_weights(torch.load(tmp_path / "model.pt", weights_only=True), weights(resumed, 8), exact=True)
    assert os.listdir(tmp_path / "export" / bucket / "runs") == []
    summary = run_command([sys.executable, "-m", "trainer.metrics", url], extra_env=_env(server, tmp_path / "export"))
    assert summary.stdout.startswith(f"{url}: 8 steps, loss "), summary.stdout + summary.stderr


def test_kill_9_during_an_upload_and_a_second_job_refused(s3, tmp_path):
    server, bucket = s3
    url, prefix = f"s3://{bucket}/runs/k", "runs/k"
    long_run = [*TINY, "train.steps=400", "checkpoint.interval=2", "checkpoint.keep=0"]
    # Once `hold` is set, the PUT of a save's meta.json (before its manifest) waits in the proxy: that
    # save is surely in flight when it is killed (a save seen in flight had committed by the kill, on a
    # loaded machine).
    hold, holding = threading.Event(), []

    def delay(line: str) -> float:
        if hold.is_set() and line.startswith("PUT ") and "/meta.json " in line:
            holding.append(line)
            return 60.0
        return 0.0

    held = Proxy(server, delay=delay)
    job = subprocess.Popen(
        command(url, 1, long_run),  # one rank: each rank's own upload is the two-node test's
        cwd=ROOT,
        env={**env(), **_env(server, tmp_path / "first"), "AWS_ENDPOINT_URL": held.url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def committed() -> list[int]:  # the steps whose manifest is in the bucket
            found = keys(server, bucket, prefix)
            return sorted(int(k[17:25]) for k in found if k.startswith("checkpoints/") and k.endswith("/manifest.json"))

        wait_for(lambda: committed(), what="the first upload", interval=0.1)
        second = _train(server, tmp_path / "second", url, 1, *long_run, expect=outcomes.BAD_INPUT.code)
        assert f"run_dir {url} is in use by process " in second.stdout + second.stderr

        def in_flight():  # the newest step prefix marked by its save but without rank 0's files yet
            found = keys(server, bucket, prefix)
            steps = sorted({k[12:25] for k in found if k.startswith("checkpoints/step_")})
            return steps and f"checkpoints/{steps[-1]}/meta.json" not in found and int(steps[-1][5:])

        hold.set()
        killed_at = wait_for(in_flight, what="a save in flight", interval=0.05)
        time.sleep(0.5)  # a save whose meta.json went out before `hold` has committed by now
        killed_at = wait_for(in_flight, what="a save held in flight", interval=0.05)
        job.kill()
    finally:
        job.kill()
        held.stop()  # its held PUT is dropped
        out = job.communicate(timeout=60)[0]
    assert holding and f"/checkpoints/step_{killed_at:08d}/meta.json " in holding[-1], holding
    assert killed_at not in committed(), out[-2000:]
    previous = committed()[-1]
    assert previous < killed_at

    # a restart on 2 ranks through a proxy that slows every LIST, cuts the PUT of rank 1's shard of the
    # next save half-way and holds rank 0's (no answer): it resumes all the same; rank 0's upload gives
    # up within 0.75 of checkpoint.timeout_s while rank 1 waits for it in the all-gather (not timed out
    # as a stuck rank); every rank stops with rank 0's line, restartable, nothing lost
    step = f"/{bucket}/{prefix}/checkpoints/step_{previous + 1:08d}"
    proxy = Proxy(
        server,
        cut=lambda line: line.startswith(f"PUT {step}/__1_0.distcp "),
        delay=lambda line: (
            0.5 if "list-type=2" in line else 60.0 if line.startswith(f"PUT {step}/__0_0.distcp ") else 0.0
        ),
    )
    try:
        cut = run_command(
            command(url, 2, [*TINY, f"train.steps={previous + 1}", "checkpoint.timeout_s=20"]),
            timeout=300,
            extra_env={**_env(server, tmp_path / "proxied"), "AWS_ENDPOINT_URL": proxy.url},
        )
    finally:
        proxy.stop()
    said = cut.stdout + cut.stderr
    assert cut.returncode == outcomes.FAILED.code and proxy.cuts, said[-3000:]
    assert f"at step {previous} (saved by 1 processes" in said
    assert (
        f"error: uploading the checkpoint of step {previous + 1} to {url} failed (rank 0: StoreError: {url}/"
        f"checkpoints/step_{previous + 1:08d}/__0_0.distcp: no answer from the object store at {proxy.url} after "
    ) in said, said[-3000:]
    assert (
        " s (a save's requests get 0.75 of checkpoint.timeout_s=20 s, which the other ranks wait: raise it for a "
        "slower store)); the checkpoints uploaded before are intact"
    ) in said, said[-3000:]
    assert "did not answer" not in said, said[-3000:]  # not a stuck rank
    assert "the checkpoints uploaded before are intact; check the object store, then start again to resume" in said
    assert committed()[-1] == previous

    # the lease of the killed run was renewed moments ago: a restart by the same job would wait for
    # it to go stale; the operator's restart here takes it over as a process of this host that is gone
    out = _train(server, tmp_path / "again", url, 1, *TINY, f"train.steps={previous + 1}").stdout
    assert f"at step {previous} (saved by 1 processes" in out, out[-3000:]
    left = keys(server, bucket, prefix)
    assert not [k for k in left if k.startswith(f"checkpoints/step_{killed_at:08d}/")]  # the orphan deleted
    assert f"checkpoints/step_{previous + 1:08d}/manifest.json" in left


def test_the_pages_commands_as_written(s3, tmp_path):
    """docs/checkpoints.md's "Object storage (s3://)" block, run as written: its pip line aside (the venv
    has s3fs), its exported variables pointed at the moto server, the bucket my-bucket created; the
    second `make run` resumes from the first's step 8 and ends at 16, its rows appended to the first's."""
    server, _ = s3
    lines = block("docs/checkpoints.md", "Object storage (s3://)").splitlines()
    assert lines[0].startswith("pip install ")
    exports = [shlex.split(line.split("#")[0]) for line in lines if line.startswith("export ")]
    named = [word.split("=")[0] for words in exports for word in words[1:]]
    assert named == ["AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    runs = [line for line in lines if line.startswith("make run ")]
    assert len(runs) == 2 and len(lines) == 1 + len(exports) + len(runs)
    exported = {name: server.env[name] for name in named}
    server.client().create_bucket(Bucket="my-bucket")
    url, prefix = "s3://my-bucket/runs/tiny", "runs/tiny"
    e = {**env(), **exported, objects.STAGING_ENV: str(tmp_path / "staging")}
    e.pop("NPROC", None)
    said = []
    for line in runs:
        proc = subprocess.run(["bash", "-c", line], cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)
        said.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"{line}\n{said[-1][-5000:]}"
    # every line names the bucket's URL, never the node-local staging copy the run works in
    assert f"resumed from {url}/checkpoints/step_00000008 at step 8 (saved by 2 processes" in said[1], said[1][-3000:]
    assert "resumed from" not in said[0], said[0][-3000:]
    for step in (4, 8):
        assert f"saved checkpoint {url}/checkpoints/step_{step:08d}\n" in said[0], said[0][-3000:]
    assert f"deleted checkpoint {url}/checkpoints/step_00000004\n" in said[1], said[1][-3000:]  # keep: 3
    assert str(tmp_path / "staging") not in said[0] + said[1], said[1][-3000:]
    assert f"finished at step 16: checkpoint {url}/checkpoints/step_00000016, metrics {url}/metrics.jsonl" in said[1]
    # the second line typed again (a Slurm requeue, a JobSet restart): the launcher reads the bucket's
    # newest checkpoint (its manifest, its meta.json) and stops before any rank starts, downloading nothing
    staged = tmp_path / "staging" / "my-bucket" / "runs" / "tiny" / "checkpoints"
    shutil.rmtree(staged, ignore_errors=True)  # the second run's own; a rank's start downloads step 16 here
    proc = subprocess.run(["bash", "-c", runs[1]], cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nothing to do: step 16 reached train.steps=16; raise train.steps to continue\n" in proc.stdout, proc.stdout
    assert "launch: " not in proc.stderr and "warning" not in proc.stderr, proc.stderr[-3000:]  # no rank's device line
    assert not staged.exists()
    copy = download(server, "my-bucket", prefix, tmp_path / "copy")
    # the rows of both runs in the bucket's one metrics.jsonl, each once: log.interval (10 in the default
    # config) and each run's last step; the resume row names the checkpoint by its URL
    assert [r["step"] for r in rows(copy)] == [8, 10, 16]
    written = map(json.loads, (copy / "metrics.jsonl").read_text().splitlines())
    resumes = [r for r in written if r.get("event") == "resume"]
    assert [r["checkpoint"] for r in resumes] == [f"{url}/checkpoints/step_00000008"], resumes
    found = keys(server, "my-bucket", prefix)
    committed = sorted(k for k in found if k.startswith("checkpoints/") and k.endswith("/manifest.json"))
    assert committed[-1] == "checkpoints/step_00000016/manifest.json", committed

    # checkpoint.resume_from naming a checkpoint in the bucket: a new run on a filesystem, on one
    # process, starts from the bucket's step 12 (downloaded and checked) and ends with its step 16's weights
    local_run = tmp_path / "from-bucket"

    def start_from(run_dir, resume_from, *more, staging=tmp_path / "staging"):
        """The trainer on one process, in `run_dir`, with checkpoint.resume_from=`resume_from`."""
        overrides = [f"run_dir={run_dir}", f"checkpoint.resume_from={resume_from}", *more]
        variables = {**e, objects.STAGING_ENV: str(staging)}
        config = ROOT / "configs/default.yaml"
        return python("-m", "trainer", "--config", config, *overrides, timeout=300, extra_env=variables)

    started = start_from(local_run, f"{url}/checkpoints/step_00000012", "train.steps=16")
    out = started.stdout + started.stderr
    assert started.returncode == 0, out[-3000:]
    assert f"resumed from {url}/checkpoints/step_00000012 at step 12 (saved by 2 processes" in out, out[-3000:]
    assert str(tmp_path / "staging") not in out, out[-3000:]  # its download is named by its URL
    assert_same_weights(weights(local_run, 16), weights(copy, 16))
    assert os.listdir(tmp_path / "staging" / "my-bucket" / "runs") == ["tiny"]  # its copy removed at the end
    # started again, the run continues from its own step 16: the bucket's checkpoint is not downloaded again
    again = start_from(local_run, f"{url}/checkpoints/step_00000012", "train.steps=17", staging=tmp_path / "no-staging")
    out = again.stdout + again.stderr
    assert again.returncode == 0 and " at step 16 (saved by 1 process" in out, out[-3000:]
    assert f"checkpoint.resume_from={url}/checkpoints/step_00000012 is not used" in out, out[-3000:]
    assert not (tmp_path / "no-staging").exists()
    # the bucket's step 4, deleted by the retention: one line, before anything is written
    gone = f"{url}/checkpoints/step_00000004"
    refused = start_from(tmp_path / "gone", gone)
    assert refused.returncode == outcomes.BAD_INPUT.code, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        f"error: override 'checkpoint.resume_from={gone}': checkpoint.resume_from: {gone} is not a committed "
        f"checkpoint: it has no manifest.json (a save "
        f"that never finished, or one retention deleted); give a step whose manifest.json is there"
    ], refused.stderr
    assert not (tmp_path / "gone").exists()


def _manifest(listed: dict, run_id: str = "r" * 32) -> bytes:
    digest = xxhash.xxh3_64_intdigest(json.dumps(listed, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps({"files": listed, "xxh3_64": digest, "run_id": run_id}).encode()


def test_download_checks_every_byte_against_the_manifest(s3, tmp_path, monkeypatch):
    _, bucket = s3
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    store = _store(bucket)
    body = bytes(range(256)) * 4
    store.put("checkpoints/step_00000002/rng/rank_00000.pt", body)
    record = {"size": len(body), "xxh3_64": xxhash.xxh3_64_intdigest(body)}
    store.put("checkpoints/step_00000002/manifest.json", _manifest({"rng/rank_00000.pt": record}))
    staging = remote.Staging(f"s3://{bucket}/runs/one", rank=0, local_rank=0, local_world_size=1)
    assert staging.local == str(tmp_path / "staging" / bucket / "runs" / "one")
    assert oct(os.stat(tmp_path / "staging").st_mode & 0o777) == "0o700"
    step, manifest = staging.committed("r" * 32)
    assert step == 2 and staging.committed("another run id") is None
    assert staging.fetch(step, manifest) is None
    assert (tmp_path / "staging" / bucket / "runs/one/checkpoints/step_00000002/rng/rank_00000.pt").read_bytes() == body

    flipped = bytearray(body)
    flipped[100] ^= 1
    store.put("checkpoints/step_00000002/rng/rank_00000.pt", bytes(flipped))
    assert staging.fetch(step, manifest) == (
        f"rng/rank_00000.pt is damaged: 1024 bytes with checksum {xxhash.xxh3_64_intdigest(bytes(flipped)):016x}, "
        f"but the manifest says 1024 bytes with {record['xxh3_64']:016x}"
    )
    store.put("checkpoints/step_00000002/manifest.json", _manifest({"../escape": record}))
    assert staging.committed(None) is None  # a manifest naming a key outside the prefix: never downloaded


def test_bad_input_is_one_line(s3, monkeypatch, tmp_path):
    server, bucket = s3
    with pytest.raises(objects.StoreError) as e:
        _store("no-such-bucket").check()
    assert str(e.value) == (
        f"run_dir: s3://no-such-bucket/runs/one: bucket no-such-bucket does not exist at {server.url}; "
        f"create it or fix run_dir"
    )
    port = free_port()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(objects.StoreError) as e:
        _store(bucket).check()
    assert str(e.value) == (
        f"run_dir: s3://{bucket}/runs/one: cannot reach the object store at http://127.0.0.1:{port}; check "
        f"AWS_ENDPOINT_URL and the network"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(objects.StoreError) as e:
        _store(bucket).check()
    assert str(e.value) == (
        f"run_dir: s3://{bucket}/runs/one: no credentials for the object store: set AWS_ACCESS_KEY_ID and "
        f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    )
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as where it is not installed
    with pytest.raises(objects.StoreError) as e:
        _store(bucket)
    assert str(e.value) == (
        f"run_dir: s3://{bucket}/runs/one needs s3fs, which is not installed: pip install 's3fs' (or the project's "
        f"'s3' extra: pip install -e '.[s3]')"
    )


def test_wrong_credentials_are_one_line(monkeypatch):
    """moto checks credentials when started with INITIAL_NO_AUTH_ACTION_COUNT=0."""
    server = Server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(objects.StoreError) as e:
            _store("some-bucket").check()
        assert str(e.value).startswith("run_dir: s3://some-bucket/runs/one: the object store refused the credentials (")
        assert str(e.value).endswith("): check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    finally:
        server.stop()
