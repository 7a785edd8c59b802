"""One preflight: a config loaded, checked and resolved once for where it is to run.

    ready = startup.preflight(startup.Target.rank(env), "configs/default.yaml", ["train.steps=6"])
    train(ready)                  # ready.cfg: the resolved config; ready.notes, ready.warnings: what to say

Every start goes through preflight(): the trainer's ranks (`python -m trainer`), the launcher of
this node (`python -m trainer.launch`), a Slurm submission (`python -m trainer.submit`), a
Kubernetes job's manifest (`python -m trainer.launchers.k8s`) and the Python API (trainer.api).
The Target says where the run goes, and so what this machine can check for it: this node's devices
and memory (the launcher), a rank's own GPU (a rank), or nothing of this machine (a submission plans
for a cluster's nodes). The same config gets the same answer from
each: the config's checks are trainer/preflight/check.py's validate, run once; the config is
resolved once (the batch of the target's processes, the model's shape: config.resolve) and handed
on as Ready, a type of its own, so that a caller can tell a resolved config from a raw one.

A problem is raised as ConfigError (one line: what, where, what to do), before anything is
written; a problem of this node's own devices (the launcher's) as dist.NodeError, said by each node.

The launcher tells its ranks what it checked on their command line (`--memory-checked`: this node's
memory; `--weights-checked`: model.init_from's folder read whole, its index and every safetensors
header; read by Target.rank), not in the environment: a rank started by hand or by another torchrun
checks it all. So a folder's headers are read once per node, not once per rank: a 405B folder (~190
shards) on 16,384 ranks would otherwise be ~6 million requests to a bucket, or 3 million opens on a
shared filesystem, before training.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from trainer import early_stop
from trainer.config import Config, ConfigError, load_run
from trainer.parallel.dims import not_built
from trainer.preflight.check import check_devices, check_float8, check_gpu_memory, check_gpus, checked
from trainer.rundir import layout, objects

log = logging.getLogger("trainer")

# The targets: where a run is to go.
RANK = "rank"  # one rank of a run, in this process: its own GPU too
LAUNCH = "launch"  # the launcher of this node's ranks: its devices, its memory
SLURM = "slurm"  # a submission from a login node: the job's shape, no device of this machine
K8S = "k8s"  # a Kubernetes job rendered here: its shape, no device of this machine, no file of its volume
API = "api"  # trainer.api.launch: the shape only (the launcher it starts checks this machine)


@dataclass(frozen=True)
class Target:
    """Where a config is to run: what preflight() checks it against."""

    kind: str  # RANK, LAUNCH, SLURM, K8S or API
    world_size: int  # the run's processes, all nodes
    ranks_per_node: int | None = None  # this node's ranks whose (CPU) memory is checked here; None: not here
    node_size: int | None = None  # the ranks of one node of the target, where no memory is checked here
    planning: bool = False  # for another machine: the files this one cannot see are warnings
    device: object = None  # a rank's torch.device: its GPU's memory and float8 support are checked
    local_world_size: int = 1  # a rank's: the processes of its node (each needs a GPU of its own)
    nproc_option: str = ""  # the launcher's: how the user sets this node's processes ("--nproc-per-node={}")
    nproc: str = ""  # the launcher's --nproc-per-node as given (a number, auto), counted once the config loaded
    nnodes: int = 1  # the launcher's: the nodes of the job
    node: str = ""  # the launcher's: this node's name, named in its own problems on a job of several
    stop_if_finished: bool = False  # a run dir whose run has nothing left to do is said (Finished), not checked
    weights_checked: bool = False  # a rank's: its launcher read model.init_from's weights; config.json alone here

    @classmethod
    def rank(cls, env, memory_checked: bool = False, weights_checked: bool = False) -> Target:
        """This rank (trainer.dist.Env); `memory_checked`: its launcher checked its node's memory;
        `weights_checked`: its launcher read model.init_from's folder whole (hf.init_args)."""
        return cls(
            RANK,
            env.world_size,
            ranks_per_node=None if memory_checked else env.local_world_size,
            device=env.device,
            local_world_size=env.local_world_size,
            weights_checked=weights_checked,
        )

    @classmethod
    def launcher(cls, nproc: str, nnodes: int, node: str = "") -> Target:
        """The launcher of `nproc` ranks on this node ("auto": one per GPU, else 1), one of `nnodes`."""
        return cls(
            LAUNCH,
            0,  # counted by preflight(), after the config: a config's problem is said before the count's
            nproc_option="--nproc-per-node={}",
            nproc=nproc,
            nnodes=nnodes,
            node=node if nnodes > 1 else "",
            stop_if_finished=True,
        )

    def counted(self) -> Target:
        """The launcher's target with its processes counted (ConfigError for a count that is none)."""
        import torch

        if self.nproc == "auto":
            nproc = torch.cuda.device_count() if torch.cuda.is_available() else 1
        elif not self.nproc.isdigit() or int(self.nproc) < 1:
            raise ConfigError(f"--nproc-per-node={self.nproc}: give a whole number >= 1, or auto")
        else:
            nproc = int(self.nproc)
        return dataclasses.replace(self, world_size=nproc * self.nnodes, ranks_per_node=nproc)

    @classmethod
    def slurm(cls, nodes: int, per_node: int, planning: bool = False) -> Target:
        """A Slurm job of `nodes` x `per_node` ranks; `planning`: a dry run."""
        return cls(SLURM, nodes * per_node, node_size=per_node, planning=planning)

    @classmethod
    def k8s(cls, nodes: int, per_node: int) -> Target:
        """A Kubernetes job of `nodes` pods x `per_node` ranks (trainer/launchers/k8s.py), planned here:
        its run dir is on a volume this machine does not see, its data in the image or on the volume."""
        return cls(K8S, nodes * per_node, node_size=per_node, planning=True)

    @classmethod
    def api(cls, nproc: int) -> Target:
        """trainer.api.launch's `nproc` processes, on this machine: one node."""
        return cls(API, nproc, node_size=nproc)


