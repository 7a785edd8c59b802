"""The transformer family's Hugging Face adapter: the Llama-shaped architectures as config.json
mappings and parameter names. trainer/hf.py reads and writes the folders and asks the family for this.

Our transformer is HF's LlamaForCausalLM with other names, and with its options each of the
Llama-shaped ones people fine-tune: Mistral (Llama's layout; a sliding window, refused where it
would matter), Qwen2/Qwen2.5 (biases on q, k and v: qkv_bias) and Qwen3 (an RMSNorm over each
head of q and k: qk_norm; head_dim of its own). Our RoPE rotates the two halves of each head
(x[:d/2] against x[d/2:]), HF's `rotate_half` convention, so q_proj and k_proj map unchanged: the
permutation HF's converter applies is for Meta's original checkpoints, which rotate interleaved
pairs, and HF folders already hold its result.

Pure functions of mappings and names, no file read here and no torch: each raises ValueError with
the line for the user (naming the config.json given as `where`), which trainer/hf.py passes on.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING

from trainer.models.family import HFAdapter
from trainer.models.transformer.shapes import RopeScaling, TransformerShape, transformer_shape

if TYPE_CHECKING:
    import torch

    from trainer.models import ModelArgs

# model_type -> the architecture class transformers loads it with.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # qkv_bias (Qwen2)
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    # qk_norm (Qwen3)
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Buffers some HF folders hold that are not weights (older transformers saved the RoPE frequencies).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# What an export takes over from model.init_from's config.json where it is of the same model_type:
# the attention window the model was made with (the run trained within it; see _window).
_KEPT = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")


def hf_name(name: str) -> str:
    """HF's name of one of our transformer's parameters."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    if name in _TOP:
        return _TOP[name]
    match = _OUR_LAYER.fullmatch(name)
    if not match or match.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"


def ignored(name: str, ours: set[str]) -> bool:
    """Whether the folder's tensor `name` is no weight of ours: an old RoPE buffer, or the head of
    a tied model (a copy of the embedding). `ours`: our model's parameter names."""
    return bool(_IGNORED.fullmatch(name)) or (name == "lm_head.weight" and "output.weight" not in ours)


# -- config.json ----------------------------------------------------------------------------------


def _whole(config: dict, key: str, where: str) -> int:
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} is {value!r}; it must be a whole number of at least 1")
    return value


def _number(config: dict, key: str, where: str, default: float) -> float:
    value = config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} is {value!r}; it must be a number")
    return float(value)


def _flag(config: dict, key: str, where: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):  # bool("false") is True: a string must not pass as a flag
        raise ValueError(f"{where}: {key} is {value!r}; it must be true or false")
    return value


def _window(config: dict, model_type: str, n_layers: int, where: str) -> int | None:
    """The sliding attention window in tokens the folder's model uses, or None. Mistral's applies
    to every layer; Qwen's only with use_sliding_window, to the layers layer_types names (else to
    those from max_window_layers on, as transformers reads it)."""
    qwen = model_type in ("qwen2", "qwen3")
    if model_type != "mistral" and not (qwen and _flag(config, "use_sliding_window", where, False)):
        return None
    if config.get("sliding_window") is None:
        return None
    window = _whole(config, "sliding_window", where)
    if qwen:
        layers = config.get("layer_types")
        if isinstance(layers, list):
            sliding = "sliding_attention" in layers
        else:
            first = config.get("max_window_layers", 28)  # transformers' default
            if not isinstance(first, int) or isinstance(first, bool) or first < 0:
                raise ValueError(f"{where}: max_window_layers is {first!r}; it must be a whole number")
            sliding = n_layers > first
        if not sliding:
            return None
    return window


