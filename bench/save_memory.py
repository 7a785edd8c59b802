"""Rank 0's memory high-water mark during one save, in a fresh process: the trainer's DCP save or
the tutorials' full state dict gathered and `torch.save`d on rank 0. One contender per launch, so
that no save reuses memory an earlier one freed (in one process the full-state save's peak drifted
from round to round).

    torchrun --standalone --nproc-per-node=2 -m bench.save_memory --contender dcp --dir DIR --out result.json

After the model is built and has taken one step (AdamW's state exists), rank 0 resets its peak RSS
(/proc/self/clear_refs), saves, and reports VmHWM (the peak since) and VmRSS before the save.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from bench import checkpoint_io, common
from trainer import dist as distributed
from trainer.checkpoint import manager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contender", choices=["dcp", "rank0"], required=True)
    parser.add_argument("--dir", required=True, help="scratch folder")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--size", default="125m", help="model size: bench.common.SIZES or trainer.models.TRANSFORMER_SIZES"
    )
    args = parser.parse_args()
    env, control = common.start()
    cfg = common.make_config(
        [
            *common.size_overrides(args.size),
            "model.seq_len=64",
            f"train.global_batch_size={env.world_size}",
            f"run_dir={args.dir}",
            "checkpoint.keep=0",
        ]
    )
    model, optimizer, scheduler = common.build(cfg, env)
    common.train_step(model, optimizer, scheduler, common.batches(cfg, env), env)
    ckpt = manager.Checkpointer(
        cfg.checkpoint,
        args.dir,
        env.rank,
        env.world_size,
        distributed.cpu_group(timeout_s=600),
        model,
        optimizer,
        parts={"scheduler": scheduler},
    )
    dist.barrier(group=control)
    before = common.reset_peak_rss()
    if args.contender == "dcp":
        ckpt.save(1, {"samples": 0}, blocking=True)
    else:
        checkpoint_io.rank0_full_save(model, optimizer, os.path.join(args.dir, "full_state.pt"), env.rank)
    peak = common.peak_rss_bytes()
    dist.barrier(group=control)
    if env.rank == 0:
        common.write_result(
            args.out,
            {
                "contender": args.contender,
                "size": args.size,
                "world_size": env.world_size,
                "rss_before": before,
                "peak_rss": peak,
                "added": peak - before,
            },
        )
    dist.barrier(group=control)


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
