"""model.init_from naming a Hugging Face folder in a bucket (trainer/hf.py's _Bucket), against moto's S3
server (tests/helpers/s3.py): the folder is checked from its config.json and each safetensors header
alone (two ranged reads per file, no weight downloaded, nothing in a sub-prefix taken); each bad object
is one line naming its s3:// URL; the download at a start takes only the files the loader needs, of the
version listed, checked as they are written. A run from such a folder is in tests/system/test_hf.py."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.bad_input import DEFAULT
from tests.helpers.inputs import hf_folder
from tests.helpers.run import TINY
from tests.helpers.s3 import Proxy
from trainer import dist, hf
from trainer.config import Config, ConfigError, resolve
from trainer.models import ModelArgs
from trainer.preflight.startup import Target, preflight
from trainer.rundir import objects

PREFIX = "models/m"


def _folder(tmp_path):
    """A local folder: config.json, two shards with their index, a tokenizer file, and a file the
    loader does not need."""
    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    torch.manual_seed(0)
    save_file({"a.weight": torch.randn(4, 8), "a.bias": torch.randn(4)}, folder / "one.safetensors")
    save_file({"b.weight": torch.randn(2, 8)}, folder / "two.safetensors", metadata={"format": "pt"})
    weight_map = {"a.weight": "one.safetensors", "a.bias": "one.safetensors", "b.weight": "two.safetensors"}
    (folder / hf.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "notes.txt").write_text("not the loader's")
    return folder


def _upload(server, bucket: str, folder, prefix: str = PREFIX, client=None) -> str:
    client = client or server.client()
    for path in sorted(folder.iterdir()):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
    return f"s3://{bucket}/{prefix}"


def test_a_bucket_folder_is_checked_from_its_headers_and_downloaded_as_listed(s3, tmp_path, monkeypatch):
    server, bucket = s3
    folder = _folder(tmp_path)
    url = _upload(server, bucket, folder)
    server.client().put_object(Bucket=bucket, Key=f"{PREFIX}/sub/three.safetensors", Body=b"not taken")
    requests: list[str] = []
    proxy = Proxy(server, delay=lambda line: requests.append(line) or 0.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        assert hf.read_config(url) == {"model_type": "llama", "hidden_size": 8}
        local = hf.weight_files(str(folder))
        assert hf.weight_files(url) == {name: f"{url}/{path.rsplit('/', 1)[1]}" for name, path in local.items()}
    finally:
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    gets = [line.split()[1].split("?")[0] for line in requests if line.startswith("GET ")]
    shards = sorted(g.rsplit("/", 1)[1] for g in gets if g.endswith(".safetensors"))
    assert shards == ["one.safetensors"] * 2 + ["two.safetensors"] * 2  # its length, then its header: no weight

    copy = tmp_path / "copy"
    copy.mkdir()
    names = hf.download(url, str(copy))
    assert sorted(names) == sorted(p.name for p in copy.iterdir())
    assert sorted(names) == ["config.json", hf.INDEX, "one.safetensors", "tokenizer.json", "two.safetensors"]
    assert all((copy / name).read_bytes() == (folder / name).read_bytes() for name in names)


def _requests(lines: list[str], bucket: str) -> list[str]:
    """The S3 requests of the proxy's request lines, as "LIST" or "GET <key below the bucket>"."""
    said = []
    for line in lines:
        path, _, query = line.split()[1].partition("?")
        said.append("LIST" if "list-type=2" in query else f"{line.split()[0]} {path.split(f'/{bucket}/', 1)[-1]}")
    return said