def shape_from_config(config: dict, where: str, seq_len: int | None = None) -> dict:
    """ModelArgs shape keys (and max_position_embeddings, hf_type) from the config.json mapping of a
    Llama, Mistral, Qwen2 or Qwen3; a value of the wrong type or range, or a feature our transformer
    lacks, is a ValueError naming the key (the shape itself is checked by the config check). Our
    attention is full causal attention: a sliding window shorter than `seq_len` is refused."""

    def need(key):
        if key not in config:
            raise ValueError(f"{where}: '{key}' is missing; is this a {', '.join(ARCHITECTURES)} config.json?")
        return _whole(config, key, where)

    def optional(key):
        return None if config.get(key) is None else _whole(config, key, where)

    model_type = config.get("model_type", "llama")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{where}: model_type is {model_type!r}; the transformer loads {', '.join(ARCHITECTURES)} models only"
        )
    qkv_bias = model_type == "qwen2"  # Qwen2 always has them; attention_bias would add o_proj's too
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, expected) != expected:
            raise ValueError(
                f"{where}: {key} is {config[key]!r}; this trainer's {model_type} supports only {expected!r}"
            )
    dim, heads = need("hidden_size"), need("num_attention_heads")
    head_dim, n_layers = optional("head_dim"), need("num_hidden_layers")
    window = _window(config, model_type, n_layers, where)
    if window is not None and seq_len is not None and seq_len > window:
        raise ValueError(
            f"{where}: sliding_window is {window} tokens, shorter than model.seq_len={seq_len}; the transformer "
            f"attends to the whole sequence: set model.seq_len to at most {window}"
        )
    # transformers 5 writes rope_parameters (theta included); earlier ones rope_theta and rope_scaling
    rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: {rope_key} is {rope!r}; it must be a mapping, or null")
    theta = _number(rope, "rope_theta", where, _number(config, "rope_theta", where, 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        fields = [f.name for f in dataclasses.fields(RopeScaling) if f.name != "rope_type"]
        missing = [k for k in fields if k not in rope]
        if missing:
            raise ValueError(f"{where}: rope_scaling of type llama3 lacks {', '.join(missing)}")
        scaling = RopeScaling(**{k: type(getattr(RopeScaling, k))(_number(rope, k, where, 0.0)) for k in fields})
    elif rope_type == "default":
        scaling = RopeScaling(rope_type="none")
    else:
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported; only llama3 scaling or none")
    return {
        "vocab_size": need("vocab_size"),
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": heads,
        "n_kv_heads": optional("num_key_value_heads") or heads,
        # dim / n_heads (Llama's rule) stays None: a config.json that spells it out loads as one that does not
        "head_dim": None if head_dim in (None, dim // heads) else head_dim,
        "ffn_dim": need("intermediate_size"),
        "norm_eps": _number(config, "rms_norm_eps", where, 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_embeddings": _flag(config, "tie_word_embeddings", where, False),
        "qkv_bias": qkv_bias,
        "qk_norm": model_type == "qwen3",
        "max_position_embeddings": optional("max_position_embeddings"),
        "hf_type": model_type,
    }


def model_args(config: dict, args: ModelArgs, where: str) -> ModelArgs:
    """`args` with the shape of the config.json mapping `config` (read from `where`). A key the
    config sets (not None) must agree with config.json: the first that differs is a ValueError
    naming both values."""
    found = shape_from_config(config, where, args.seq_len)
    for key, value in found.items():
        mine = getattr(args, key)
        if key == "rope_scaling" and mine is not None and value is not None:
            same = mine == value or mine.rope_type == value.rope_type == "none"
        elif key == "head_dim" and value is None:
            same = mine in (None, found["dim"] // found["n_heads"])
        else:
            same = mine is None or value is None or mine == value
        if not same:
            raise ValueError(
                f"model.{key} is {mine!r} but {where} says {value!r}; remove model.{key} (the shape "
                f"comes from model.init_from) or start from another folder"
            )
    return dataclasses.replace(args, **{k: v for k, v in found.items() if v is not None})


def model_type(shape: TransformerShape, hf_type: str | None = None) -> str:
    """The HF model_type of a model of `shape`: `hf_type` where set (a folder's, kept), else llama,
    qwen2 with qkv_bias, qwen3 with qk_norm. A ValueError where that architecture lacks an option set."""
    found = hf_type or ("qwen3" if shape.qk_norm else "qwen2" if shape.qkv_bias else "llama")
    if found not in ARCHITECTURES:
        raise ValueError(f"model.hf_type is {found!r}; choose one of {', '.join(ARCHITECTURES)}")
    if shape.qkv_bias and shape.qk_norm:
        raise ValueError(
            "model.qkv_bias and model.qk_norm are both set: no Hugging Face architecture has both (Qwen2 has "
            "the biases, Qwen3 the norms); export with --format file"
        )
    if shape.qkv_bias != (found == "qwen2") or shape.qk_norm != (found == "qwen3"):
        raise ValueError(
            f"model.hf_type is {found!r} but model.qkv_bias={shape.qkv_bias} and model.qk_norm={shape.qk_norm}: "
            f"{ARCHITECTURES[found]} has {'' if found == 'qwen2' else 'no '}q/k/v biases and "
            f"{'' if found == 'qwen3' else 'no '}q/k norms; set them so, or choose another model.hf_type"
        )
    return found


def config_for(
    shape: TransformerShape,
    max_position_embeddings: int,
    dtype: torch.dtype,
    hf_type: str | None = None,
    source: dict | None = None,
) -> dict:
    """The config.json mapping of our transformer (model_type as `model_type` says). `source`: the
    config.json of the folder the run started from, whose attention window is kept (same model_type)."""
    found = model_type(shape, hf_type)
    scaling = shape.rope_scaling
    config = {
        "architectures": [ARCHITECTURES[found]],
        "model_type": found,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "num_hidden_layers": shape.n_layers,
        "head_dim": shape.head_dim or shape.dim // shape.n_heads,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None if scaling is None or scaling.rope_type == "none" else dataclasses.asdict(scaling),
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": shape.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if found == "qwen2":
        del config["attention_bias"], config["mlp_bias"]  # Qwen2Config has neither: its q/k/v biases are fixed
    if found in ("mistral", "qwen2", "qwen3"):
        config["sliding_window"] = None  # our attention is full causal attention
    if source and source.get("model_type") == found:
        config.update({k: source[k] for k in _KEPT if k in source})
    return config


def hf_config(args: ModelArgs, dtype: torch.dtype, source: dict | None) -> dict:
    return config_for(
        transformer_shape(args), args.max_position_embeddings or args.seq_len, dtype, args.hf_type, source
    )


ADAPTER = HFAdapter(args=model_args, config=hf_config, name=hf_name, ignored=ignored)
