"""Hugging Face Llama folders, read and written: the parameter names and the folder format.

A folder holds `config.json` (a LlamaConfig) and the weights as safetensors: one
`model.safetensors`, or shards `model-00001-of-00003.safetensors`, ... listed in
`model.safetensors.index.json`. Reading and writing need `safetensors` and JSON only.

Our transformer is HF's LlamaForCausalLM with other names. Our RoPE rotates the two halves of each
head (x[:d/2] against x[d/2:]), HF's `rotate_half` convention, so q_proj and k_proj map unchanged:
the permutation HF's converter applies is for Meta's original checkpoints, which rotate interleaved
pairs, and HF folders already hold its result.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import re
import shutil
from typing import TYPE_CHECKING

from trainer.models import ModelArgs, RopeScaling, TransformerShape, transformer_shape

if TYPE_CHECKING:
    import torch

log = logging.getLogger("trainer")

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# What an export takes over from the folder the run started from (model.init_from), where it is
# still there, so that generation and evaluation (vLLM, lm-eval) find the tokenizer and its ids.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

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
}
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Buffers some HF folders hold that are not weights (older transformers saved the RoPE frequencies).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class HFError(Exception):
    """An HF folder that cannot be used; the message names the file and what to do."""


def init_args(args: ModelArgs) -> ModelArgs:
    """`args` with the shape of model.init_from's config.json (keys `args` sets must agree), the
    folder's weights index and headers read before anything starts (HFError otherwise); `args`
    as they are without init_from or for a family that takes no Hugging Face folder."""
    from trainer.models import find

    family = find(args.name)
    if not args.init_from or family is None or family.hf_args is None:
        return args
    args = family.hf_args(args.init_from, args)
    weight_files(args.init_from)
    return args


def hf_name(name: str) -> str:
    """HF's name of one of our transformer's parameters."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    if name in _TOP:
        return _TOP[name]
    match = _OUR_LAYER.fullmatch(name)
    if not match or match.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"


# -- config.json ----------------------------------------------------------------------------------


def read_config(folder: str) -> dict:
    if not os.path.isdir(folder):
        raise HFError(f"{folder} is not a folder; model.init_from needs a local Hugging Face model folder")
    path = os.path.join(folder, CONFIG)
    if not os.path.lexists(path):
        raise HFError(
            f"{path} not found; model.init_from needs a Hugging Face folder with config.json and *.safetensors"
        )
    path = _inside(folder, CONFIG)
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise HFError(f"{path} is not readable JSON ({e}); replace it with the model's config.json") from None
    if not isinstance(config, dict):
        raise HFError(
            f"{path}: holds a JSON {type(config).__name__}, not a mapping of settings; replace it with the "
            f"model's config.json"
        )
    return config


def _whole(config: dict, key: str, where: str) -> int:
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HFError(f"{where}: {key} is {value!r}; it must be a whole number of at least 1")
    return value


def _number(config: dict, key: str, where: str, default: float) -> float:
    value = config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise HFError(f"{where}: {key} is {value!r}; it must be a number")
    return float(value)


def _flag(config: dict, key: str, where: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):  # bool("false") is True: a string must not pass as a flag
        raise HFError(f"{where}: {key} is {value!r}; it must be true or false")
    return value


