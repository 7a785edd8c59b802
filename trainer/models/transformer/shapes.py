"""The transformer's shapes: a TransformerShape, the named sizes, RoPE scaling, and the shape a model
section asks for. The spec (transformer.py), its network (transformer_net.py) and its Hugging Face
adapter (transformer_hf.py) all read them from here; this module imports nothing of the trainer, and
no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from trainer.models import ModelArgs


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (Hugging Face `rope_scaling` with `rope_type: llama3`):
    wavelengths longer than the original context are stretched by `factor`, short ones kept, those
    in between blended. The defaults are Llama 3.1's."""

    rope_type: Literal["llama3", "none"] = "llama3"  # none: no scaling (also on a size that has it)
    factor: float = 8.0  # how much longer the long wavelengths become
    low_freq_factor: float = 1.0  # wavelengths above original_max_position_embeddings / this are scaled fully
    high_freq_factor: float = 4.0  # wavelengths below original_max_position_embeddings / this are not scaled
    original_max_position_embeddings: int = 8192  # context length in tokens the model was pretrained with


@dataclass(frozen=True)
class TransformerShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    head_dim: int | None = None  # None: dim // n_heads
    qkv_bias: bool = False
    qk_norm: bool = False


# The ModelArgs keys that make up a TransformerShape.
SHAPE_KEYS = tuple(f.name for f in dataclasses.fields(TransformerShape))

TRANSFORMER_SIZES = {
    "tiny": TransformerShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=192, vocab_size=256),
    "small": TransformerShape(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096),
    "125m": TransformerShape(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000),
    "1b": TransformerShape(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=32000),
    # Llama-3.1-8B in full: its shape, vocabulary, RoPE base and RoPE scaling.
    "8b": TransformerShape(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(),
    ),
}


def transformer_shape(args: ModelArgs) -> TransformerShape:
    """The size's shape with every shape key the config sets in place of the size's value."""
    shape = TRANSFORMER_SIZES[args.size]
    return dataclasses.replace(shape, **{k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None})
