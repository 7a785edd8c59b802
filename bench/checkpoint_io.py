"""Checkpoint I/O, side by side in one run of N processes:

* the trainer's DCP save and load (`trainer.checkpoint.Checkpointer`) against a raw sequential
  write and read of the same byte count, fsync'd, on the same filesystem, caches dropped before each
  (and the load once more with the files cached: the time DCP needs besides the disk's; once
  with DCP's stock FileSystemReader in place of the trainer's ShardReader; and once without
  checking the shard files' checksums);
* the same DCP save against the tutorials' way: gather the full state dict, `torch.save` on rank 0;
* what an async save blocks the training loop for (the trainer's Checkpointer used as
  `trainer.train` uses it, real training steps between) against a synchronous save of the same state.

    torchrun --standalone --nproc-per-node=2 -m bench.checkpoint_io --dir DIR --out result.json

Rounds interleave the contenders (A B A B ...) and run.py takes medians. Rank 0 rewrites the result
file after each phase, so a run stopped by its time limit keeps the figures it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from bench import common, shard_bytes
from trainer import checkpoint, checksums, dist as distributed

CHUNK = 64 * 2**20  # bytes per write() or read() of the raw disk baseline


def raw_write(path: str, nbytes: int, buffer: bytes) -> None:
    with open(path, "wb") as f:
        for offset in range(0, nbytes, len(buffer)):
            f.write(buffer[: min(len(buffer), nbytes - offset)])
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: str) -> None:
    buffer = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


def rank0_full_save(model, optimizer, path: str, rank: int) -> None:
    """The FSDP tutorial's checkpoint: the full (unsharded) state gathered to rank 0's CPU memory
    and written there with torch.save (fsync'd too, so that it is as durable as DCP's files)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if rank == 0:
        with open(path, "wb") as f:
            torch.save({"model": model_state, "optim": optim_state}, f)
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="scratch folder on the filesystem to measure")
    parser.add_argument("--out", required=True, help="result JSON, rewritten after every phase so a killed run keeps what it measured")
    parser.add_argument("--size", default="125m", help="transformer size (trainer.models.TRANSFORMER_SIZES)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of save / raw write / full save / load / raw read")
    parser.add_argument("--async-rounds", type=int, default=1, help="rounds of sync save / async save")
    parser.add_argument("--shard-size", default="small", help="also measure shard bytes (bench.shard_bytes) of this size")
    args = parser.parse_args()

    env, control = common.start()
    io_group = distributed.cpu_group(timeout_s=600)  # the trainer's checkpoint group
    rank, world = env.rank, env.world_size
    result = {"size": args.size, "world_size": world, "rounds": [], "async_rounds": []}

    def publish() -> None:
        if rank == 0:
            common.write_result(args.out, result)

    # Shard bytes on these N processes, here to save a launch.
    result["shard_bytes"] = {"size": args.shard_size, "world_size": world,
                             **{s: shard_bytes.measure(s, args.shard_size, env, control) for s in ("fsdp", "ddp")}}
    publish()
    cfg = common.make_config([f"model.size={args.size}", "model.seq_len=64", f"train.global_batch_size={world}",
                              f"run_dir={args.dir}", "checkpoint.keep=0"])
    model, optimizer, scheduler = common.build(cfg, env)
    stream = common.batches(cfg, env)
    common.train_step(model, optimizer, scheduler, stream, env)  # creates AdamW's state
    result["state_bytes"] = common.rank_sum(sum(common.local(t).numel() * t.element_size() for t in _state_tensors(model, optimizer)), control)

    ckpt = checkpoint.Checkpointer(cfg.checkpoint, args.dir, rank, world, io_group)
    stock = checkpoint.Checkpointer(cfg.checkpoint, args.dir, rank, world, io_group)
    stock.reader = lambda path, **_: FileSystemReader(path)  # the same load with DCP's own reader in place of the trainer's
    raw_file = os.path.join(args.dir, "raw.bin")
    full_file = os.path.join(args.dir, "full_state.pt")
    buffer = os.urandom(CHUNK) if rank == 0 else b""  # random: nothing below can compress it
    step = 0

    def fresh_start() -> None:
        """Empty the scratch folder and write back everything dirty."""
        if rank == 0:
            for name in os.listdir(checkpoint.folder(args.dir)):
                shutil.rmtree(os.path.join(checkpoint.folder(args.dir), name))
            for file in (raw_file, full_file):
                if os.path.exists(file):
                    os.remove(file)
            common.drop_caches([args.dir])
        dist.barrier(group=control)

    def drop() -> None:
        if rank == 0:
            common.drop_caches([args.dir])
        dist.barrier(group=control)

    def dcp_save() -> None:
        ckpt.save(step, model, optimizer, scheduler, {"samples": 0}, blocking=True)

    for _ in range(args.rounds):
        r = {}
        result["rounds"].append(r)
        fresh_start()
        step += 1
        r["dcp_save_rss_before"] = common.reset_peak_rss()
        r["dcp_save_s"] = common.timed(dcp_save, control)
        r["dcp_save_peak_rss"] = common.peak_rss_bytes()
        nbytes = common.folder_bytes(checkpoint.step_path(args.dir, step)) if rank == 0 else 0
        r["checkpoint_bytes"] = nbytes

        drop()
        r["raw_write_s"] = common.timed(lambda: raw_write(raw_file, nbytes, buffer) if rank == 0 else None, control)
        publish()

        drop()
        r["rank0_save_rss_before"] = common.reset_peak_rss()
        r["rank0_save_s"] = common.timed(lambda: rank0_full_save(model, optimizer, full_file, rank), control)
        r["rank0_save_peak_rss"] = common.peak_rss_bytes()
        if rank == 0:
            os.remove(full_file)  # its space and its pages
        publish()

        records = [str(p) for p in Path(checkpoint.step_path(args.dir, step)).glob(f"*{checksums.SUFFIX}")]

        def checked_load() -> None:
            drop()
            meta = {}
            r["dcp_load_s"] = common.timed(lambda: meta.update(ckpt.load(model, optimizer, scheduler)), control)
            r["dcp_load_inner_s"] = meta["load_time_s"]
            # Again with the files still in the page cache: DCP's own work, the floor under the load time.
            r["dcp_load_cached_s"] = common.timed(lambda: ckpt.load(model, optimizer, scheduler), control)

        def unchecked_load() -> None:  # the same load without the shard files' checksums (records aside)
            if rank == 0:
                for path in records:
                    os.rename(path, path + ".aside")
            drop()
            r["unverified_load_s"] = common.timed(lambda: ckpt.load(model, optimizer, scheduler), control)
            if rank == 0:
                for path in records:
                    os.rename(path + ".aside", path)
            dist.barrier(group=control)

        # Checked and unchecked loads in alternating order from round to round: neither goes first always.
        for load in (checked_load, unchecked_load) if len(result["rounds"]) % 2 else (unchecked_load, checked_load):
            load()

        drop()
        r["stock_load_s"] = common.timed(lambda: stock.load(model, optimizer, scheduler), control)

        drop()
        r["raw_read_s"] = common.timed(lambda: raw_read(raw_file) if rank == 0 else None, control)
        publish()

    # Async: the trainer's own Checkpointer with async_save (one stager for the whole run, as in
    # trainer.train), between real training steps, against a synchronous save of the same state.
    async_ckpt = checkpoint.Checkpointer(dataclasses.replace(cfg.checkpoint, async_save=True), args.dir, rank, world, io_group)
    for _ in range(args.async_rounds):
        r = {}
        result["async_rounds"].append(r)
        fresh_start()
        step += 1
        r["sync_save_s"] = common.timed(dcp_save, control)
        publish()
        fresh_start()
        step += 1
        r.update(async_save(async_ckpt, step, model, optimizer, scheduler, stream, env, control))
        publish()
    async_ckpt.close()
    fresh_start()
    dist.barrier(group=control)
    distributed.shutdown()


