"""The Llama-shaped Hugging Face architectures besides Llama, both ways, checked against `transformers`
itself: a tiny random Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k norms, a head size of its own)
gives the same logits in our transformer after `model.init_from`, and what we write back loads with
`AutoModelForCausalLM.from_pretrained` as the same architecture with the same logits. Nothing is
downloaded: every model is made here."""

import json
import os

import pytest
import torch

from trainer import hf, models
from trainer.config import Config, ConfigError, resolve
from trainer.models.transformer import hf as transformer_hf

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded (set before transformers is imported)
transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
)
ARCHITECTURES = {
    "mistral": lambda **kw: transformers.MistralConfig(**{**COMMON, "sliding_window": None, **kw}),
    "qwen2": lambda **kw: transformers.Qwen2Config(**{**COMMON, **kw}),
    # head_dim 16 with hidden_size 32 over 4 heads: Qwen3's heads need not split hidden_size
    "qwen3": lambda **kw: transformers.Qwen3Config(**{**COMMON, "head_dim": 16, **kw}),
}
TOKENS = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(1))


def hf_model(folder, model_type: str, seed: int = 0, tied: bool = False, **config):
    """A tiny random model of `model_type` saved to `folder`; every norm and bias random, so that each matters."""
    cfg = ARCHITECTURES[model_type](tie_word_embeddings=tied, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


def ours(folder, seq_len: int = 64):
    args = resolve(Config(model=models.ModelArgs(init_from=str(folder), seq_len=seq_len))).model
    model = models.build(args)
    hf.load_weights(model, str(folder), args)
    return model.eval(), args


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_init_from_gives_hf_logits_and_export_gives_them_back(tmp_path, model_type, tied):
    reference = hf_model(tmp_path / "start", model_type, tied=tied)
    model, args = ours(tmp_path / "start")
    assert args.hf_type == model_type
    assert (args.qkv_bias, args.qk_norm) == (model_type == "qwen2", model_type == "qwen3")
    assert args.head_dim == (16 if model_type == "qwen3" else None)
    with torch.no_grad():
        expected = reference(TOKENS).logits
        torch.testing.assert_close(model(TOKENS), expected, atol=2e-5, rtol=1e-5)

    # written back (as export --format hf writes it): the same architecture, the same logits
    written = hf.save(model.state_dict(), args, str(tmp_path / "out"), 30_000)
    assert hf.INDEX in written  # in shards
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == model_type and config["architectures"] == [transformer_hf.ARCHITECTURES[model_type]]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(reference)
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, expected, atol=2e-5, rtol=1e-5)


def test_the_options_matter_here(tmp_path):
    """The comparisons above can see the biases and the q/k norms: without them the logits differ by far more."""
    for model_type, option in (("qwen2", "qkv_bias"), ("qwen3", "qk_norm")):
        reference = hf_model(tmp_path / model_type, model_type)
        model, args = ours(tmp_path / model_type)
        without = models.build(models.resolve(models.ModelArgs(**{**args.__dict__, option: False, "hf_type": None})))
        state = {k: v for k, v in model.state_dict().items() if k in without.state_dict()}
        without.load_state_dict(state)
        with torch.no_grad():
            assert (without(TOKENS) - reference(TOKENS).logits).abs().max() > 100 * 2e-5, option


def test_the_default_transformer_is_todays_llama():
    """The new options' defaults build the Llama of before: the same parameter names and shapes."""
    model = models.build(models.resolve(models.ModelArgs()))
    names = {k for k in model.state_dict() if k.startswith("layers.0.")}
    assert names == {f"layers.0.{k}" for k in list(transformer_hf._LAYER)[:9]}
    assert transformer_hf.model_type(models.transformer_shape(models.ModelArgs())) == "llama"


def refused(folder, **model) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(Config(model=models.ModelArgs(init_from=str(folder), **model)))
    return str(e.value)


def test_a_sliding_window_shorter_than_seq_len_is_refused(tmp_path):
    """Our attention is full causal attention: it equals a sliding window's where seq_len fits in the
    window (a Mistral v0.1's 4096), and is refused where it does not."""
    hf_model(tmp_path / "mistral", "mistral", sliding_window=32)
    assert refused(tmp_path / "mistral", seq_len=64) == (
        f"config: model.init_from: {tmp_path}/mistral/config.json: sliding_window is 32 tokens, shorter than "
        f"model.seq_len=64; the transformer attends to the whole sequence: set model.seq_len to at most 32"
    )
    reference = hf_model(tmp_path / "fits", "mistral", sliding_window=64)
    model, _ = ours(tmp_path / "fits", seq_len=64)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference(TOKENS).logits, atol=2e-5, rtol=1e-5)
    # Qwen's window applies only with use_sliding_window
    hf_model(tmp_path / "qwen", "qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=0)
    assert "sliding_window is 32 tokens, shorter than model.seq_len=64" in refused(tmp_path / "qwen", seq_len=64)
    hf_model(tmp_path / "qwen_off", "qwen2", use_sliding_window=False, sliding_window=32)
    ours(tmp_path / "qwen_off", seq_len=64)
    # on, but from layer 2 of 2 on: no layer slides, and the logits are the full attention's
    reference = hf_model(
        tmp_path / "qwen_none", "qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2
    )
    assert "sliding_attention" not in json.loads((tmp_path / "qwen_none" / "config.json").read_text())["layer_types"]
    model, _ = ours(tmp_path / "qwen_none", seq_len=64)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference(TOKENS).logits, atol=2e-5, rtol=1e-5)


def test_an_unknown_architecture_is_one_line_naming_the_supported_ones(tmp_path):
    hf_model(tmp_path, "qwen2")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    assert refused(tmp_path) == (
        f"config: model.init_from: {tmp_path}/config.json: model_type is 'gemma3'; the transformer loads "
        f"llama, mistral, qwen2, qwen3 models only"
    )
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3", "attention_bias": True}))
    assert refused(tmp_path) == (
        f"config: model.init_from: {tmp_path}/config.json: attention_bias is True; this trainer's qwen3 "
        f"supports only False"
    )


def test_an_architecture_the_options_do_not_make_is_refused_before_the_run():
    from trainer.config import load
    from trainer.preflight.check import validate

    with pytest.raises(ConfigError) as e:
        validate(load(None, ["model.hf_type=qwen2"]), 1)
    assert str(e.value) == (
        "config: model.hf_type: is 'qwen2' but model.qkv_bias=False and model.qk_norm=False: Qwen2ForCausalLM "
        "has q/k/v biases and no q/k norms; set them so, or choose another model.hf_type"
    )
    with pytest.raises(ConfigError, match="model.hf_type: is 'gemma3'; choose one of llama, mistral, qwen2, qwen3"):
        validate(load(None, ["model.hf_type=gemma3"]), 1)
    assert validate(load(None, ["model.hf_type=qwen3", "model.qk_norm=true", "model.head_dim=8"]), 1) == []
