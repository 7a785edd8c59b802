"""The transformer family's network: a decoder-only LM (pre-norm blocks with RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU), built by its spec (transformer.py) from a TransformerShape.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.models.transformer.shapes import RopeScaling, TransformerShape


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


def rope_tables(
    head_dim: int, seq_len: int, theta: float = 10000.0, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (x1, x2) of the two halves.
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


def head_size(s: TransformerShape) -> int:
    """Elements of one attention head: the shape's head_dim (Qwen3's may differ), else dim / n_heads."""
    return s.head_dim or s.dim // s.n_heads


class Attention(nn.Module):
    def __init__(self, s: TransformerShape):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, head_size(s)
        self.wq = nn.Linear(s.dim, s.n_heads * self.head_dim, bias=s.qkv_bias)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=s.qkv_bias)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * self.head_dim, bias=s.qkv_bias)
        self.wo = nn.Linear(s.n_heads * self.head_dim, s.dim, bias=False)
        # Qwen3: an RMSNorm over each head of q and k, before RoPE. Absent otherwise (Llama's names).
        if s.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=s.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=s.norm_eps)
        self.qk_norm = s.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # -1 heads: under tensor parallelism (transformer_tp.py) this rank computes n_heads / tp of them.
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
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
        # the whole model's parameters and the embedding's, counted before a pipeline stage drops any
        self.param_counts = sum(p.numel() for p in self.parameters()), self.tok_embeddings.weight.numel()
        cos, sin = self._rope_tables()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # a pipeline stage after the first takes the previous stage's activations (pipeline_stage)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.blocks():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is None:  # a pipeline stage before the last: its activations go to the next
            return h
        h = self.norm(h)
        return self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        return rope_tables(head_size(s), self.seq_len, s.rope_theta, s.rope_scaling)

    def blocks(self) -> list[nn.Module]:
        layers = self.layers
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)

    def pipeline_stage(self, stage: int, stages: int) -> None:
        """Cut this model down to pipeline stage `stage` of `stages` in place (torchtitan's
        pipeline_llm): its n_layers / stages consecutive blocks, kept in a ModuleDict under their own
        indices so that every parameter keeps its whole-model name (a checkpoint of any number of
        stages loads into any other: DCP matches by name); the embedding on the first stage, the norm
        and the head on the last. The caller checks that `stages` divides n_layers and that the
        embedding is not tied to the head (they would sit on different stages)."""
        per = len(self.layers) // stages
        self.layers = nn.ModuleDict({str(i): self.layers[i] for i in range(stage * per, (stage + 1) * per)})
        if stage > 0:
            self.tok_embeddings = None
        if stage < stages - 1:
            self.norm, self.output = None, None

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
            elif name.endswith(".bias"):  # qkv_bias
                full.zero_()
            else:
                std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                full.normal_(0.0, std, generator=generator)
            _copy_full_into(param, full)

    def num_params(self, exclude_embedding: bool = True) -> int:
        """The whole model's parameters (a pipeline stage's too), without the embedding's by default."""
        n, embedding = self.param_counts
        return n - embedding if exclude_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6·N (forward+backward matmuls) plus the attention scores term.
        N excludes the embedding lookup but not the output head, which a tied head still computes."""
        s = self.shape
        head = s.vocab_size * s.dim if s.tie_embeddings else 0  # otherwise already in num_params()
        return 6 * (self.num_params() + head) + 12 * s.n_layers * s.n_heads * head_size(s) * self.seq_len


@torch.no_grad()
def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter that may be a sharded DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)
