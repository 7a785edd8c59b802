"""The transformer family's tensor-parallel plan (torchtitan's `parallelize_llama`), over the 1D "tp"
mesh of the parallel plan: each block's q/k/v and SwiGLU up projections (w1, w3) column-wise, its
output projections (wo, w2) row-wise, the norms sequence-parallel (the residual stream between them
sharded over the sequence), the embedding row-wise with a sequence-sharded output, and the head
column-wise with its logits left sharded over the vocabulary: the loss is computed on them under
`loss_parallel` (trainer.parallel.plan.Plan.loss_parallel). Each rank computes n_heads / tp query heads
and n_kv_heads / tp key/value heads (Attention views them as -1). Imported when a plan is applied.

The residual stream between the blocks stays a DTensor (sharded over the sequence): the embedding's
and the output projections' `use_local_output=False`. With plain local tensors there (torchtitan's
default), each compiled block turned its input into a DTensor inside the graph, and the gradient
flowing back to the embedding came out wrong under torch.compile (torch 2.14: the embedding's
gradient differed by 0.07 of eager's, every block's own gradients equal).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split the unwrapped Transformer over `mesh` in place (parameters become DTensors on it)."""
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    # a pipeline stage (Transformer.pipeline_stage) holds the parts it kept; between two stages the
    # residual stream travels as this rank's local shard of the sequence (the pipeline sends tensors)
    parallelize_module(model, mesh, {name: style for name, style in root.items() if getattr(model, name) is not None})
    if model.tok_embeddings is None:
        parallelize_module(
            model, mesh, PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),))
        )
    if model.norm is None:
        parallelize_module(
            model, mesh, PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),))
        )
        # a copy, not to_local's view: the zero-bubble schedules' split backward detaches a stage's output
        # in place, which a view refuses ("Can't detach views in-place", torch 2.14)
        model.register_forward_hook(lambda module, args, output: output.clone())
    for block in model.blocks():
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                # x gathered over the sequence; the RoPE tables (plain tensors) pass as they are
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