@dataclass(frozen=True)
class Ready:
    """A config checked for its target and resolved once: what a run starts from. Not a Config, so
    that no caller mistakes a raw config for a checked and resolved one."""

    cfg: Config  # resolved: the global batch of target.world_size processes, the model's shape, eval_fraction
    where: str  # the config's file (or what stands for it): what a problem found later names
    target: Target
    notes: tuple[str, ...] = ()  # what differs from the run dir's saved run (rank 0 says them)
    warnings: tuple[str, ...] = ()  # the checks' (parallel's deprecations; planning: what another machine needs)
    crowded: str | None = None  # the launcher's: more ranks than CPU cores (they share them), else None
    memory_checked: bool = False  # this node's memory was checked for its ranks (the launcher tells them)
    weights_checked: bool = False  # model.init_from's index and headers were read here (the launcher tells them)


@dataclass(frozen=True)
class Finished:
    """A run dir whose run has nothing left to do (it reached train.steps, or stopped early and stays
    stopped): `line` says so; nothing is checked or started."""

    run_dir: str
    line: str


def preflight(
    target: Target,
    config: str | Config | None,
    overrides: list[str] | tuple[str, ...] = (),
    config_chosen: bool = True,
    where: str | None = None,
) -> Ready | Finished:
    """Load `config` (a YAML file, None: the defaults; a run dir that holds a run continues it:
    config.load_run; a Config: as given, named `where`), then check it for `target` and resolve it,
    once. ConfigError (dist.NodeError for the launcher's own devices) for the first problem."""
    if isinstance(config, Config):
        cfg, notes = config, []
        where = where or "config"
    else:
        cfg, where, notes = load_run(config, list(overrides), config_chosen)
    if target.nproc:
        target = target.counted()
    unread = None  # why an s3:// run dir's bucket could not say whether the run finished
    if target.stop_if_finished:
        try:
            line = finished(cfg)
        except (OSError, objects.StoreError) as e:
            if not objects.is_remote(cfg.run_dir):
                raise
            line, unread = None, e
        if line:
            return Finished(cfg.run_dir, line)
    crowded = _devices(target) if target.nproc_option else None
    warnings, resolved = checked(
        cfg,
        target.world_size,
        where=where,
        overrides=list(overrides),
        ranks_per_node=target.ranks_per_node,
        planning=target.planning,
        node_size=target.node_size,
        weights_checked=target.weights_checked,
    )
    if unread is not None:  # said once the checks passed: a bad run_dir or credentials is their one line
        log.warning(
            "warning: run_dir %s: reading its newest checkpoint failed (%s); the ranks start and decide",
            cfg.run_dir,
            unread,
        )
    refused = not_built(resolved.parallel.cp)
    if refused and not (target.kind == SLURM and target.planning):  # a start; a dry run only plans
        given = [item for item in overrides if item.split("=")[0] == "parallel.cp"]
        raise ConfigError(f"{f'override {given[-1]!r}' if given else where}: parallel.cp: {refused}")
    if target.kind == RANK:  # each rank's own GPU: asking creates a CUDA context, so never the launcher
        check_gpus(target.local_world_size)
        check_gpu_memory(resolved, target.world_size, target.device, target.local_world_size, where=where)
        check_float8(resolved, target.device, where=where)
    return Ready(
        resolved,
        where,
        target,
        tuple(notes),
        tuple(warnings),
        crowded,
        memory_checked=target.kind == LAUNCH,
        weights_checked=target.kind == LAUNCH,
    )


