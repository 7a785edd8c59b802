"""The one place that knows the environment: ranks, device and process-group backend.

torchrun's variables come first, then Slurm's (a job step started by `srun` without torchrun), then
a single local process. The device follows the machine: NCCL and cuda:LOCAL_RANK where GPUs exist,
gloo and the CPU otherwise.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Env:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env() -> Env:
    """Ranks from the launcher's variables, without starting anything."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:  # torchrun (or anything that sets the same variables)
        rank, world = int(e["RANK"]), int(e["WORLD_SIZE"])
        local_rank = int(e.get("LOCAL_RANK", 0))
        local_world = int(e.get("LOCAL_WORLD_SIZE", world))
    elif "SLURM_PROCID" in e and "SLURM_NTASKS" in e and "MASTER_ADDR" in e:
        rank, world = int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"])
        local_rank = int(e.get("SLURM_LOCALID", 0))
        local_world = int(e.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    else:
        rank, world, local_rank, local_world = 0, 1, 0, 1
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    return Env(rank, local_rank, world, local_world, device)


def init(timeout_s: float) -> Env:
    """Start the default process group (also for one process, so every code path is the same)."""
    env = read_env()
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
        backend = "cuda:nccl,cpu:gloo"  # gloo too: CPU tensors (checkpoint coordination) need it
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=_device_id(env))
    return env


def _device_id(env: Env):
    return env.device if env.device.type == "cuda" else None


def cpu_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group on all ranks, for coordination and checkpoint I/O beside the training collectives."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
