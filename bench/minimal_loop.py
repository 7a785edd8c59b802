"""The yardstick for the trainer's step time: a minimal hand-written FSDP2 loop, as in the tutorials.

Same model (`trainer.models`), batch and number of processes as the trainer run it is compared with;
nothing else: random tokens, `fully_shard` on each block and the root, AdamW, gradient clipping, a
warm-up learning-rate schedule (LambdaLR, as the trainer's), and one metrics row per step (the loss
averaged over ranks, as the trainer logs it).

    torchrun --standalone --nproc-per-node=2 -m bench.minimal_loop --out metrics.jsonl --size small \
        --seq-len 128 --batch 16 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from trainer.dist import exit_process
from trainer.models import ModelArgs, build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="metrics.jsonl to append one row per step to")
    parser.add_argument("--size", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch size in samples")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")

    with torch.device("meta"):
        model = build(ModelArgs(name="transformer", size=args.size, seq_len=args.seq_len))
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=cuda
    )  # the trainer's
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    vocab, micro = model.shape.vocab_size, args.batch // world
    generator = torch.Generator().manual_seed(rank)

    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        tokens = torch.randint(vocab, (micro, args.seq_len + 1), generator=generator).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        loss_value = loss.item() / world
        elapsed = time.perf_counter() - started
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss_value, "step_time_s": elapsed}) + "\n")


if __name__ == "__main__":
    main()
    exit_process(0)  # destroys the process group; see there why the process ends this way