def _devices(target: Target) -> str | None:
    """The launcher's node: its processes must fit its GPUs (dist.NodeError, naming the node on a job
    of several); on the CPU, more than its cores is the warning returned."""
    from trainer.dist import NodeError  # torch: the launcher has it

    nproc = target.ranks_per_node
    try:
        crowded = check_devices(nproc, target.nproc_option)
        check_gpus(nproc)
    except ConfigError as e:
        raise NodeError(f"{target.node}: {e}" if target.node else str(e)) from None
    return crowded


def nothing_to_do(cfg: Config, step: int | None, record: dict | None = None) -> str | None:
    """The one line of a start with nothing left to do, else None: `record`, the early_stop part of
    the newest checkpoint (at `step`) where it records a stop there (trainer/early_stop.py), keeps
    the run stopped under this start's patience; or `step` reached train.steps. The launcher asks
    before any rank starts (finished()), a rank once it loaded the checkpoint (trainer/train.py)."""
    patience = cfg.train.early_stop_patience
    if record is not None and early_stop.stops_again(record, patience):
        return early_stop.nothing_to_do(step, patience, early_stop.reason_of(record))
    if step is not None and step >= cfg.train.steps:
        return f"nothing to do: step {step} reached train.steps={cfg.train.steps}; raise train.steps to continue"
    return None


def finished(cfg: Config) -> str | None:
    """nothing_to_do for the run dir's newest committed checkpoint, read as the launcher reads it
    (trainer/rundir/layout.py: no torch, no pickle; an s3:// run dir's bucket: _finished_in_bucket,
    whose store may fail: objects.StoreError, OSError)."""
    if objects.is_remote(cfg.run_dir):
        return _finished_in_bucket(cfg)
    step = layout.latest_committed_step(cfg.run_dir)
    stopped = layout.early_stop_record(cfg.run_dir, step)
    return nothing_to_do(cfg, step, stopped[1] if stopped else None)


def _finished_in_bucket(cfg: Config) -> str | None:
    """finished() for an s3:// run dir: the checkpoint rank 0's resume would take and its meta.json's
    early_stop part, read from the bucket (remote.newest_committed: one LIST, bounded GETs, nothing
    downloaded), so that a finished run started again starts no rank and downloads no checkpoint on
    any node. objects.StoreError or OSError where the store fails: preflight says it as a warning
    once the config's checks passed, and the ranks decide."""
    from trainer.checkpoint import remote  # the launcher has torch (Target.counted)

    found = remote.newest_committed(cfg.run_dir)
    if found is None:
        return None
    step, meta = found
    record = meta.get(early_stop.PART) if meta else None
    stopped = isinstance(record, dict) and record.get("stopped") == step  # layout.early_stop_record's test
    return nothing_to_do(cfg, step, record if stopped else None)