def test_a_rank_told_the_weights_were_checked_reads_config_json_alone(s3, tmp_path, monkeypatch):
    """Each node's launcher reads the folder whole in its preflight (the index, each header) and tells
    its ranks so (--weights-checked): a rank so told reads config.json alone, for the shape, with one
    GET (16,384 ranks x ~190 shards of a 405B model would be millions of requests before training); a
    rank started by hand reads it all. A local folder alike: its header unreadable, only the told rank starts."""
    server, bucket = s3
    index = json.dumps({"weight_map": {"model.norm.weight": "model.safetensors"}})
    folder = hf_folder(tmp_path, index=index)
    url = _upload(server, bucket, folder)
    env = dist.Env(0, 0, 2, 2, torch.device("cpu"))
    overrides = [f"run_dir={tmp_path / 'run'}", *TINY]
    requests: list[str] = []
    proxy = Proxy(server, delay=lambda line: requests.append(line) or 0.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    seen = {}
    try:
        for told in (True, False):
            requests.clear()
            target = Target.rank(env, memory_checked=True, weights_checked=told)
            ready = preflight(target, DEFAULT, [*overrides, f"model.init_from={url}"])
            assert (ready.cfg.model.dim, ready.cfg.model.n_layers) == (32, 1)
            seen[told] = _requests(requests, bucket)
    finally:
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    assert seen[True] == [f"GET {PREFIX}/config.json"]
    shard = f"GET {PREFIX}/model.safetensors"
    assert seen[False] == ["LIST", "LIST", f"GET {PREFIX}/config.json", f"GET {PREFIX}/{hf.INDEX}", shard, shard]

    (folder / "model.safetensors").write_bytes(b"\xff" * 16)  # its header unreadable
    local = [*overrides, f"model.init_from={folder}"]
    assert preflight(Target.rank(env, True, weights_checked=True), DEFAULT, local).cfg.model.dim == 32
    with pytest.raises(ConfigError, match=r"model.safetensors is not a readable safetensors file"):
        preflight(Target.rank(env, True), DEFAULT, local)


def _single(tmp_path) -> bytes:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(3, 5)}, path)
    return path.read_bytes()


def test_each_bad_object_is_one_line_naming_its_url(s3, tmp_path):
    server, bucket = s3
    client = server.client()
    good = _single(tmp_path)
    n, size = int.from_bytes(good[:8], "little"), len(good)
    data = size - 8 - n
    cases = {
        "cut": (good[:-4], f"is cut short: its header says its tensors take {data:,} bytes, the object holds "),
        "padded": (good + b"\0" * 4, f"is padded: its header says its tensors take {data:,} bytes, the object holds "),
        "claims": (size.to_bytes(8, "little") + good[8:], f"is cut short: its header would be {size:,} bytes, "),
        "huge": ((100_000_001).to_bytes(8, "little") + good[8:], "is not a safetensors file: its header would be "),
    }
    expected = {
        "cut": f"{data - 4:,} after the header; upload it again",
        "padded": f"{data + 4:,} after the header; upload it again",
        "claims": f"the object holds {size:,}; upload it again",
        "huge": "100,000,001 bytes, more than safetensors allows (100,000,000); replace it with the model's file",
    }
    for case, (body, said) in cases.items():
        client.put_object(Bucket=bucket, Key=f"{case}/m/config.json", Body=b"{}")
        client.put_object(Bucket=bucket, Key=f"{case}/m/model.safetensors", Body=body)
        with pytest.raises(hf.HFError) as e:
            hf.weight_files(f"s3://{bucket}/{case}/m")
        assert str(e.value) == f"s3://{bucket}/{case}/m/model.safetensors {said}{expected[case]}", case

    client.put_object(Bucket=bucket, Key="noconfig/m/model.safetensors", Body=good)
    with pytest.raises(ConfigError) as e:  # as a run or `make check` says it
        resolve(Config(model=ModelArgs(init_from=f"s3://{bucket}/noconfig/m")))
    assert str(e.value) == (
        f"config: model.init_from: s3://{bucket}/noconfig/m/config.json not found; model.init_from needs a Hugging "
        f"Face folder with config.json and *.safetensors"
    )
    not_taken = "that the trainer does not take from a bucket (letters, digits, . _ = + -, at the folder's top level)"
    for case, key, body, said in [
        (
            "odd",
            hf.INDEX,
            b'{"weight_map": {"w": "../x.safetensors"}}',
            f"{hf.INDEX} names '../x.safetensors' {not_taken}; rename it",
        ),
        (
            "gone",
            hf.INDEX,
            b'{"weight_map": {"w": "gone.safetensors"}}',
            f"{hf.INDEX} names 'gone.safetensors', which s3://{bucket}/gone/m lacks; upload the whole model "
            f"folder again",
        ),
        ("spaced", "model 1.safetensors", good, f"holds 'model 1.safetensors' {not_taken}; rename it"),
    ]:
        client.put_object(Bucket=bucket, Key=f"{case}/m/{key}", Body=body)
        with pytest.raises(hf.HFError) as e:
            hf.weight_files(f"s3://{bucket}/{case}/m")
        where = f"s3://{bucket}/{case}/m" + ("/" if said.startswith(hf.INDEX) else " ")
        assert str(e.value) == where + said, case
    with pytest.raises(hf.HFError) as e:  # the store's own line: here a bucket that is not there
        hf.read_config("s3://no-such-bucket/m")
    assert str(e.value).startswith("s3://no-such-bucket/m: bucket no-such-bucket does not exist at http://127.0.0.1:")


