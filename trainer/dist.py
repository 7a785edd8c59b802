"""The one place that knows the environment: ranks, device and process-group backend.

torchrun's variables come first, then Slurm's (a job step started by `srun` without torchrun), then
a single local process. The device follows the machine: NCCL and cuda:LOCAL_RANK where GPUs exist,
gloo and the CPU otherwise.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from trainer.rundir import files


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
        os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
        backend = "cuda:nccl,cpu:gloo"  # gloo too: CPU tensors (checkpoint coordination) need it
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    # trainer.launch's rendezvous round (the same on every node; TRAINER_RDZV_ROUND), else torchrun's
    # restart count (which differs between nodes when one restarted for another's failure).
    restart = int(os.environ.get("TRAINER_RDZV_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0")
    if restart:
        # A restart inside the allocation (trainer/launchers/torchrun.py) talks to the same store as the attempt
        # before, whose keys are still there: a rank could read a dead rank's gloo address. Each
        # attempt gets keys of its own.
        from torch.distributed.rendezvous import rendezvous

        store, _, _ = next(rendezvous("env://", env.rank, env.world_size, timeout=timeout))
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"trainer/attempt_{restart}/", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=_device_id(env),
        )
        return env
    dist.init_process_group(backend, timeout=timeout, device_id=_device_id(env))
    return env


def _device_id(env: Env):
    return env.device if env.device.type == "cuda" else None


def cpu_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group on all ranks, for coordination and checkpoint I/O beside the training collectives."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def node_name() -> str:
    """This node's name as the scheduler knows it (Slurm's, which differs from the hostname on some
    sites and on the local emulated cluster), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# What a collective's error says when the process at its other end went away: gloo's read or write
# on a closed socket, NCCL's failed remote or aborted communicator.
_PEER_GONE = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|remote process exited|communicator was aborted"
)


def peer_gone(error: BaseException) -> str | None:
    """What a collective's error says, in one line, when the process at its other end went away
    (killed, crashed, its node dead), or None for any other error. The launcher names the rank or
    node that failed first; the other ranks' tracebacks, from deep inside FSDP, would only repeat
    that a partner is gone, once per rank, before that line."""
    if not isinstance(error, RuntimeError):  # torch.distributed's errors are RuntimeErrors
        return None
    lines = str(error).strip().splitlines()
    if not lines or not _PEER_GONE.search(lines[0]):
        return None
    first = re.sub(r"^\[\S+:\d+\]\s*|^NCCL error in: \S+:\d+, ", "", lines[0])  # the C++ source location
    return first.split(". This is typically")[0].rstrip(".")


class NodeError(Exception):
    """A node that cannot take part as it is (it does not see the run dir, other software); one line."""


def check_nodes(run_dir: str, group: dist.ProcessGroup) -> None:
    """Prove that every rank sees the run dir rank 0 sees, and runs the same software.

    Rank 0 writes a file with a fresh name into run_dir; every rank must read it back. A run dir on
    a node-local disk (or a filesystem some nodes lack) fails here, before training, with the nodes
    named, instead of as lost checkpoints later. Collective on `group`; raises NodeError on all ranks."""
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0, group=group)
    probe = os.path.join(run_dir, f".node-check-{token[0]}")
    if dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        files.write_text(probe, token[0])
    dist.barrier(group=group)
    try:
        sees = files.read_text(probe) == token[0]
    except OSError:
        sees = False
    import trainer

    me = {
        "host": node_name(),
        "sees": sees,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "trainer": os.path.dirname(os.path.realpath(trainer.__file__)),
    }
    everyone: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, me, group=group)
    dist.barrier(group=group)
    if dist.get_rank() == 0:
        os.remove(probe)
    blind = _name_nodes(everyone, lambda e: not e["sees"])
    if blind:
        raise NodeError(
            f"run_dir {os.path.abspath(run_dir)} is not shared: {blind} cannot see the file rank 0 wrote "
            f"there on {everyone[0]['host']}; put run_dir on a filesystem every node mounts (home, project "
            f"or scratch space), not a node-local disk"
        )
    for key, what in (("python", "Python"), ("torch", "torch"), ("trainer", "the trainer from")):
        odd = _name_nodes(everyone, lambda e: e[key] != everyone[0][key])
        if odd:
            theirs = next(e[key] for e in everyone if e[key] != everyone[0][key])
            raise NodeError(
                f"{odd} run {what} {theirs} but rank 0 on {everyone[0]['host']} runs {everyone[0][key]}; "
                f"every node must run the same environment (a shared venv, or one container image)"
            )


def _name_nodes(everyone: list[dict], bad) -> str:
    """'node n2 (ranks 2, 3), node n4 (rank 6)': the hosts of the ranks for which bad(report) holds."""
    hosts: dict[str, list[int]] = {}
    for rank, report in enumerate(everyone):
        if bad(report):
            hosts.setdefault(report["host"], []).append(rank)
    return ", ".join(f"node {h} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for h, r in hosts.items())


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now, on `host` ("": every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a rank that has finished (everything written and closed) with `code`, skipping Python's
    teardown of the interpreter.

    The teardown races with gloo: a gloo worker thread drops the tensors of a collective just after
    the collective has returned, and for a tensor Python also knows that takes the GIL. A thread that
    asks for the GIL once the interpreter is finalizing is ended by Python in a way C++ cannot unwind
    ("terminate called without an active exception", SIGABRT), and a rank that finished is reported
    as failed (ProcessGroupGloo's runLoop). Found with torch 2.15.0+cu132, this project's venv then
    (bench/results/2026-11-24-vm.md names it): one exit in two of a short 2-rank script on a 2-core
    machine; seen again with 2.14.1 (commit 9d7d5ec: fully_shard alone, one run in eight).
    destroy_process_group does not stop those threads: the model's device mesh still holds the
    group. So the process group goes, Python's buffers are flushed, and the process
    ends here."""
    shutdown()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
