"""Per-rank bytes of parameters, gradients and optimizer state after one real step, with full
sharding (FSDP2) and with DDP beside it, against the ideal: the unsharded total / N.

    torchrun --standalone --nproc-per-node=N -m bench.shard_bytes --out result.json [--size small]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from bench import common
from trainer import dist as distributed


def state_tensors(model, optimizer) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer's state tensors (e.g. AdamW's moments)."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return tensors


def measure(strategy: str, size: str, env, control) -> dict:
    cfg = common.make_config(
        [
            f"model.size={size}",
            "model.seq_len=64",
            f"train.global_batch_size={env.world_size}",
            f"parallel.strategy={strategy}",
        ]
    )
    model, optimizer, scheduler = common.build(cfg, env)
    common.train_step(model, optimizer, scheduler, common.batches(cfg, env), env, zero_grad=False)
    tensors = state_tensors(model, optimizer)
    total = sum(t.numel() * t.element_size() for t in tensors)  # numel() of a DTensor: its global size
    local = sum(common.local(t).numel() * t.element_size() for t in tensors)
    # What the shards really occupy: FSDP2 pads dim 0 to a multiple of N and may keep several
    # gradients in one buffer, so count each storage once.
    storages = {}
    for t in tensors:
        storage = common.local(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    result = {
        "total_bytes": total,
        "max_rank_bytes": common.rank_max(local, control),
        "max_rank_storage_bytes": common.rank_max(sum(storages.values()), control),
    }
    ideal = total / env.world_size
    result["vs_ideal"] = result["max_rank_bytes"] / ideal
    result["storage_vs_ideal"] = result["max_rank_storage_bytes"] / ideal
    del model, optimizer
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", default="small", help="transformer size (trainer.models.TRANSFORMER_SIZES)")
    args = parser.parse_args()
    env, control = common.start()
    result = {
        "size": args.size,
        "world_size": env.world_size,
        "fsdp": measure("fsdp", args.size, env, control),
        "ddp": measure("ddp", args.size, env, control),
    }
    if env.rank == 0:
        common.write_result(args.out, result)
    dist.barrier(group=control)


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