def test_an_object_replaced_or_damaged_during_its_download_is_one_line(s3, tmp_path, monkeypatch):
    """Replaced between the listing and the download: If-Match refuses it. Damaged on the way (a bit
    flipped by a proxy): where the store keeps a checksum (boto3's uploads: CRC32) botocore's check
    refuses it; where it keeps none, the MD5 of a single-part upload's ETag does."""
    from botocore.config import Config as BotoConfig

    server, bucket = s3
    good = _single(tmp_path)
    url = f"s3://{bucket}/{PREFIX}"
    server.client().put_object(Bucket=bucket, Key=f"{PREFIX}/model.safetensors", Body=good)
    store = objects.Store(url, setting="")
    size, etag = store.listing()["model.safetensors"]
    server.client().put_object(Bucket=bucket, Key=f"{PREFIX}/model.safetensors", Body=good[:-1] + b"\1")
    with pytest.raises(objects.StoreError) as e:
        store.download("model.safetensors", str(tmp_path / "replaced"), size, etag)
    assert str(e.value) == (
        f"{url}/model.safetensors changed while it was downloaded (its ETag is no longer {etag}); start again once "
        f"the folder is complete"
    )

    import boto3

    from tests.helpers.s3 import _boto_credentials

    when_required = BotoConfig(request_checksum_calculation="when_required")  # no CRC32: the ETag alone
    plain = boto3.client("s3", endpoint_url=server.url, config=when_required, **_boto_credentials())
    plain.put_object(Bucket=bucket, Key=f"{PREFIX}/plain.safetensors", Body=good)
    proxy = Proxy(server, flip=lambda line: line.startswith("GET ") and ".safetensors" in line)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        store = objects.Store(url, setting="")
        listed = store.listing()
        with pytest.raises(objects.StoreError) as e:
            store.download("plain.safetensors", str(tmp_path / "plain"), *listed["plain.safetensors"])
        flipped = hashlib.md5(good[:-1] + bytes([good[-1] ^ 1])).hexdigest()
        assert str(e.value) == (
            f"{url}/plain.safetensors: the bytes downloaded have MD5 {flipped}, not its ETag "
            f"{listed['plain.safetensors'][1]}: damaged on the way; start again"
        )
        with pytest.raises(objects.StoreError) as e:
            store.download("model.safetensors", str(tmp_path / "checked"), *listed["model.safetensors"])
        assert str(e.value).startswith(
            f"{url}/model.safetensors: the bytes downloaded do not match the checksum the store keeps ("
        )
        assert str(e.value).endswith("): damaged on the way; start again")
    finally:
        proxy.stop()


