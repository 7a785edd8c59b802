"""What the benchmark workers share: start-up, one real training step, timing, memory and caches.

Workers run under torchrun (gloo on CPU, NCCL on GPUs through `trainer.dist`) and rank 0 writes
its findings as one JSON file, the path given by `--out`.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from trainer import config, data, models, optim
from trainer import dist as distributed
from trainer.train import batch_plan, build_model


def start() -> tuple[distributed.Env, dist.ProcessGroup]:
    """The default process group and a gloo group for the bench's own barriers and reductions,
    so that they never interleave with the collectives of a checkpoint on the trainer's group."""
    env = distributed.init(timeout_s=600)
    return env, distributed.cpu_group(timeout_s=600)


# Bench-only transformer shapes, as model.* overrides of the trainer's config, named by parameter
# count. With AdamW a checkpoint holds 12 bytes per parameter: 0.72, 1.6 and 4.5 GB.
SIZES = {
    "60m": [
        "model.size=125m",
        "model.dim=512",
        "model.n_layers=8",
        "model.n_heads=8",
        "model.n_kv_heads=8",
        "model.ffn_dim=1536",
    ],
    "125m": ["model.size=125m"],
    "350m": [
        "model.size=125m",
        "model.dim=1024",
        "model.n_layers=24",
        "model.n_heads=16",
        "model.n_kv_heads=16",
        "model.ffn_dim=2816",
    ],
}


def size_overrides(size: str) -> list[str]:
    """The overrides of a bench size, or of one of trainer.models.TRANSFORMER_SIZES."""
    return SIZES.get(size, [f"model.size={size}"])


def make_config(overrides: list[str]) -> config.Config:
    return config.load(None, overrides)


def build(cfg: config.Config, env: distributed.Env):
    """Model, optimizer and scheduler exactly as `trainer.train` builds them."""
    model = build_model(cfg, env)
    optimizer = optim.build(model.parameters(), cfg.optim, env.device)
    return model, optimizer, optim.scheduler(optimizer, cfg.optim, cfg.train.steps)


def batches(cfg: config.Config, env: distributed.Env):
    """The trainer's own sample stream for this rank."""
    micro, _ = batch_plan(cfg, env.world_size)
    dataset = data.build(cfg.data, cfg.model, cfg.train.seed, train=True)
    return data.loader(
        dataset, cfg.data, cfg.train.seed, 0, cfg.train.global_batch_size, micro, env.rank, env.world_size
    )


def train_step(
    model, optimizer, scheduler, stream, env: distributed.Env, zero_grad: bool = True, before_step=None
) -> None:
    """One optimizer step (one micro-batch): forward, backward, clip, step. The first step also
    creates the optimizer's state, so afterwards a checkpoint holds everything a real one does.
    `before_step` is called just before the optimizer step, where `trainer.train` waits for an
    async save's copy of the state."""
    x, y, _ = next(stream)
    loss = models.loss_fn(model(x.to(env.device)), y.to(env.device))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if before_step:
        before_step()
    optimizer.step()
    scheduler.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)


def timed(fn, group: dist.ProcessGroup) -> float:
    """Seconds from a common start until every rank has finished `fn` (the slowest rank counts)."""
    dist.barrier(group=group)
    started = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - started


def rank_max(value: float, group: dist.ProcessGroup) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def rank_sum(value: int, group: dist.ProcessGroup) -> int:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return int(t.item())


def reset_peak_rss() -> int:
    """Start a new peak resident set size for this process (Linux >= 4.0: clear_refs 5); returns
    the resident set size now, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset."""
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def drop_caches(paths: list[str], system: bool = True) -> str:
    """Write back everything dirty, then evict the pages of the files under `paths`, so a read comes
    from the disk and a write is not slowed by an earlier one's writeback. With `system` and a
    writable /proc/sys/vm/drop_caches, the whole page cache is dropped too (`echo 1`: on a shared
    machine that evicts everybody's pages, which makes their next reads slower). Returns the way
    used: "drop_caches" or "fadvise" (posix_fadvise DONTNEED on each of our files)."""
    os.sync()
    method = "fadvise"
    if system and os.access("/proc/sys/vm/drop_caches", os.W_OK):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            method = "drop_caches"
        except OSError:  # writable by mode, refused by the kernel (a container): our files only
            pass
    files = [p for p in paths if os.path.isfile(p)]
    files += [os.path.join(d, f) for p in paths if os.path.isdir(p) for d, _, names in os.walk(p) for f in names]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return method


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def write_result(path: str, result: dict) -> None:
    """Write `path` whole or not at all (workers rewrite it as they go and may be killed)."""
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