def async_save(ckpt, step, model, optimizer, scheduler, stream, env, control) -> dict:
    """What an async save blocks the training loop for, as `trainer.train` uses the Checkpointer:
    `save()` at the end of a step (it returns once the background copy has started), then in each
    following step `wait_staged()` just before the optimizer step and `poll()` after it, which
    commits the save once it is written. Steps run until every rank has committed. Blocked seconds
    are summed per rank, slowest rank reported; step times before and during the save beside them,
    since on a CPU the background copy and write share the cores with the training."""
    def step_(wait=None) -> float:
        started = time.perf_counter()
        common.train_step(model, optimizer, scheduler, stream, env, before_step=wait)
        return time.perf_counter() - started

    steps_before = [step_() for _ in range(2)]  # no save in flight: the baseline
    blocked = {"save": 0.0, "wait_staged": 0.0, "poll": 0.0}

    def timed_into(key, fn) -> None:
        started = time.perf_counter()
        fn()
        blocked[key] += time.perf_counter() - started

    dist.barrier(group=control)
    started = time.perf_counter()
    timed_into("save", lambda: ckpt.save(step, model, optimizer, scheduler, {"samples": 0}))
    steps_during = []
    while _any(ckpt.pending is not None, control):
        steps_during.append(step_(wait=lambda: timed_into("wait_staged", ckpt.wait_staged)))
        timed_into("poll", ckpt.poll)
    in_flight = time.perf_counter() - started
    return {
        "async_stall_s": common.rank_max(sum(blocked.values()), control),
        "async_blocked_s": {k: common.rank_max(v, control) for k, v in blocked.items()},
        "async_in_flight_s": common.rank_max(in_flight, control),
        "steps_before_save_s": steps_before,
        "steps_during_save_s": steps_during,
    }


def _state_tensors(model, optimizer) -> list[torch.Tensor]:
    tensors = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return tensors


def _any(flag: bool, group) -> bool:
    return common.rank_max(1.0 if flag else 0.0, group) > 0


if __name__ == "__main__":
    main()