def test_an_export_and_generate_take_the_tokenizer_of_a_bucket_folder(s3, tmp_path):
    """A run started from a bucket's folder: its export passes on that folder's tokenizer files and
    token ids (small bounded reads), and trainer.generate takes its tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from trainer import models
    from trainer.commands.generate import load_tokenizer

    server, bucket = s3
    args = resolve(Config(model=ModelArgs(seq_len=32))).model
    state = models.build(args).state_dict()
    start = tmp_path / "start"
    hf.save(state, args, str(start), 1 << 30)
    config = json.loads((start / "config.json").read_text())
    (start / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
    tokenizer = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str()
    (start / "tokenizer.json").write_text(tokenizer)
    (start / "generation_config.json").write_text('{"eos_token_id": 7}')
    url = _upload(server, bucket, start)

    from_s3 = resolve(Config(model=ModelArgs(init_from=url, seq_len=32))).model
    assert (from_s3.init_from, from_s3.dim, from_s3.vocab_size) == (url, args.dim, args.vocab_size)
    written = hf.save(state, from_s3, str(tmp_path / "out"), 1 << 30)
    assert {"tokenizer.json", "generation_config.json"} <= set(written)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == tokenizer
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 7
    assert load_tokenizer(Config(model=from_s3), None).encode(["a"], is_pretokenized=True).ids == [0]


def test_the_start_downloads_into_a_private_folder_removed_at_exit(s3, tmp_path, monkeypatch, group):
    """remote.hf_copy, as a start calls it (here on a group of one): the copy under the staging root,
    gone after remove_copies; a bad folder is the folder's HFError line, a store failure the store's."""
    from trainer.checkpoint import remote

    server, bucket = s3
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    folder = _folder(tmp_path)
    url = _upload(server, bucket, folder)
    copy = remote.hf_copy(url, group, rank=0, local_rank=0, local_world_size=1)
    assert copy.startswith(f"{tmp_path}/staging/{bucket}/models/.hf-m-")
    assert sorted(os.listdir(copy)) == ["config.json", hf.INDEX, "one.safetensors", "tokenizer.json", "two.safetensors"]
    remote.remove_copies()
    assert list((tmp_path / "staging" / bucket / "models").iterdir()) == []

    server.client().put_object(Bucket=bucket, Key=f"{PREFIX}/two.safetensors", Body=b"\0" * 7)
    with pytest.raises(hf.HFError) as e:
        remote.hf_copy(url, group, rank=0, local_rank=0, local_world_size=1)
    assert str(e.value) == f"{url}/two.safetensors holds 7 bytes, fewer than a safetensors file; upload it again"
    remote.remove_copies()


def test_every_node_downloads_rank_0s_listing_or_says_the_folder_changed(s3, tmp_path, monkeypatch, group):
    """A start's rank 0 lists and checks the folder once (hf.plan: name -> size, ETag of the files the
    loader needs); every node downloads that listing (hf.download(..., planned), each GET with If-Match
    of rank 0's ETag): an object replaced after rank 0's listing is the one line "changed while it was
    downloaded" on the node that would have had the new version, never two versions of a model. A rank
    whose shape came from another config.json than rank 0's listing's says so too (remote.hf_copy)."""
    from trainer.checkpoint import remote

    server, bucket = s3
    monkeypatch.setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    folder = _folder(tmp_path)
    url = _upload(server, bucket, folder)
    planned = hf.plan(url)
    listed = objects.Store(url, setting="").listing()
    names = ["config.json", hf.INDEX, "one.safetensors", "tokenizer.json", "two.safetensors"]
    assert sorted(planned) == names and all(planned[name] == listed[name] for name in names)
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    node_a.mkdir(), node_b.mkdir()
    assert sorted(hf.download(url, str(node_a), planned)) == names
    assert all((node_a / name).read_bytes() == (folder / name).read_bytes() for name in names)

    client = server.client()
    save_file({"b.weight": torch.zeros(2, 8)}, folder / "two.safetensors")  # a new version, valid
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/two.safetensors", Body=(folder / "two.safetensors").read_bytes())
    with pytest.raises(objects.StoreError) as e:
        hf.download(url, str(node_b), planned)
    assert str(e.value) == (
        f"{url}/two.safetensors changed while it was downloaded (its ETag is no longer "
        f"{planned['two.safetensors'][1]}); start again once the folder is complete"
    )

    # This rank took its shape from config.json (its preflight); the folder is then replaced, config.json too.
    assert hf.read_config(url) == {"model_type": "llama", "hidden_size": 8}
    read = listed["config.json"][1]
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/config.json", Body=b'{"model_type": "llama", "hidden_size": 16}')
    with pytest.raises(hf.HFError) as e:
        remote.hf_copy(url, group, rank=0, local_rank=0, local_world_size=1)
    assert str(e.value) == (
        f"{url}/config.json changed while it was downloaded (this rank took the model's shape from its version "
        f"{read}, rank 0's listing has {objects.Store(url, setting='').listing()['config.json'][1]}); start again once "
        f"the folder is complete"
    )
    remote.remove_copies()