def shape_from_config(config: dict, where: str) -> dict:
    """ModelArgs shape keys (and max_position_embeddings) from a LlamaConfig mapping; a value of the
    wrong type or range is an HFError naming the key (the shape itself is checked by trainer.check)."""

    def need(key):
        if key not in config:
            raise HFError(f"{where}: '{key}' is missing; is this a Llama config.json?")
        return _whole(config, key, where)

    def optional(key):
        return None if config.get(key) is None else _whole(config, key, where)

    if config.get("model_type", "llama") != "llama":
        raise HFError(
            f"{where}: model_type is {config['model_type']!r}; only Llama models (model_type llama) can be loaded"
        )
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, expected) != expected:
            raise HFError(f"{where}: {key} is {config[key]!r}; this trainer's Llama supports only {expected!r}")
    dim, heads = need("hidden_size"), need("num_attention_heads")
    if config.get("head_dim") not in (None, dim // heads):
        raise HFError(
            f"{where}: head_dim is {config['head_dim']}, not hidden_size / num_attention_heads = {dim // heads}; "
            f"this trainer's Llama supports only that"
        )
    # transformers 5 writes rope_parameters (theta included); earlier ones rope_theta and rope_scaling
    rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise HFError(f"{where}: {rope_key} is {rope!r}; it must be a mapping, or null")
    theta = _number(rope, "rope_theta", where, _number(config, "rope_theta", where, 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        fields = [f.name for f in dataclasses.fields(RopeScaling) if f.name != "rope_type"]
        missing = [k for k in fields if k not in rope]
        if missing:
            raise HFError(f"{where}: rope_scaling of type llama3 lacks {', '.join(missing)}")
        scaling = RopeScaling(**{k: type(getattr(RopeScaling, k))(_number(rope, k, where, 0.0)) for k in fields})
    elif rope_type == "default":
        scaling = RopeScaling(rope_type="none")
    else:
        raise HFError(f"{where}: rope type {rope_type!r} is not supported; only llama3 scaling or none")
    return {
        "vocab_size": need("vocab_size"),
        "dim": dim,
        "n_layers": need("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": optional("num_key_value_heads") or heads,
        "ffn_dim": need("intermediate_size"),
        "norm_eps": _number(config, "rms_norm_eps", where, 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_embeddings": _flag(config, "tie_word_embeddings", where, False),
        "max_position_embeddings": optional("max_position_embeddings"),
    }


def model_args(folder: str, args: ModelArgs) -> ModelArgs:
    """`args` with the shape of the HF model in `folder`. A shape key the config sets (not None) must
    agree with config.json: the first that differs is an HFError naming both values."""
    where = os.path.join(folder, CONFIG)
    found = shape_from_config(read_config(folder), where)
    for key, value in found.items():
        mine = getattr(args, key)
        if key == "rope_scaling" and mine is not None and value is not None:
            same = mine == value or mine.rope_type == value.rope_type == "none"
        else:
            same = mine is None or value is None or mine == value
        if not same:
            raise HFError(
                f"model.{key} is {mine!r} but {where} says {value!r}; remove model.{key} (the shape "
                f"comes from model.init_from) or start from another folder"
            )
    return dataclasses.replace(args, **{k: v for k, v in found.items() if v is not None})


def config_for(shape: TransformerShape, max_position_embeddings: int, dtype: torch.dtype) -> dict:
    """The LlamaConfig mapping of our transformer."""
    scaling = shape.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "num_hidden_layers": shape.n_layers,
        "head_dim": shape.dim // shape.n_heads,
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


# -- weights --------------------------------------------------------------------------------------


def _roots(folder: str) -> list[str]:
    """Where the files of `folder` may really lie: in it, and for a hub cache snapshot
    (<cache>/models--org--name/snapshots/<revision>, links into that repository's blobs/) in blobs/."""
    real = os.path.realpath(folder)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        blobs = os.path.join(os.path.dirname(os.path.dirname(real)), "blobs")
        if os.path.isdir(blobs) and not os.path.islink(blobs):
            roots.append(blobs)
    return roots


def _inside(folder: str, name: str, index: str | None = None) -> str:
    """The path of the file `name` in `folder`, where it stays inside it: an HFError for a name that
    leads out (`index` names the file that gave it), a link leading out (the folder's files are
    read as they are, never through a link to elsewhere), a missing file or one that is not regular."""
    path = os.path.normpath(os.path.join(folder, name))  # an absolute name replaces the folder
    if index is not None and os.path.relpath(path, folder).split(os.sep)[0] == os.pardir:
        raise HFError(f"{index} names {name!r}, outside {folder}; an index may name only files in its own folder")
    real = os.path.realpath(path)
    if not any(os.path.relpath(real, root).split(os.sep)[0] != os.pardir for root in _roots(folder)):
        raise HFError(
            f"{path} is a link to {real}, outside {folder}; copy the file itself into the folder "
            f"(hf download --local-dir makes such a folder)"
        )
    if not os.path.lexists(path):
        raise HFError(f"{index} names {name!r}, which {folder} lacks; download the whole model folder again")
    if not os.path.isfile(path):
        raise HFError(f"{path} is not a regular file; replace it with the model's {name}")
    return path


def weight_files(folder: str) -> dict[str, str]:
    """HF parameter name -> the safetensors file in `folder` that holds it. Every file is opened and
    its header checked (a file cut short is found here); no tensor is read."""
    index = os.path.join(folder, INDEX)
    if os.path.lexists(index):
        index = _inside(folder, INDEX)
        try:
            with open(index) as f:
                weight_map = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise HFError(f"{index} is not readable JSON ({e}); replace it with the model's {INDEX}") from None
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFError(
                f"{index} has no weight_map of parameter names to file names; replace it with the model's {INDEX}"
            )
        files = {name: _inside(folder, file, index) for name, file in weight_map.items()}
    else:
        files = {}
        for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors"))):
            files.update((name, path) for name in _header(_inside(folder, os.path.basename(path))))
        if not files:
            raise HFError(
                f"{folder} holds no *.safetensors file; model.init_from needs the weights in safetensors format"
            )
        return files
    for path in set(files.values()):
        _header(path)
    return files


def _header(path: str) -> list[str]:
    """The tensor names of the safetensors file at `path`; an HFError where its header is unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:  # only the header is read: no torch needed
            return list(f.keys())
    except (OSError, SafetensorError) as e:
        raise HFError(
            f"{path} is not a readable safetensors file ({e}); download it again, it may be cut short"
        ) from None


def load_weights(model: torch.nn.Module, folder: str) -> None:
    """Copy the weights of the HF folder into `model`, whose parameters may be FSDP-sharded DTensors.

    Each rank reads only the rows of its own shard of each tensor (safetensors slices), file by
    file, so no rank ever holds the full model."""
    import torch
    from safetensors import safe_open

    files = weight_files(folder)
    params = dict(model.named_parameters())
    wanted = {hf_name(name): name for name in params}
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise HFError(
            f"{folder} lacks weight {missing[0]!r} ({len(missing)} missing); is config.json the one of these weights?"
        )
    unexpected = sorted(
        n
        for n in set(files) - set(wanted)
        if not _IGNORED.fullmatch(n) and not (n == "lm_head.weight" and "output.weight" not in params)
    )  # tied: a copy
    if unexpected:
        raise HFError(
            f"{folder} has weight {unexpected[0]!r} that the model lacks ({len(unexpected)} in all); "
            f"is config.json the one of these weights?"
        )
    by_file: dict[str, list[str]] = {}
    for hf in wanted:
        by_file.setdefault(files[hf], []).append(hf)
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt") as f, torch.no_grad():
            for hf in names:
                param = params[wanted[hf]]
                source = f.get_slice(hf)
                if list(source.get_shape()) != list(param.shape):
                    raise HFError(
                        f"{file}: {hf} has shape {source.get_shape()} but the model's is {list(param.shape)}; "
                        f"is config.json the one of these weights?"
                    )
                local, region = _local_region(param)
                if local.numel():
                    local.copy_(source[region])


def _local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the tensor this rank holds, the slice of the full tensor it holds) of a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    from trainer.torch_compat import local_shape_and_offset

    shape, offset = local_shape_and_offset(param)
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def parse_size(text: str) -> int:
    """Bytes of a size such as 5GB, 500MB, 10KB or 1234 (decimal units, as Hugging Face's)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r}: give a number of bytes, optionally with KB, MB or GB (e.g. 5GB)")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(match.group(1)) * scale)


def save(
    state: dict[str, torch.Tensor], args: ModelArgs, out: str, max_shard_bytes: int, dtype: torch.dtype | None = None
) -> list[str]:
    """Write our full state dict as an HF folder; returns the files written. Tensors go into shards
    of at most `max_shard_bytes` (a larger tensor gets one of its own), listed in an index file when
    there is more than one, as `save_pretrained` does. A run that started from an HF folder that is
    still there passes on its tokenizer files and special token ids."""
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.float32
    shape = transformer_shape(args)
    tensors = {hf_name(k): v.to(dtype).contiguous() for k, v in state.items()}  # tied: no lm_head, as HF
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    os.makedirs(out, exist_ok=True)
    for stale in glob.glob(os.path.join(out, "model*.safetensors")) + glob.glob(os.path.join(out, INDEX)):
        os.remove(stale)  # an earlier export's shards would be read as weights too
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
        }
        with open(os.path.join(out, INDEX), "w") as f:
            json.dump(index, f, indent=2)
        names.append(INDEX)
    config = config_for(shape, args.max_position_embeddings or args.seq_len, dtype)
    copied = []
    source = args.init_from
    if source and os.path.isfile(os.path.join(source, CONFIG)):
        try:  # read as model.init_from reads it: nothing through a link that leads out of the folder
            config.update({k: v for k, v in read_config(source).items() if k in TOKEN_ID_KEYS})
            for name in TOKENIZER_FILES:
                if os.path.lexists(os.path.join(source, name)):
                    shutil.copyfile(_inside(source, name), os.path.join(out, name))
                    copied.append(name)
        except HFError as e:
            log.warning("%s; the export lacks some of its tokenizer files or token ids", e)
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return [CONFIG, *names, *copied]
