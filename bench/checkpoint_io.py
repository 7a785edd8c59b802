"""Checkpoint I/O, side by side in one run of N processes, in rounds (every round: one value of each):

* the trainer's DCP save and load (`trainer.checkpoint.manager.Checkpointer`) against the disk at the same
  concurrency: each rank writes (reads) one raw file of the bytes its own DCP shard files hold, all
  ranks at once, fsync'd, caches dropped before each; the single-stream figure beside it (rank 0
  alone writes and reads all the bytes in one file);
* the load once more with the files cached (DCP's own work, the floor under the load time), once with
  DCP's stock FileSystemReader in place of the trainer's ShardReader, and once without checking the
  shard files' checksums (ShardReader(check=False), the checkpoint left whole; checked and unchecked
  in alternating order from round to round; each of the two timed again right after, cached);
* the same DCP save against the tutorials' way: gather the full state dict, `torch.save` on rank 0;
* (with --async-rounds) an async save against a synchronous save of the same state, while a small
  model keeps training (`--step-size`), so that the steps are much shorter than the save: what the
  loop is blocked for plus how much slower the steps that overlap the save are.

    torchrun --standalone --nproc-per-node=2 -m bench.checkpoint_io --dir DIR --out result.json

Rank 0 rewrites the result file after each round, so a run stopped by its time limit keeps the
rounds it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from bench import common, shard_bytes
from trainer import dist as distributed
from trainer.checkpoint import manager
from trainer.checkpoint.reader import ShardReader

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
    parser.add_argument(
        "--out", required=True, help="result JSON, rewritten after every round so a killed run keeps what it measured"
    )
    parser.add_argument(
        "--size", default="350m", help="model size: bench.common.SIZES or trainer.models.TRANSFORMER_SIZES"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds of save / raw write / full save / loads / raw read"
    )
    parser.add_argument("--async-rounds", type=int, default=0, help="rounds of sync save / async save")
    parser.add_argument(
        "--checksum-pairs",
        type=int,
        default=0,
        help="in the last round, this many more checked and unchecked loads (alternating order)",
    )
    parser.add_argument("--step-size", default="small", help="the model that trains while the async save runs")
    parser.add_argument("--shard-size", default=None, help="also measure shard bytes (bench.shard_bytes) of this size")
    parser.add_argument(
        "--warmup",
        action="store_true",
        help="one untimed DCP save and load before the rounds: a process's first save pays one-time costs",
    )
    parser.add_argument(
        "--no-system-drop", action="store_true", help="evict only our files' pages, never the whole page cache"
    )
    args = parser.parse_args()

    env, control = common.start()
    io_group = distributed.cpu_group(timeout_s=600)  # the trainer's checkpoint group
    rank, world = env.rank, env.world_size
    result = {"size": args.size, "world_size": world, "rounds": [], "async_rounds": []}

    def publish() -> None:
        if rank == 0:
            common.write_result(args.out, result)

    if args.shard_size:  # shard bytes on these N processes, here to save a launch
        result["shard_bytes"] = {
            "size": args.shard_size,
            "world_size": world,
            **{s: shard_bytes.measure(s, args.shard_size, env, control) for s in ("fsdp", "ddp")},
        }
        publish()
    cfg = common.make_config(
        [
            *common.size_overrides(args.size),
            "model.seq_len=64",
            f"train.global_batch_size={world}",
            f"run_dir={args.dir}",
            "checkpoint.keep=0",
        ]
    )
    model, optimizer, scheduler = common.build(cfg, env)
    stream = common.batches(cfg, env)
    common.train_step(model, optimizer, scheduler, stream, env)  # creates AdamW's state
    result["params"] = sum(p.numel() for p in model.parameters())

    ckpt = manager.Checkpointer(
        cfg.checkpoint, args.dir, rank, world, io_group, model, optimizer, parts={"scheduler": scheduler}
    )
    stock = manager.Checkpointer(
        cfg.checkpoint, args.dir, rank, world, io_group, model, optimizer, parts={"scheduler": scheduler}
    )
    stock.reader = lambda path, **_: FileSystemReader(
        path
    )  # the same load with DCP's own reader in place of the trainer's
    unchecked = manager.Checkpointer(
        cfg.checkpoint, args.dir, rank, world, io_group, model, optimizer, parts={"scheduler": scheduler}
    )
    unchecked.reader = lambda path, **kw: ShardReader(path, check=False, **kw)  # the same load, no checksums
    raw_file = os.path.join(args.dir, f"raw_{rank}.bin")  # one per rank, as DCP's shard files
    single_file = os.path.join(args.dir, "raw_single.bin")
    full_file = os.path.join(args.dir, "full_state.pt")
    buffer = os.urandom(CHUNK)  # random: nothing below can compress it
    step = 0

    def drop() -> None:
        """Write back and evict (rank 0 for all), then a common start."""
        if rank == 0:
            result["cache_drop"] = common.drop_caches([args.dir], system=not args.no_system_drop)
        dist.barrier(group=control)

    def fresh_start() -> None:
        """Empty the scratch folder and write back everything dirty."""
        if rank == 0:
            for name in os.listdir(manager.folder(args.dir)):
                shutil.rmtree(os.path.join(manager.folder(args.dir), name))
            for name in os.listdir(args.dir):
                if name.endswith((".bin", ".pt")):
                    os.remove(os.path.join(args.dir, name))
        drop()

    def dcp_save() -> None:
        ckpt.save(step, {"samples": 0}, blocking=True)

    if args.warmup:
        fresh_start()
        step += 1
        dcp_save()
        ckpt.load()

    for _ in range(args.rounds):
        r = {}
        fresh_start()
        step += 1
        r["dcp_save_s"] = common.timed(dcp_save, control)
        folder = manager.step_path(args.dir, step)
        mine = sum(os.path.getsize(p) for p in Path(folder).glob(f"__{rank}_*.distcp"))  # this rank's shard files
        r["shard_files"] = common.rank_sum(len(list(Path(folder).glob(f"__{rank}_*.distcp"))), control)
        r["shard_bytes"] = common.rank_sum(mine, control)
        r["checkpoint_bytes"] = common.folder_bytes(folder) if rank == 0 else 0

        drop()  # the same bytes, each rank its own file, all at once
        r["raw_write_s"] = common.timed(lambda: raw_write(raw_file, mine, buffer), control)
        drop()  # the single stream: rank 0 alone, all of the bytes
        r["raw_write_single_s"] = common.timed(
            lambda: raw_write(single_file, r["shard_bytes"], buffer) if rank == 0 else None, control
        )

        drop()
        r["rank0_save_s"] = common.timed(lambda: rank0_full_save(model, optimizer, full_file, rank), control)
        if rank == 0:
            os.remove(full_file)  # its space and its pages

        def checked_load() -> None:
            drop()
            r["dcp_load_s"] = common.timed(lambda: ckpt.load(), control)
            # Again with the files still in the page cache: DCP's own work, the floor under the load time.
            r["dcp_load_cached_s"] = common.timed(lambda: ckpt.load(), control)

        def unchecked_load() -> None:  # the same load, its reader told not to hash the shard files
            drop()
            r["unverified_load_s"] = common.timed(lambda: unchecked.load(), control)
            r["unverified_load_cached_s"] = common.timed(lambda: unchecked.load(), control)

        for load in (
            (checked_load, unchecked_load) if len(result["rounds"]) % 2 == 0 else (unchecked_load, checked_load)
        ):
            load()
        if len(result["rounds"]) == args.rounds - 1:  # more checked/unchecked pairs: the disk's spread is wide
            for i in range(args.checksum_pairs):
                pair = {}
                result.setdefault("checksum_pairs", []).append(pair)
                for load in (checked_load, unchecked_load) if i % 2 else (unchecked_load, checked_load):
                    load()
                pair.update(
                    {
                        k: r[k]
                        for k in ("dcp_load_s", "unverified_load_s", "dcp_load_cached_s", "unverified_load_cached_s")
                    }
                )

        drop()
        r["stock_load_s"] = common.timed(lambda: stock.load(), control)

        drop()
        r["raw_read_s"] = common.timed(lambda: raw_read(raw_file), control)
        drop()
        r["raw_read_single_s"] = common.timed(lambda: raw_read(single_file) if rank == 0 else None, control)
        result["rounds"].append(r)
        publish()

    if args.async_rounds:
        # A small model trains while the large state saves: steps much shorter than the save.
        small_cfg = common.make_config(
            [*common.size_overrides(args.step_size), "model.seq_len=64", f"train.global_batch_size={2 * world}"]
        )
        small = common.build(small_cfg, env)
        small_stream = common.batches(small_cfg, env)
        for _ in range(3):
            common.train_step(*small, small_stream, env)  # warm-up
        async_ckpt = manager.Checkpointer(
            dataclasses.replace(cfg.checkpoint, async_save=True),
            args.dir,
            rank,
            world,
            io_group,
            model,
            optimizer,
            parts={"scheduler": scheduler},
        )
        for _ in range(args.async_rounds):
            r = {}
            fresh_start()
            step += 1
            r["sync_save_s"] = common.timed(dcp_save, control)
            fresh_start()
            step += 1
            r.update(async_save(async_ckpt, step, model, optimizer, scheduler, small, small_stream, env, control))
            result["async_rounds"].append(r)
            publish()
        async_ckpt.close()
    fresh_start()
    dist.barrier(group=control)


def async_save(ckpt, step, model, optimizer, scheduler, small, small_stream, env, control) -> dict:
    """What an async save of the large state costs a small model's training loop, the Checkpointer
    used as `trainer.train` uses it: `save()` at the end of a step, then in each following step
    `wait_staged()` just before the optimizer step and `poll()` after it (which commits the save once
    written); steps run until every rank has committed. The small model waits for the staging too,
    as the trainer's loop must (there the model that steps is the one being saved). Blocked: those
    three calls' seconds. Slowdown:
    the steps that overlap the save, less their blocked seconds, against the median step before it
    (on a CPU the background copy and write share the cores with the training). Summed per rank,
    slowest rank reported."""
    blocked = {"save": 0.0, "wait_staged": 0.0, "poll": 0.0}

    def timed_into(key, fn) -> None:
        started = time.perf_counter()
        fn()
        blocked[key] += time.perf_counter() - started

    def step_(wait=None) -> float:
        started = time.perf_counter()
        common.train_step(*small, small_stream, env, before_step=wait)
        return time.perf_counter() - started

    steps_before = [step_() for _ in range(10)]  # no save in flight: the baseline
    baseline = statistics.median(steps_before)
    dist.barrier(group=control)
    started = time.perf_counter()
    timed_into("save", lambda: ckpt.save(step, {"samples": 0}))
    steps_during = []
    while _any(ckpt.pending is not None, control):
        waited = blocked["wait_staged"]
        took = step_(wait=lambda: timed_into("wait_staged", ckpt.wait_staged))
        steps_during.append(took - (blocked["wait_staged"] - waited))
        timed_into("poll", ckpt.poll)
    in_flight = time.perf_counter() - started
    slowdown = sum(t - baseline for t in steps_during)
    return {
        "async_blocked_s": common.rank_max(sum(blocked.values()), control),
        "async_blocked_parts_s": {k: common.rank_max(v, control) for k, v in blocked.items()},
        "async_slowdown_s": common.rank_max(slowdown, control),
        "async_cost_s": common.rank_max(sum(blocked.values()) + slowdown, control),
        "async_in_flight_s": common.rank_max(in_flight, control),
        "async_path": "background process" if "async_checkpointer_type" in (ckpt.stager or {}) else "thread",
        "steps_before_save_s": steps_before,
        "steps_during_save_s": steps_during,
    }


def _any(flag: bool, group) -> bool:
    return common.rank_max(1.0 if flag else 0.0, group) > 0


if __name__ == "__main__":
    main()
    distributed.exit_process(0)
