"""Hugging Face Llama folders both ways, checked against `transformers` itself: a tiny random Llama
(GQA, tied and untied, Llama 3 RoPE scaling) gives the same logits in our model after
`model.init_from`, and an export loads with `LlamaForCausalLM.from_pretrained` with the same logits."""

import json
import os
import re
import shutil
import tempfile

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: every model is made here
transformers = pytest.importorskip("transformers")

from conftest import PYTHON, TINY, export_hf, python, run_command, train, weights
from trainer import hf, models
from trainer.config import (
    Config,
    ConfigError,
    resolve,
)
from trainer.models.transformer import hf as transformer_hf
from trainer.models.transformer import net

SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def hf_llama(folder, tied: bool = False, scaling: dict | None = SCALING, seed: int = 0, **shards):
    """A tiny random LlamaForCausalLM (4 query heads over 2 key/value heads), saved to `folder`."""
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=dict(scaling) if scaling else None,  # a copy: LlamaConfig adds to it
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # the norms start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **shards)
    return model


def our_model(folder, seq_len: int = 64) -> torch.nn.Module:
    cfg = Config(model=models.ModelArgs(init_from=str(folder), seq_len=seq_len))
    args = resolve(cfg).model
    model = models.build(args)
    hf.load_weights(model, str(folder), args)
    return model.eval()


TOKENS = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "tied, scaling",
    [(False, SCALING), (True, SCALING), (False, None)],
    ids=["untied-llama3_rope", "tied-llama3_rope", "untied-plain_rope"],
)
def test_init_from_gives_hf_logits(tmp_path, tied, scaling):
    reference = hf_llama(tmp_path, tied=tied, scaling=scaling)
    ours = our_model(tmp_path)
    assert (ours.output is None) == tied
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), reference(TOKENS).logits, atol=2e-5, rtol=1e-5)


def test_rope_scaling_matters_here(tmp_path):
    """The comparisons above can see the scaling: without it the logits differ by far more than their tolerance."""
    reference = hf_llama(tmp_path)
    cfg = Config(
        model=models.ModelArgs(init_from=str(tmp_path), seq_len=64, rope_scaling=models.RopeScaling(rope_type="none"))
    )
    with pytest.raises(ConfigError, match="model.rope_scaling is .* but .*config.json says"):
        resolve(cfg)
    args = resolve(Config(model=models.ModelArgs(init_from=str(tmp_path), seq_len=64))).model
    unscaled = models.build(
        models.resolve(models.ModelArgs(**{**args.__dict__, "rope_scaling": models.RopeScaling(rope_type="none")}))
    )
    hf.load_weights(unscaled, str(tmp_path), args)
    with torch.no_grad():
        assert (unscaled(TOKENS) - reference(TOKENS).logits).abs().max() > 25 * 2e-5


def test_shape_comes_from_config_json_and_conflicts_name_the_key(tmp_path):
    hf_llama(tmp_path)
    args = resolve(Config(model=models.ModelArgs(init_from=str(tmp_path)))).model
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size) == (
        32,
        2,
        4,
        2,
        80,
        96,
    )
    assert args.rope_scaling == models.RopeScaling(factor=4.0, original_max_position_embeddings=16)
    assert args.max_position_embeddings == 128
    with pytest.raises(
        ConfigError, match=r"model.init_from: model.n_heads is 8 but .*config.json says 4; remove model.n_heads"
    ):
        resolve(Config(model=models.ModelArgs(init_from=str(tmp_path), n_heads=8)))
    with pytest.raises(
        ConfigError, match="nowhere is not a folder; model.init_from needs a local Hugging Face model folder"
    ):
        resolve(Config(model=models.ModelArgs(init_from=str(tmp_path / "nowhere"))))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json not found; model.init_from needs a Hugging Face folder"):
        resolve(Config(model=models.ModelArgs(init_from=str(tmp_path))))


def test_8b_is_llama_3_1_8b():
    shape = models.transformer_shape(models.ModelArgs(size="8b"))
    assert shape.rope_theta == 500000.0
    assert shape.rope_scaling == models.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert (shape.dim, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.ffn_dim, shape.vocab_size) == (
        4096,
        32,
        32,
        8,
        14336,
        128256,
    )
    config = transformers.LlamaConfig(
        **{
            k: v
            for k, v in transformer_hf.config_for(shape, 131072, torch.bfloat16).items()
            if k not in ("architectures", "model_type")
        }
    )
    # HF computes the same RoPE frequencies from the config we write for it
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(net.rope_frequencies(128, 500000.0, shape.rope_scaling), inv_freq.float())


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
    ids=["1", "2", "3", "2-replicated-act_ckpt"],
)
def test_init_from_loads_the_same_weights_on_any_number_of_processes(tmp_path, sharded_llama, nproc, overrides):
    """3 processes shard 16 key/value rows, 80 FFN rows and 96 vocabulary rows unevenly; hybrid
    sharding with groups of 1 replicates (a 2-D mesh), activation checkpointing renames modules."""
    train(tmp_path, nproc, *UNCHANGED, *overrides, f"model.init_from={sharded_llama}")
    got, expected = weights(tmp_path), hf_state(sharded_llama)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


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


def test_a_config_json_whose_weights_cannot_fit_is_refused_before_anything_is_allocated(tmp_path):
    """Issue 41 item 10: a config.json with vocab_size (or hidden_size) 2**40 passed every check (the
    memory check reads the config before model.init_from's shape is applied) and crashed rank 0
    with `Unable to allocate 32.0 TiB`. It is refused when the shape is read, naming the keys."""
    import resource

    changed = tmp_path / "hf"
    hf_llama(changed)
    config = json.loads((changed / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size"):
        (changed / "config.json").write_text(json.dumps({**config, key: 2**40}))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(ConfigError) as e:
            resolve(Config(model=models.ModelArgs(init_from=str(changed))))
        assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 64  # MB: nothing allocated
        said = str(e.value)
        assert said.startswith(f"config: model.init_from: {changed}/config.json: ") and "\n" not in said, said
        assert re.search(
            r"_size = [\d,]+ x [\d,]+ makes one weight of [\d,.]+ GB in float32, more than this machine's", said
        )
        assert key in said and said.endswith("is this the model's own config.json?")


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
