"""The models: the tutorials' MNIST CNN, a decoder-only transformer LM, and torchvision classifiers.

Each model exposes `blocks()`: the repeated units that per-block wrapping, activation checkpointing
and compilation act on.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F


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


@dataclass
class ModelArgs:
    name: str = "transformer"  # mnist_cnn, transformer, or a torchvision classification model name
    size: str = "tiny"  # transformer size: one of TRANSFORMER_SIZES; the keys below set each part of it
    # A local Hugging Face Llama folder (config.json + *.safetensors) a new run starts from: its
    # config.json gives the transformer's shape (keys set here must agree), its weights the first
    # step's. Once run_dir has checkpoints of its own, they win.
    init_from: str | None = None
    # The transformer's shape. None: the size's value (with init_from: config.json's), written into
    # the run's config.yaml resolved.
    vocab_size: int | None = None  # vocabulary, in tokens
    dim: int | None = None  # hidden size (HF hidden_size)
    n_layers: int | None = None  # transformer blocks
    n_heads: int | None = None  # query heads; must divide dim
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); must divide n_heads
    ffn_dim: int | None = None  # SwiGLU hidden size (HF intermediate_size)
    norm_eps: float | None = None  # RMSNorm epsilon
    rope_theta: float | None = None  # RoPE base period (10000 for Llama 2, 500000 for Llama 3)
    rope_scaling: RopeScaling | None = None  # Llama 3 RoPE scaling; rope_type none turns a size's off
    tie_embeddings: bool | None = None  # the output head is the token embedding matrix (Llama 3.2 1B/3B)
    # Context length in tokens an HF export advertises (its max_position_embeddings); None: seq_len,
    # with init_from: config.json's (a model trained on shorter sequences keeps its long context).
    max_position_embeddings: int | None = None
    seq_len: int = 128  # transformer context length in tokens
    num_classes: int = 10  # classes of the image classifiers
    image_size: int = 224  # side in pixels that torchvision models see (MNIST is always 28)
    dropout: float = 0.0  # MNIST CNN dropout after the convolutions, in [0, 0.5); after fc1 twice it (tutorial: 0.25)


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


# The ModelArgs keys that make up a TransformerShape.
SHAPE_KEYS = tuple(f.name for f in dataclasses.fields(TransformerShape))

TRANSFORMER_SIZES = {
    "tiny": TransformerShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=192, vocab_size=256),
    "small": TransformerShape(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096),
    "125m": TransformerShape(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000),
    "1b": TransformerShape(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=32000),
    # Llama-3.1-8B in full: its shape, vocabulary, RoPE base and RoPE scaling.
    "8b": TransformerShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                           rope_theta=500000.0, rope_scaling=RopeScaling()),
}


# ---------------------------------------------------------------------------------------------------
# MNIST CNN (the FSDP tutorial's network)


class MnistCNN(nn.Module):
    def __init__(self, num_classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(2 * dropout)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)

    def blocks(self) -> list[nn.Module]:
        return [self.conv1, self.conv2, self.fc1, self.fc2]


# ---------------------------------------------------------------------------------------------------
# Transformer LM: pre-norm blocks with RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Angular frequency of each rotated pair, Llama 3 scaling applied (as HF's `llama3` rope type)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None or scaling.rope_type == "none":
        return freqs
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, freqs / scaling.factor, freqs)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
    return torch.where(medium, blended, scaled)


def rope_tables(head_dim: int, seq_len: int, theta: float = 10000.0,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (x1, x2) of the two halves.
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, s: TransformerShape):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, s.dim // s.n_heads
        self.wq = nn.Linear(s.dim, s.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.n_heads * self.head_dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Grouped-query attention without copying k and v per query head (less memory; on an H200 the
        # attention alone ran 10% faster).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, s: TransformerShape):
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.ffn_dim, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn_dim, bias=False)
        self.w2 = nn.Linear(s.ffn_dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, s: TransformerShape):
        super().__init__()
        self.attention_norm = nn.RMSNorm(s.dim, eps=s.norm_eps)
        self.attention = Attention(s)
        self.ffn_norm = nn.RMSNorm(s.dim, eps=s.norm_eps)
        self.feed_forward = FeedForward(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, shape: TransformerShape, seq_len: int):
        super().__init__()
        self.shape, self.seq_len = shape, seq_len
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        # Tied: the head reads the embedding matrix itself. Sharing one Parameter between two modules
        # would not survive to_empty (the meta-device start) outside FSDP.
        self.output = None if shape.tie_embeddings else nn.Linear(shape.dim, shape.vocab_size, bias=False)
        cos, sin = self._rope_tables()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h)
        return self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        return rope_tables(s.dim // s.n_heads, self.seq_len, s.rope_theta, s.rope_scaling)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def init_weights(self, seed: int) -> None:
        """Deterministic initialisation that does not depend on how the parameters are sharded.

        Every parameter is drawn in full on the CPU from a generator seeded by (seed, its name), and
        each rank copies in its own shard. So 1 process and N processes start from the same weights,
        and the model can be built on the meta device (no full copy per rank) and sharded first.
        """
        cos, sin = self._rope_tables()
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        out_std = 0.02 / math.sqrt(2 * self.shape.n_layers)
        for name, param in self.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "")  # the same seed under wrappers
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.empty(param.shape, dtype=torch.float32)
            if "norm" in name:
                full.fill_(1.0)
            else:
                std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                full.normal_(0.0, std, generator=generator)
            _copy_full_into(param, full)

    def num_params(self, exclude_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6·N (forward+backward matmuls) plus the attention scores term.
        N excludes the embedding lookup but not the output head, which a tied head still computes."""
        s = self.shape
        head = s.vocab_size * s.dim if s.tie_embeddings else 0  # otherwise already in num_params()
        return 6 * (self.num_params() + head) + 12 * s.n_layers * s.dim * self.seq_len


