"""The system tier of tests/unit/test_hf.py, whose docstring says what both halves test."""

import json
import os
import shutil
import tempfile

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: every model is made here
transformers = pytest.importorskip("transformers")

from tests.helpers.outputs import assert_same_weights, losses, weights
from tests.helpers.run import PYTHON, TINY, export_hf, launched, python, run_command, train
from tests.helpers.s3 import Proxy
from tests.unit.test_hf import SCALING, TOKENS, hf_llama
from trainer import hf, models
from trainer.config import (
    Config,
    resolve,
)
from trainer.models.transformer import hf as transformer_hf
from trainer.rundir import objects


@pytest.mark.slow
def test_rope_settings_are_recorded_in_the_run_config(tmp_path):
    train(
        tmp_path,
        1,
        *TINY,
        "train.steps=1",
        "model.rope_theta=500000",
        "model.rope_scaling.factor=2",
        "model.rope_scaling.original_max_position_embeddings=16",
        "model.tie_embeddings=true",
    )
    import yaml

    recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]
    assert recorded["rope_theta"] == 500000.0 and recorded["tie_embeddings"] is True
    assert recorded["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 2.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    assert recorded["dim"] == 64 and recorded["vocab_size"] == 256  # the size spelled out


def hf_state(folder) -> dict[str, torch.Tensor]:
    """Our names -> the tensors of an HF folder (read back with safetensors)."""
    files = hf.weight_files(str(folder))
    from safetensors import safe_open

    ours = {}
    names = transformer_hf
    for name in [*names._TOP, *(f"layers.{i}.{k}" for i in range(2) for k in names._LAYER)]:
        if names.hf_name(name) in files:
            with safe_open(files[names.hf_name(name)], framework="pt") as f:
                ours[name] = f.get_tensor(names.hf_name(name))
    return ours


# optim.lr so small that a step leaves every fp32 weight as it was: the checkpoint holds the start
UNCHANGED = [*TINY, "train.steps=1", "optim.lr=1e-30", "optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    """A tiny HF Llama saved in several shards with an index, as big checkpoints are."""
    folder = tmp_path_factory.mktemp("hf_sharded")
    hf_llama(folder, max_shard_size="20KB")
    assert (folder / hf.INDEX).exists() and len(list(folder.glob("*.safetensors"))) > 1
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (1, []),
        (2, []),
        (3, []),
        (2, ["parallel.sharding=hybrid", "parallel.shard_size=1", "parallel.activation_checkpointing=true"]),
    ],
    ids=["1", "2-and-from-s3", "3", "2-replicated-act_ckpt"],
)
def test_init_from_loads_the_same_weights_on_any_number_of_processes(
    tmp_path, sharded_llama, nproc, overrides, request
):
    """3 processes shard 16 key/value rows, 80 FFN rows and 96 vocabulary rows unevenly; hybrid
    sharding with groups of 1 replicates (a 2-D mesh), activation checkpointing renames modules.
    On 2 processes the same run starts from the folder uploaded to a bucket too (model.init_from=s3://,
    against moto's server, through the launcher): the same weights and losses exactly, its private copy
    gone at the end, and the headers read by the launcher and rank 0 alone (--weights-checked)."""
    train(tmp_path / "run", nproc, *UNCHANGED, *overrides, f"model.init_from={sharded_llama}")
    got, expected = weights(tmp_path / "run"), hf_state(sharded_llama)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name
    if request.node.callspec.id == "2-and-from-s3":
        _the_same_run_from_a_bucket(tmp_path, sharded_llama, request)


def _the_same_run_from_a_bucket(tmp_path, sharded_llama, request):
    server, bucket = request.getfixturevalue("s3")  # skipped here where moto or s3fs is missing
    request.getfixturevalue("monkeypatch").setenv(objects.STAGING_ENV, str(tmp_path / "staging"))
    for path in sorted(sharded_llama.iterdir()):
        server.client().upload_file(str(path), bucket, f"models/llama/{path.name}")
    url = f"s3://{bucket}/models/llama"
    requests: list[str] = []
    proxy = Proxy(server, delay=lambda line: requests.append(line.split()[1].split("?")[0]) or 0.0)
    try:
        proc = launched(
            tmp_path / "from_s3", *UNCHANGED, f"model.init_from={url}", extra_env={"AWS_ENDPOINT_URL": proxy.url}
        )
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert f"initialised from {url} in " in proc.stdout + proc.stderr
    # The launcher reads each header (2 ranged GETs), rank 0 again for the listing every node downloads
    # (2 more), and this node's local rank 0 downloads it (1 GET): none by a rank told --weights-checked.
    gets = {path.rsplit("/", 1)[1]: requests.count(path) for path in requests if path.startswith(f"/{bucket}/")}
    shards = sorted(p.name for p in sharded_llama.glob("*.safetensors"))
    assert {name: gets[name] for name in shards} == dict.fromkeys(shards, 5)
    assert gets[hf.CONFIG] == 4  # the launcher, each rank (its shape: one GET, no listing), the download
    assert_same_weights(weights(tmp_path / "from_s3"), weights(tmp_path / "run"), exact=True)
    assert losses(tmp_path / "from_s3") == losses(tmp_path / "run") != {}
    staged = sorted(str(p.relative_to(tmp_path / "staging")) for p in (tmp_path / "staging").rglob("*"))
    assert staged == [bucket, f"{bucket}/models"]  # the private copy (.hf-llama-XXXX) was there: removed at exit


@pytest.mark.slow
def test_the_run_dirs_own_checkpoints_win_over_init_from(tmp_path, sharded_llama):
    train(tmp_path, 1, *UNCHANGED, f"model.init_from={sharded_llama}")
    proc = train(tmp_path, 1, *TINY, "train.steps=2", f"model.init_from={sharded_llama}")
    assert (
        f"model.init_from={sharded_llama} is not used: this run dir has checkpoints of its own"
        in proc.stdout + proc.stderr
    )
    assert "resumed from" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    """Start from HF, train 3 steps on 2 processes, export in shards: transformers' logits are ours."""
    hf_llama(tmp_path / "start", tied=tied)
    train(tmp_path / "run", 2, *TINY, "train.steps=3", f"model.init_from={tmp_path / 'start'}")
    export_hf(tmp_path / "run", tmp_path / "out", "--max-shard-size", "30KB")
    out = tmp_path / "out"
    index = json.loads((out / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1 and ("lm_head.weight" in index["weight_map"]) != tied
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == SCALING and config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] == tied and config["max_position_embeddings"] == 128
    assert config["num_key_value_heads"] == 2 and config["model_type"] == "llama"
    assert (out / "generation_config.json").exists()  # passed on from the folder the run started from
    assert config["eos_token_id"] == json.loads((tmp_path / "start" / "config.json").read_text())["eos_token_id"]

    trained = weights(tmp_path / "run")
    assert not torch.equal(
        trained["layers.0.attention.wq.weight"], hf_state(tmp_path / "start")["layers.0.attention.wq.weight"]
    )
    ours = models.build(resolve(Config(model=models.ModelArgs(init_from=str(tmp_path / "start"), seq_len=64))).model)
    ours.load_state_dict(trained)
    theirs = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, ours.eval()(TOKENS), atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_export_refuses_a_bad_shard_size(tmp_path):
    train(tmp_path / "run", 1, *TINY, "train.steps=1")
    proc = python(
        "-m",
        "trainer.export",
        str(tmp_path / "run"),
        "--format",
        "hf",
        "--out",
        str(tmp_path / "out"),
        "--max-shard-size",
        "lots",
        timeout=None,
    )
    assert proc.returncode == 2 and "--max-shard-size: size 'lots'" in proc.stderr


@pytest.mark.slow  # an interpreter, as a second uid
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="runs as a second uid: root, setpriv")
def test_a_weight_file_we_may_not_read_is_named_as_unreadable_not_missing():
    """Issue 41 item 10: a model.safetensors of another owner, mode 0600, was reported as "No such file
    or directory" (safetensors' words). The user, a second uid here, is told it cannot be read, by whom
    it is owned and what to do."""
    with tempfile.TemporaryDirectory(dir="/tmp") as shared:  # a folder the second uid can reach
        os.chmod(shared, 0o755)
        folder = os.path.join(shared, "hf")
        hf_llama(folder)
        os.chmod(folder, 0o755)
        weights = os.path.join(folder, "model.safetensors")
        os.chmod(weights, 0o600)  # root's, readable by root only
        script = "from trainer import hf\ntry:\n    hf.weight_files({!r})\nexcept hf.HFError as e:\n    print(e)"
        as_second_uid = ["setpriv", "--reuid=4321", "--regid=4321", "--clear-groups"]
        proc = run_command([*as_second_uid, PYTHON, "-c", script.format(folder)])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == (
            f"{weights} cannot be read by you (uid 4321): it is owned by uid 0 with mode 600; ask its owner to "
            f"make it readable (chmod a+r), or copy the folder\n"
        )
