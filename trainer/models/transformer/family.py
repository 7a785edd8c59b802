"""The transformer family's spec: a decoder-only LM (pre-norm blocks with RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU), Hugging Face's Llama under other names, with the options of the
Llama-shaped architectures (Qwen2's q/k/v biases, Qwen3's q/k norms and head size): its Hugging
Face adapter is transformer_hf.py.

Its config checks, resolution and `FAMILY`; its shapes and sizes are transformer_shapes.py, the
network itself transformer_net.py, imported when a model is built. This module imports no torch:
the config and its checks read it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from trainer.models.family import Family
from trainer.models.transformer import hf
from trainer.models.transformer.shapes import SHAPE_KEYS, TRANSFORMER_SIZES, transformer_shape

if TYPE_CHECKING:
    from trainer.models import ModelArgs
    from trainer.models.transformer.net import Transformer


def resolve(args: ModelArgs) -> ModelArgs:
    """`args` with the transformer's shape keys spelled out (what the run's config.yaml records)."""
    shape = transformer_shape(args)
    return dataclasses.replace(args, **{k: getattr(shape, k) for k in SHAPE_KEYS})


def build(args: ModelArgs) -> Transformer:
    from trainer.models.transformer.net import Transformer

    return Transformer(transformer_shape(args), args.seq_len)


def check(args: ModelArgs, data, fail, resolved) -> None:
    """A known size, token data, and a resolved shape that can be built."""
    if args.size not in TRANSFORMER_SIZES:
        fail("model.size", f"is {args.size!r}; choose one of {', '.join(TRANSFORMER_SIZES)}")
    if args.vocab_size is not None and args.vocab_size < 2:
        fail("model.vocab_size", f"is {args.vocab_size}; it must be at least 2")
    if data.name not in ("synthetic", "tokens"):
        fail("data.name", f"is {data.name!r} but the transformer needs token data; use synthetic or tokens")
    m = resolved()
    _check_shape(m, fail)
    try:  # an architecture the export could not write: said before the run, not after it
        if m.hf_type is not None:
            hf.model_type(transformer_shape(m), m.hf_type)
    except ValueError as e:
        fail("model.hf_type", str(e).removeprefix("model.hf_type "))


def _check_shape(m: ModelArgs, fail) -> None:
    """The resolved transformer shape must be buildable."""
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(m, key) < 1:
            fail(f"model.{key}", f"is {getattr(m, key)}; it must be at least 1")
    if m.head_dim is not None:
        if m.head_dim < 2 or m.head_dim % 2:
            fail("model.head_dim", f"is {m.head_dim}; RoPE rotates pairs: give an even number of at least 2")
    elif m.dim % m.n_heads or (m.dim // m.n_heads) % 2:
        fail(
            "model.n_heads",
            f"{m.n_heads} heads do not split model.dim={m.dim} into heads of an even size; "
            f"choose a divisor of {m.dim} that leaves an even head size",
        )
    if m.n_heads % m.n_kv_heads:
        fail("model.n_kv_heads", f"{m.n_kv_heads} does not divide model.n_heads={m.n_heads}; choose a divisor")
    for key in ("norm_eps", "rope_theta"):
        if getattr(m, key) <= 0:
            fail(f"model.{key}", f"is {getattr(m, key)}; it must be positive")
    s = m.rope_scaling
    if s is not None and s.rope_type == "llama3":
        if s.factor <= 0 or s.original_max_position_embeddings < 1:
            fail("model.rope_scaling", "factor and original_max_position_embeddings must be positive")
        if not 0 < s.low_freq_factor < s.high_freq_factor:
            fail(
                "model.rope_scaling",
                f"needs 0 < low_freq_factor < high_freq_factor (they are {s.low_freq_factor} and {s.high_freq_factor})",
            )


def tp_plan(model: Transformer, mesh) -> None:
    """Its tensor-parallel plan (transformer_tp.py), imported with torch when a plan is applied."""
    from trainer.models.transformer.tp import parallelize

    parallelize(model, mesh)


def pp_split(model: Transformer, stage: int, stages: int) -> None:
    """Its pipeline split (Transformer.pipeline_stage): n_layers / stages blocks a stage."""
    model.pipeline_stage(stage, stages)


FAMILY = Family(
    build=build,
    blocks=lambda model: model.blocks(),
    check=check,
    input_shape=lambda args: (args.seq_len,),
    kind="lm",
    resolve=resolve,
    init_weights=lambda model, seed: model.init_weights(seed),
    flops_per_token=lambda model: model.flops_per_token(),
    hf=hf.ADAPTER,
    tp_plan=tp_plan,
    pp_split=pp_split,
    pp_blocks=lambda args: transformer_shape(args).n_layers,
)