@torch.no_grad()
def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter that may be a sharded DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


# ---------------------------------------------------------------------------------------------------


def build(args: ModelArgs) -> nn.Module:
    """Build the model on the current default device (the caller may choose 'meta')."""
    if args.name == "mnist_cnn":
        return MnistCNN(args.num_classes, args.dropout)
    if args.name == "transformer":
        shape = transformer_shape(args)
        return Transformer(shape, args.seq_len)
    import torchvision  # imported here: only image models need it

    return torchvision.models.get_model(args.name, num_classes=args.num_classes, **torchvision_options(args))


def torchvision_options(args: ModelArgs) -> dict:
    """What some torchvision models must be told to train here: a ViT is built for one input side
    (its position embeddings), GoogLeNet and Inception v3 return auxiliary logits in a tuple unless
    told not to (the trainer's loss takes one tensor)."""
    if args.name.startswith("vit_"):
        return {"image_size": args.image_size}
    if args.name in ("googlenet", "inception_v3"):
        return {"aux_logits": False, "init_weights": True}
    return {}


def torchvision_problem(args: ModelArgs) -> str | None:
    """Why a torchvision model cannot train at model.image_size, or None."""
    if args.name.startswith("vit_"):
        patch = int(args.name.rsplit("_", 1)[1])
        if args.image_size % patch:
            return (f"{args.name} cuts images into {patch}x{patch} patches, but model.image_size={args.image_size} is "
                    f"not a multiple of {patch}; use e.g. {max(patch, args.image_size // patch * patch)}")
    if args.name == "inception_v3" and args.image_size < 75:
        return f"inception_v3 needs images of at least 75x75 pixels (model.image_size={args.image_size}); use 75 or more (299 is its usual size)"
    if args.name == "maxvit_t" and args.image_size % 32:
        return f"maxvit_t needs model.image_size to be a multiple of 32 (it is {args.image_size}); use e.g. 224"
    return None


def transformer_shape(args: ModelArgs) -> TransformerShape:
    """The size's shape with every shape key the config sets in place of the size's value."""
    shape = TRANSFORMER_SIZES[args.size]
    return dataclasses.replace(shape, **{k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None})


def resolve(args: ModelArgs) -> ModelArgs:
    """`args` with the transformer's shape keys spelled out (what the run's config.yaml records)."""
    if args.name != "transformer":
        return args
    shape = transformer_shape(args)
    return dataclasses.replace(args, **{k: getattr(shape, k) for k in SHAPE_KEYS})


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units of a model: transformer layers, ResNet bottlenecks, ViT encoder blocks, ...

    Our models say it themselves. For torchvision models it is every instance of the module class
    that repeats most often (not nested in another instance of it); ties go to the larger class.
    """
    if hasattr(model, "blocks"):
        return model.blocks()
    by_class: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        if module is model or isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        if next(module.children(), None) is None or not any(True for _ in module.parameters()):
            continue  # leaves (conv, linear, norm) are not blocks
        by_class.setdefault(type(module), []).append(module)
    candidates = [mods for mods in by_class.values() if len(mods) >= 2]
    if not candidates:
        return []

    def weight(mods):
        return len(mods), sum(p.numel() for m in mods for p in m.parameters())

    chosen = max(candidates, key=weight)
    inner = {id(sub) for m in chosen for sub in m.modules() if sub is not m}
    return [m for m in chosen if id(m) not in inner]


def torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over samples (over tokens for the LM)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())
