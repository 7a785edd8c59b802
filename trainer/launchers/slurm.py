"""Submit training to Slurm from a login node.

    python -m trainer.submit --nodes 4 [--min-nodes 3] [--gpus-per-node N] [--cpus-per-node N] [--config F]
                             [--run-dir D] [--time T] [--partition P] [--container IMG] [--net-if IFACE]
                             [--launcher sbatch|submitit] [--dry-run] [k=v ...]

`make submit` calls it. Everything that can be known without the compute nodes is checked here,
before anything is submitted: the config and its batch arithmetic for the job's shape, the
partition and the GPUs and CPUs its nodes declare (gres), the time limit against the save budget,
the paths. The login node's own devices are not looked at: it rarely has GPUs. What only the
nodes can answer (their devices, that they all see the run dir) the launcher checks at start.

Two launchers start the same thing, `python -m trainer.launch` once per node:

* ``sbatch`` (default): renders ``slurm/train.sbatch.in`` into ``<run_dir>/slurm/train.sbatch``;
  the batch script requeues itself through ``python3 -m trainer.requeue``.
* ``submitit``: one :class:`LaunchTask` per node; task 0 requeues through the same check.

`--dry-run` prints the resources with the reason for each choice, and the exact batch script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trainer import cli
from trainer.launchers.requeue import HEALTH_FAILED, requeue_check
from trainer.resilience import signals
from trainer.rundir import files
from trainer.rundir.objects import SCHEME

REPO_DIR = Path(__file__).resolve().parents[2]  # trainer/launchers/slurm.py: the checkout holding slurm/
TEMPLATE = REPO_DIR / "slurm" / "train.sbatch.in"
# Paths that are local to each node on nearly every cluster. A node-local ext4/xfs disk elsewhere
# cannot be told from a shared one from here: the launcher proves the run dir is shared at start.
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run")
NODE_LOCAL_FSTYPES = {"tmpfs", "ramfs", "devtmpfs"}
TIME_FORMAT = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


class SubmitError(Exception):
    """Bad input, said in one line to the user before anything is submitted."""


# ---- what the cluster says ----------------------------------------------------------------------


@dataclasses.dataclass
class Partition:
    name: str
    gpus_per_node: int  # the fewest GPUs (gres gpu) any node of the partition declares
    cpus_per_node: int  # the fewest CPUs any node of the partition has
    grace_time_s: int | None  # seconds a preempted job gets after its first SIGTERM; None: not preemptable
    gpu_types: tuple[str, ...] = ()  # the GPU types its nodes' gres name (gpu:h100:8 -> h100); () if untyped


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise SubmitError(f"{cmd[0]} not found: submit from a Slurm login node (locally: make slurm-up)") from None
    if out.returncode != 0:
        raise SubmitError(f"cannot ask Slurm ({' '.join(cmd[:2])}: {out.stderr.strip()}); is the cluster up?")
    return out.stdout


def gres_gpus(gres: str) -> int:
    """GPUs in a node's gres string: 'gpu:8', 'gpu:a100:4(S:0-1),gpu:h100:4', '(null)' -> 8, 8, 0."""
    return sum(int(m.group(1)) for m in re.finditer(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


def gres_gpu_types(gres: str) -> set[str]:
    """GPU types in a node's gres string: 'gpu:a100:4(S:0-1),gpu:h100:4' -> {a100, h100}; 'gpu:8' -> {}."""
    return {m.group(1) for m in re.finditer(r"(?:^|,)gpu:([^:,(]+):\d+", gres)}


def query_partition(name: str | None) -> Partition:
    """The named partition (or the cluster's default) as its nodes declare it."""
    listing = _run(["sinfo", "-h", "-o", "%P"]).split()
    names = [p.rstrip("*") for p in listing]
    if name is None:
        name = next((p.rstrip("*") for p in listing if p.endswith("*")), None)
        if name is None:
            raise SubmitError("this cluster has no default partition; choose one with PARTITION=")
    elif name not in names:
        raise SubmitError(f"PARTITION={name}: unknown partition (this cluster has: {', '.join(sorted(set(names)))})")
    nodes = [
        line.split() for line in _run(["sinfo", "-h", "-N", "-p", name, "-o", "%N %G %c"]).splitlines() if line.strip()
    ]
    if not nodes:
        raise SubmitError(f"PARTITION={name} has no nodes")
    info = _run(["scontrol", "show", "partition", name, "-o"])
    grace = re.search(r"\bGraceTime=(\d+)", info)
    preemptable = re.search(r"\bPreemptMode=(\S+)", info)
    preempted = preemptable is not None and preemptable.group(1) not in ("OFF", "NONE")
    return Partition(
        name,
        min(gres_gpus(g) for _, g, _ in nodes),
        min(int(c.rstrip("+")) for _, _, c in nodes),
        int(grace.group(1)) if grace and preempted else None,
        tuple(sorted(set().union(*(gres_gpu_types(g) for _, g, _ in nodes)))),
    )


def has_pyxis() -> bool:
    """Whether this cluster's srun has the Pyxis plugin (srun --container-image)."""
    out = subprocess.run(["srun", "--help"], capture_output=True, text=True)
    return "--container-image" in out.stdout


# ---- the job ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """What will be asked of Slurm, checked, with the reason for each value."""

    nodes: int
    gpus_per_node: int  # 0: one CPU process per node
    cpus_per_node: int  # CPUs of each node for the launcher, the ranks and their data loaders
    config: Path
    run_dir: Path
    overrides: list[str]
    time: str | None  # Slurm time limit ("90", "01:30:00", "1-00:00:00"); None: partition default
    partition: str | None  # None: the cluster's default partition
    container: str | None  # .sqsh/.sif file or image reference; None: no container
    runtime: str | None  # "pyxis" or "apptainer" (with a container)
    net_if: str | None  # network interface NCCL and gloo use (multi-homed nodes); None: their choice
    warn_seconds: int  # time-limit warning sent this long before the limit
    max_attempts: int  # attempts in a row without a new checkpoint before giving up
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # resource -> why this value
    # The fewest nodes the job may start, or be requeued, on (Slurm's --nodes=MIN-NODES): after a node
    # dies the job goes on with the nodes left; None: exactly `nodes`.
    min_nodes: int | None = None
    gpu_mem_gb: str = ""  # GPU_MEM_GB: memory of one GPU in GB; empty: from the partition's GPU type
    memory: str = ""  # the memory estimate's breakdown, per part (printed by --dry-run)
    # health.max_excluded of the job's config (check_config sets it): the requeue check gets it from
    # here, never from the run dir, where anyone who can write it could raise it. 0: exclude none.
    max_excluded: int = 0
    plan: tuple = ()  # lines: batch arithmetic, checkpoint interval, expected duration (printed by --dry-run)

    @property
    def nproc_per_node(self) -> int:
        return self.gpus_per_node or 1

    @property
    def node_counts(self) -> range:
        """Every node count the job may run on."""
        return range(self.min_nodes or self.nodes, self.nodes + 1)

    @property
    def nodes_text(self) -> str:
        """--nodes as Slurm takes it: 4, or the range 3-4."""
        return f"{self.min_nodes}-{self.nodes}" if self.min_nodes and self.min_nodes < self.nodes else str(self.nodes)

    def train_args(self) -> list[str]:
        """The launcher's trainer arguments."""
        return ["--config", str(self.config), f"run_dir={self.run_dir}", *self.overrides]


def _time_minutes(time_limit: str) -> float:
    """Minutes in a Slurm time limit ("M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S")."""
    days, _, rest = time_limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
    else:
        hours, minutes, seconds = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    return int(days or 0) * 1440 + hours * 60 + minutes + seconds / 60


def _filesystem(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) that holds path (or its nearest existing parent)."""
    best = ("/", "unknown")
    real = os.path.realpath(path)
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
            best = (mount, fstype)
    return best


def check_shared(path: Path, nodes: int, what: str = "RUN_DIR") -> None:
    """Refuse a path that other nodes surely cannot see (tmpfs, /tmp, ...)."""
    if nodes < 2:
        return
    real = os.path.realpath(path)
    mount, fstype = _filesystem(path)
    if fstype in NODE_LOCAL_FSTYPES or any(real == p or real.startswith(p + "/") for p in NODE_LOCAL_PREFIXES):
        raise SubmitError(
            f"{what} {path} is node-local ({fstype} at {mount}); a {nodes}-node job needs it on a filesystem "
            f"every node sees (a shared filesystem such as your home or project space)"
        )


def container_image(text: str, runtime: str | None) -> tuple[str, str]:
    """(image as the runtime takes it, runtime) for a CONTAINER value.

    Files: x.sqsh (Enroot/Pyxis), x.sif (Apptainer); they must exist. References: Pyxis's
    'nvcr.io#nvidia/pytorch:25.01-py3' or 'ubuntu:22.04', or 'docker://nvcr.io/nvidia/pytorch:25.01-py3',
    which Pyxis gets in its own form and Apptainer as it is."""
    is_file = text.endswith((".sqsh", ".sif")) or text.startswith(("/", "./", "../", "~"))
    if is_file:
        path = Path(text).expanduser().resolve()
        if not path.is_file():
            raise SubmitError(
                f"CONTAINER={text}: no such file (give an image file, or a registry reference such as "
                f"nvcr.io#nvidia/pytorch:25.01-py3)"
            )
        runtime = runtime or ("apptainer" if text.endswith(".sif") else "pyxis")
        return str(path), runtime
    runtime = runtime or "pyxis"
    if not re.fullmatch(r"(docker://)?[\w.\-/:#@]+", text):
        raise SubmitError(f"CONTAINER={text}: not an image file or registry reference")
    if runtime == "pyxis" and text.startswith("docker://"):
        ref = text[len("docker://") :]
        first, sep, rest = ref.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):  # a registry host
            ref = f"{first}#{rest}"
        return ref, runtime
    if runtime == "apptainer" and "#" in text:
        registry, _, rest = text.partition("#")
        return f"docker://{registry}/{rest}", runtime
    return text, runtime


def choose_run_dir(given: str, from_args: list[str], config: Path) -> tuple[Path, str]:
    """(run dir, where it came from): RUN_DIR, else ARGS run_dir=, else the config's run_dir (a
    relative one from the current folder, as `make run` reads it), else runs/<config>-<date> in the
    repository. All but the last name the same folder each time: the same command again resumes."""
    from trainer.config import ConfigError, _read_yaml

    asked = ([f"RUN_DIR={given}"] if given else []) + [f"ARGS run_dir={p}" for p in from_args]
    for text, said in zip(([given] if given else []) + from_args, asked):
        _refuse_object_storage(text, said)
    named = {Path(p).expanduser().resolve() for p in ([given] if given else []) + from_args}
    if len(named) > 1:
        raise SubmitError(f"{' and '.join(asked)} name different run directories; give one of them")
    if named:
        return named.pop(), " and ".join(a.split("=", 1)[0] + "=" for a in asked)
    try:
        in_config = _read_yaml(str(config)).get("run_dir")
    except ConfigError as e:
        raise SubmitError(str(e)) from None
    if in_config:
        _refuse_object_storage(str(in_config), f"run_dir: {in_config} in {config.name}")
        return Path(str(in_config)).expanduser().resolve(), f"run_dir in {config.name}"
    return (
        (REPO_DIR / "runs" / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}").resolve(),
        "a new folder: neither RUN_DIR, ARGS run_dir= nor the config names one",
    )


def _refuse_object_storage(text: str, said: str) -> None:
    """An s3:// run dir is no folder a Slurm job can live in: Path() would make it a local folder named
    `s3:`, and the job's requeue check (trainer/launchers/requeue.py) and health records read the run
    dir as a folder on every node."""
    if text.startswith(SCHEME):
        raise SubmitError(
            f"{said}: a Slurm job's run dir is a folder on the cluster's shared filesystem (its batch script, "
            f"logs, requeue and health records live there), not object storage; give a shared folder, or run "
            f"s3:// run dirs with make run or make submit-k8s (docs/checkpoints.md)"
        )


def check_run_dir_text(run_dir: Path, launcher: str) -> None:
    """Refuse a run dir that the batch script's #SBATCH --output line cannot hold as it is: sbatch
    cannot escape a line break, and Slurm reads '%' and '\\' in a log file name as its own patterns.
    submitit quotes its #SBATCH lines the shell's way, which sbatch does not read: there only the
    characters that need no quoting pass."""
    text = str(run_dir)
    if bad := re.search(r"[\x00-\x1f\x7f]", text):
        raise SubmitError(
            f"RUN_DIR={text!r}: a control character ({bad.group()!r}) cannot stand in the batch "
            f"script's #SBATCH lines; choose a folder name without one"
        )
    for char, name in (("%", "a '%'"), ("\\", "a backslash")):
        if char in text:
            raise SubmitError(
                f"RUN_DIR={text!r}: {name}, which Slurm's log file name (#SBATCH --output) reads as "
                f"a pattern; choose a folder name without one"
            )
    if launcher == "submitit" and re.search(r"[^\w@+=:,./-]", text):
        raise SubmitError(
            f"RUN_DIR={text!r}: submitit writes it into #SBATCH lines quoted for the shell, which "
            f"sbatch does not read; use letters, digits and @+=:,./- only, or LAUNCHER=sbatch"
        )


def parse_job(args: argparse.Namespace, partition: Partition) -> Job:
    """Check every input that can be checked on the login node; raise SubmitError."""

    def number(name: str, text: str, minimum: int) -> int:
        if not re.fullmatch(r"\d+", text or "") or int(text) < minimum:
            raise SubmitError(f"{name}={text!r}: expected a whole number >= {minimum}")
        return int(text)

    def per_node(name: str, text: str, minimum: int, have: int, unit: str, why_default: str) -> tuple[int, str]:
        """(value, why): what was asked, at most what the partition's nodes have; else all of it."""
        if not text:
            return have, why_default
        value = number(name, text, minimum)
        if value > have:
            raise SubmitError(
                f"{name}={value} but the nodes of partition {partition.name} have {have} {unit}; "
                f"use {name}={have} or fewer"
            )
        return value, name

    reasons = {}
    nodes = number("NODES", args.nodes, 1)
    min_nodes = number("MIN_NODES", args.min_nodes, 1) if args.min_nodes else None
    if min_nodes is not None and min_nodes > nodes:
        raise SubmitError(f"MIN_NODES={min_nodes} is more than NODES={nodes}; the job runs on MIN_NODES..NODES nodes")
    gpus, reasons["gpus_per_node"] = per_node(
        "GPUS_PER_NODE",
        args.gpus_per_node,
        0,
        partition.gpus_per_node,
        "GPU(s) each (gres)",
        f"every GPU of a node of partition {partition.name} (gres gpu:{partition.gpus_per_node})"
        if partition.gpus_per_node
        else f"partition {partition.name} declares no GPUs: one CPU process per node",
    )
    cpus, reasons["cpus_per_node"] = per_node(
        "CPUS_PER_NODE",
        args.cpus_per_node,
        1,
        partition.cpus_per_node,
        "CPUs each",
        f"all CPUs of a node of partition {partition.name}: the launcher, its {gpus or 1} rank(s) and their data "
        f"loaders share them",
    )
    warn = number("WARN", args.warn_seconds, 1)
    max_attempts = number("MAX_ATTEMPTS", args.max_attempts, 1)
    from trainer.config import find_config

    config = Path(find_config(args.config)).resolve()  # a shipped config's name too
    if not config.is_file():
        raise SubmitError(f"CONFIG={args.config}: no such file")
    overrides, args_run_dirs = [], []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SubmitError(f"ARGS: {item!r} is not key=value")
        if key != "run_dir":
            overrides.append(item)
        elif value:
            args_run_dirs.append(value)
    run_dir, reasons["run_dir"] = choose_run_dir(args.run_dir, args_run_dirs, config)
    check_run_dir_text(run_dir, args.launcher)
    try:
        check_shared(run_dir, nodes)
    except SubmitError as e:
        if not args.dry_run:
            raise
        print(f"submit: warning: {e}; a submission is refused, the dry run goes on to show the plan", file=sys.stderr)
    time_limit = args.time or None
    if time_limit is not None:
        if not TIME_FORMAT.match(time_limit):
            raise SubmitError(f"TIME={time_limit!r}: use minutes, H:MM:SS or D-HH:MM:SS")
        if _time_minutes(time_limit) * 60 <= warn:
            raise SubmitError(f"TIME={time_limit} is not longer than the {warn} s time-limit warning (WARN)")
    container = runtime = None
    if args.container:
        container, runtime = container_image(args.container, args.container_runtime or None)
        if runtime == "apptainer" and args.launcher == "submitit":
            raise SubmitError("CONTAINER is supported by the sbatch launcher only (LAUNCHER=sbatch)")
        for path, what in ((run_dir, "RUN_DIR"), (REPO_DIR, "the repository")):
            if re.search(r"[,:]", str(path)):
                raise SubmitError(
                    f"{what} {path}: ',' and ':' separate the container's mounts (--container-mounts, "
                    f"--bind); choose a folder without them"
                )
    else:  # the nodes run this checkout and this interpreter: say so if they look out of their reach
        for path, what in ((REPO_DIR, "the repository"), (Path(sys.executable).parent, "the Python environment")):
            try:
                check_shared(path, nodes, what)
            except SubmitError as e:  # a warning: some sites share /tmp, and the local test cluster does
                print(f"submit: warning: {e}; if they cannot, the job fails at start", file=sys.stderr)
    if args.net_if and not re.fullmatch(r"[\w.\-:^,]+", args.net_if):
        raise SubmitError(f"NET_IF={args.net_if!r}: not an interface name (e.g. ib0, or ^docker,lo to exclude)")
    return Job(
        nodes=nodes,
        gpus_per_node=gpus,
        cpus_per_node=cpus,
        config=config,
        run_dir=run_dir,
        overrides=overrides,
        time=time_limit,
        partition=args.partition or None,
        container=container,
        runtime=runtime,
        net_if=args.net_if or None,
        warn_seconds=warn,
        max_attempts=max_attempts,
        reasons=reasons,
        gpu_mem_gb=args.gpu_mem_gb,
        min_nodes=min_nodes,
    )


def gpu_memory(job: Job, partition: Partition) -> tuple[int | None, str]:
    """(bytes of one GPU of the job, what they are): GPU_MEM_GB, else the partition's GPU type (the
    smallest where its nodes have several); (None, why) where neither says it: then the job is not
    checked (gres without a type, gpu:8, is common) and the dry run says how to check it."""
    from trainer.preflight.memory import gpu_type_bytes

    if job.gpu_mem_gb:
        try:
            value = float(job.gpu_mem_gb)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise SubmitError(f"GPU_MEM_GB={job.gpu_mem_gb!r}: give the memory of one GPU in GB, e.g. 80")
        return int(value * 1e9), f"GPU_MEM_GB={job.gpu_mem_gb}"
    if not partition.gpu_types:
        return None, (
            f"not checked: the nodes of partition {partition.name} name no GPU type in gres, so their "
            f"memory is unknown; give it to check: GPU_MEM_GB=80 (--gpu-mem-gb)"
        )
    known = {t: gpu_type_bytes(t) for t in partition.gpu_types}
    unknown = [t for t, b in known.items() if b is None]
    if unknown:
        return None, (
            f"not checked: partition {partition.name} has GPUs of type {', '.join(unknown)} (gres), whose "
            f"memory trainer.preflight.memory does not know; give it to check: GPU_MEM_GB=80 (--gpu-mem-gb)"
        )
    smallest = min(known, key=known.get)
    return known[smallest], f"{smallest} (gres of partition {partition.name})"


def _check_gpu_memory(job: Job, partition: Partition, cfg) -> None:
    """The memory preflight for the partition's GPUs, on the fewest nodes the job may run on (the
    most memory per GPU); its outcome goes into job.reasons and job.memory."""
    from trainer.config import ConfigError
    from trainer.preflight import memory

    nodes = job.node_counts[0]
    world = nodes * job.nproc_per_node
    have, what = gpu_memory(job, partition)
    if have is None:
        job.reasons["memory"] = what
        return
    try:
        need = memory.preflight(cfg, world, job.gpus_per_node, have, what, nodes=nodes, nodes_option="NODES={}")
    except ConfigError as e:
        raise ConfigError(f"{job.config}: {e}") from None
    job.reasons["memory"] = (
        f"about {memory.gb(need.total)} per GPU estimated, of the {memory.gb(have)} of {what} ({need.total / have:.0%})"
    )
    warning = memory.headroom_warning(cfg, world, job.gpus_per_node, have, need, nodes=nodes, nodes_option="NODES={}")
    if warning:
        job.reasons["memory"] += f"; warning: {warning}"
    job.memory = need.breakdown("    ")


def check_node_range(cfg, job: Job) -> None:
    """Refuse a node range (MIN_NODES..NODES) with a node count whose ranks cannot share
    train.global_batch_size: after a node dies the job resumes on fewer nodes with the same global
    batch (the accumulation recomputed), and must not then stop on bad input."""
    import math

    from trainer.config import resolve_batch

    if len(job.node_counts) < 2:
        return
    bad = []
    tp = cfg.parallel.tp  # the global batch is divided over the data-parallel ranks: the world over tp
    for n in job.node_counts:
        world = n * job.nproc_per_node
        t = resolve_batch(cfg, world).train
        per_rank, rest = divmod(t.global_batch_size, world // tp)
        if rest or (t.micro_batch_size and per_rank % t.micro_batch_size):
            bad.append(n)
    if not bad:
        return
    good = [n for n in job.node_counts if n not in bad]
    micro = cfg.train.micro_batch_size or 1
    fits = math.lcm(*(n * job.nproc_per_node // tp * micro for n in job.node_counts))
    unit = "ranks" if tp == 1 else "data-parallel ranks"
    counts = ", ".join(f"{n} ({n * job.nproc_per_node // tp} {unit})" for n in bad)
    works = f"node counts that work: {', '.join(map(str, good))}" if good else "no node count in the range works"
    micro_text = f" x train.micro_batch_size {micro}" if cfg.train.micro_batch_size else ""
    raise SubmitError(
        f"MIN_NODES={job.min_nodes} NODES={job.nodes}: train.global_batch_size {cfg.train.global_batch_size} "
        f"cannot be shared by the ranks of {counts}{micro_text}; {works}; narrow the range, or use a "
        f"train.global_batch_size every count divides, e.g. {fits}"
    )


def check_config(job: Job, partition: Partition | None = None, planning: bool = False) -> float:
    """Validate the config for the job's shape (not this machine's devices), and that it fits the
    GPUs' memory (with `partition`); return the estimated seconds of one save, and refuse a warning
    too short for it. A run dir that holds a run is continued with its own config (config.load_run);
    `planning` (a dry run): data files and a run dir this machine cannot see are warnings."""
    from trainer.config import ConfigError
    from trainer.preflight.interval import save_seconds  # the parameters counted on the meta device: torch
    from trainer.preflight.startup import Target, preflight

    try:
        overrides = [f"run_dir={job.run_dir}", *job.overrides]
        ready = preflight(Target.slurm(job.nodes, job.nproc_per_node, planning), str(job.config), overrides)
        cfg = ready.cfg  # resolved for the job's NODES x GPUS_PER_NODE processes
        check_node_range(cfg, job)
        job.max_excluded = cfg.health.max_excluded
        for line in [*ready.notes, *(f"warning: {w}" for w in ready.warnings)]:
            print(line)
        if job.gpus_per_node and partition is not None:
            _check_gpu_memory(job, partition, cfg)
        if planning:
            from trainer.preflight.check import plan_lines

            job.plan = tuple(plan_lines(cfg, job.nproc_per_node, job.nodes, "GPUS_PER_NODE"))
    except ConfigError as e:
        raise SubmitError(str(e)) from None
    estimate, how = save_seconds(cfg, job.nodes, str(job.run_dir))
    budget = signals.shutdown_budget(job.warn_seconds)
    if budget < estimate:
        need = int(estimate) + signals.EXIT_MARGIN_S + 1
        raise SubmitError(
            f"WARN={job.warn_seconds} leaves the ranks {budget} s to save, but one save takes about "
            f"{estimate:.0f} s ({how}); use --warn-seconds {need} or more"
        )
    job.reasons["save"] = f"about {estimate:.1f} s per save ({how}); the ranks get {budget} s after the warning"
    return estimate


# ---- sbatch launcher ----------------------------------------------------------------------------


def sbatch_quote(value: str) -> str:
    """value as one argument of an #SBATCH line. sbatch splits those lines at blanks, ends them at an
    unescaped '#', toggles quoting at '"', and takes a backslash to escape the next character
    (Slurm's _get_argument); a line break cannot be escaped, and parse_job refuses one."""
    if re.search(r"[\x00-\x1f\x7f]", value):
        raise ValueError(f"{value!r}: a control character cannot stand in an #SBATCH line")
    return re.sub(r'([\s"#\\])', r"\\\1", value)


def render_sbatch(
    job: Job, repo_dir: Path = REPO_DIR, python: str = sys.executable, host_python: str = "python3"
) -> str:
    """The batch script for job. Lines whose only placeholder is empty are left out.

    Every value is quoted for where it lands: on #SBATCH lines as sbatch reads them, elsewhere as a
    bash word (shlex.quote). The placeholders that stand for several words (CONTAINER_OPTIONS,
    CONTAINER_EXEC, NET_EXPORT, TRAIN_ARGS) are built here from words quoted one by one."""
    q = shlex.quote
    if job.runtime == "apptainer":
        nv = ["--nv"] if job.gpus_per_node else []
        container_options = ""
        container_exec = " ".join(
            [
                "apptainer",
                "exec",
                *nv,
                "--bind",
                q(f"{repo_dir},{job.run_dir}"),
                "--pwd",
                q(str(repo_dir)),
                q(job.container),
            ]
        )
    elif job.runtime == "pyxis":
        container_options = (
            f"--container-image={q(job.container)} "
            f"--container-mounts={q(f'{repo_dir}:{repo_dir},{job.run_dir}:{job.run_dir}')} "
            f"--container-workdir={q(str(repo_dir))}"
        )
        container_exec = ""
    else:
        container_options = container_exec = ""
    net = f"NCCL_SOCKET_IFNAME={q(job.net_if)} GLOO_SOCKET_IFNAME={q(job.net_if)}" if job.net_if else ""
    words = {  # already bash words
        "NET_EXPORT": f"export {net}" if net else "",
        "CONTAINER_OPTIONS": container_options,
        "CONTAINER_EXEC": container_exec,
        "TRAIN_ARGS": " ".join(q(a) for a in job.train_args()),
    }
    values = {  # quoted below for the line they land in
        "JOB_NAME": f"train-{job.run_dir.name}",
        "NODES": job.nodes_text,
        "GPUS_PER_NODE": str(job.gpus_per_node) if job.gpus_per_node else "",
        "CPUS_PER_NODE": str(job.cpus_per_node),
        "PARTITION": job.partition or "",
        "TIME": job.time or "",
        "RUN_DIR": str(job.run_dir),
        "WARN_SECONDS": str(job.warn_seconds),
        "REPO_DIR": str(repo_dir),
        # Inside a container the image's python trains; the requeue check runs on the host.
        "TRAIN_PYTHON": "python3" if job.container else python,
        "HOST_PYTHON": host_python if job.container else python,
        "NPROC_PER_NODE": str(job.nproc_per_node),
        # Left out for a node range: sbatch would count the tasks from the fewest nodes (3 of 3-4) and
        # allocate no more nodes than tasks; srun starts one launcher per node either way.
        "NTASKS_PER_NODE": "1" if len(job.node_counts) < 2 else "",
        "MAX_ATTEMPTS": str(job.max_attempts),
        "MAX_EXCLUDED": str(job.max_excluded),
    }
    lines = []
    for line in TEMPLATE.read_text().splitlines():
        names = re.findall(r"\{\{(\w+)\}\}", line)
        text = {n: words[n] if n in words else values[n] for n in names}
        if (
            names
            and all(text[n] == "" for n in names)
            and re.fullmatch(r"\s*(#SBATCH --[\w-]+=)?(\{\{\w+\}\}\s*)+\\?", line)
        ):
            continue
        sbatch_line = line.startswith("#SBATCH")
        for n in names:
            if n in words and sbatch_line:
                raise ValueError(f"{TEMPLATE}: {{{{{n}}}}} stands for shell words; it cannot be on an #SBATCH line")
            value = words[n] if n in words else sbatch_quote(values[n]) if sbatch_line else q(values[n])
            line = line.replace("{{" + n + "}}", value)
        lines.append(re.sub(r"\s+\\$", lambda _: " \\", line.rstrip()))
    return "\n".join(lines) + "\n"


def describe(job: Job, partition: Partition) -> str:
    """The resources the job asks for, each with why (printed by --dry-run and on submission)."""
    rows = [
        (
            "nodes",
            job.nodes_text,
            "NODES"
            if len(job.node_counts) < 2
            else "MIN_NODES-NODES: Slurm starts it on as many as it can give, "
            "and requeues it on the nodes left when one dies; the same global batch on each count",
        ),
        ("GPUs per node", str(job.gpus_per_node), job.reasons.get("gpus_per_node", "")),
        (
            "ranks",
            f"{job.nodes * job.nproc_per_node} ({job.nodes} x {job.nproc_per_node})"
            + (f", {job.min_nodes * job.nproc_per_node} on {job.min_nodes} nodes" if len(job.node_counts) > 1 else ""),
            "one per GPU, or one per node without GPUs",
        ),
        ("CPUs per node", str(job.cpus_per_node), job.reasons.get("cpus_per_node", "")),
        (
            "memory",
            "all of each node (--mem=0)",
            "whole nodes (--exclusive): one job per node; EDIT the script on sites that share nodes",
        ),
        (
            "partition",
            job.partition or f"{partition.name} (default)",
            "PARTITION" if job.partition else "the cluster's default",
        ),
        ("time limit", job.time or "the partition's default", "TIME" if job.time else "no TIME given"),
        (
            "stop warning",
            f"SIGUSR1 {job.warn_seconds} s before the limit",
            f"WARN; the ranks get {signals.shutdown_budget(job.warn_seconds)} s "
            f"to save, {signals.EXIT_MARGIN_S} s stay for the requeue check",
        ),
        (
            "preemption",
            f"GraceTime {partition.grace_time_s} s" if partition.grace_time_s is not None else "not preemptable",
            f"partition {partition.name}",
        ),
        ("GPU memory", job.reasons.get("memory", "not checked (no GPUs)"), ""),
        ("checkpoint save", job.reasons.get("save", "not estimated"), ""),
        ("network", job.net_if or "NCCL's and gloo's own choice", "NET_IF" if job.net_if else "no NET_IF given"),
        ("container", f"{job.container} ({job.runtime})" if job.container else "none: this checkout and venv", ""),
        (
            "run dir",
            str(job.run_dir),
            f"{job.reasons.get('run_dir', 'given')}; must be on a filesystem every node "
            f"sees; checked on the nodes at start",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {name:<{width}}  {value}" + (f"   [{why}]" if why else "") for name, value, why in rows)


def own_folder(path: Path, mode: int = 0o755) -> None:
    """Make the folder `path` (its parents too), or refuse in one line what is there already and
    is not a folder of the user's that only the user can write: a link, a FIFO, another user's
    folder. Slurm writes the job's logs into <run_dir>/slurm/, and submitit its pickles."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        files.make_folder(path, mode)
        st = os.lstat(path)
    except OSError as e:
        raise SubmitError(f"{e}; remove it, or give another RUN_DIR") from None
    if st.st_uid != os.geteuid():
        raise SubmitError(
            f"{path} is owned by uid {st.st_uid}, not by you: another user could read or replace what the job "
            f"writes there; remove it, or give another RUN_DIR"
        )
    if files.others_can_write(st) or (mode & 0o077) == 0 and st.st_mode & 0o077:
        os.chmod(path, mode)  # the user's own folder, left open by an umask or an older submission


def submit_sbatch(job: Job) -> str:
    """Render, save and submit the batch script; return the job id.

    sbatch gets the script on its standard input, the very bytes rendered here: a copy is saved in
    <run_dir>/slurm/train.sbatch (written through trainer/rundir/files.py: a link or FIFO planted there is
    replaced, never written through), but what Slurm runs is never read back from the run dir,
    where someone else could have swapped it between the write and sbatch's read."""
    own_folder(job.run_dir / "slurm")
    script = job.run_dir / "slurm" / "train.sbatch"
    text = render_sbatch(job)
    files.write_text(script, text)
    out = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True, text=True, cwd=REPO_DIR)
    if out.returncode != 0:
        raise SubmitError(f"sbatch refused the job: {out.stderr.strip()}")
    job_id = out.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}: {job.nodes_text} node(s) x {job.nproc_per_node} process(es)")
    print(f"  log:     {job.run_dir}/slurm/{job_id}.out")
    print(f"  run dir: {job.run_dir}")
    print(f"  script:  {script}")
    return job_id


# ---- submitit launcher --------------------------------------------------------------------------


class LaunchTask:
    """One submitit task per node: runs trainer.launch for that node, in this process.

    Slurm signals (under proctrack/cgroup: only) this process, the job step's task; the launcher's
    torchrun agent forwards the signal to every rank, which save and stop. Task 0 then requeues the
    job through trainer.requeue, exactly like the batch script; submitit's own checkpoint() is not
    used, so that every node acts on the signal it gets itself."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def __call__(self) -> dict:
        import submitit

        env = submitit.JobEnvironment()
        port = self._rendezvous_port(env)
        from trainer.launchers import torchrun

        os.environ[torchrun.NODES_ENV] = self.job.nodes_text  # as the batch script exports it
        code = torchrun.main(
            [
                f"--nnodes={env.num_nodes}",
                f"--node-rank={env.node}",
                f"--nproc-per-node={self.job.nproc_per_node}",
                f"--rdzv-endpoint={env.hostnames[0]}:{port}",
                f"--rdzv-id={env.job_id}",
                f"--grace-seconds={self.job.warn_seconds}",
                *self.job.train_args(),
            ]
        )
        if code == HEALTH_FAILED and env.global_rank != 0:
            sys.exit(code)  # ends the other tasks (srun --kill-on-bad-exit): task 0 requeues without this node
        if env.global_rank == 0:
            job_id = env.job_id.split("_")[0]
            status = requeue_check(self.job.run_dir, code, self.job.max_attempts, job_id, self.job.max_excluded)
            from trainer.rundir import layout

            if layout.read_status(self.job.run_dir).get("state") != "finished":
                if status != 0:
                    raise RuntimeError(f"training stopped with exit code {code} and is not requeued (see the log)")
                sys.exit(-1)  # requeued: this attempt does not count as a result
        return {"run_dir": str(self.job.run_dir), "exit_code": code}

    def _rendezvous_port(self, env) -> int:
        from trainer.dist import free_port

        """A free port on the first node, chosen there by task 0 and read by the others from the run dir."""
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        path = self.job.run_dir / "slurm" / f"rdzv-{env.job_id}-{restart}.json"
        if env.global_rank == 0:
            port = free_port()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"port": port}))
            tmp.replace(path)
            return port
        deadline = time.time() + 120
        while not path.is_file():
            if time.time() > deadline:
                raise RuntimeError(
                    f"task {env.global_rank}: no rendezvous port from task 0 in {path} after 120 s; "
                    f"is the run dir on a filesystem every node sees?"
                )
            time.sleep(0.5)
        return json.loads(path.read_text())["port"]


def _submitit_minutes(time_limit: str | None) -> int:
    return max(1, int(round(_time_minutes(time_limit)))) if time_limit else 60


def submit_submitit(job: Job) -> str:
    """Submit job through submitit; return the job id."""
    if job.runtime is not None:
        raise SubmitError("CONTAINER is supported by the sbatch launcher only (LAUNCHER=sbatch)")
    # The warning signal submitit asks Slurm for (#SBATCH --signal=USR1@WARN).
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = "USR1"
    import submitit

    # submitit's pickles run as you on the nodes: its folder is made private (0700) and checked
    # right before use, with every folder above it (files.replaceable), and the nodes check the
    # pickle again before unpickling it (trainer/launchers/submitit_guard.py, submitit's `python`).
    own_folder(job.run_dir / "slurm")
    own_folder(job.run_dir / "slurm" / "submitit", 0o700)
    folder = Path(os.path.realpath(job.run_dir / "slurm" / "submitit"))
    why = files.replaceable(folder)
    if why:
        raise SubmitError(
            f"LAUNCHER=submitit: {why}; the nodes unpickle and run what is in {folder}. Make the run dir and the "
            f"folders above it writable by you only (chmod go-w), or use LAUNCHER=sbatch"
        )
    python = f"{shlex.quote(sys.executable)} -u -m trainer.launchers.submitit_guard"
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_python=python)
    srun_args = ["--open-mode=append", f"--cpus-per-task={job.cpus_per_node}"]  # appended logs after a requeue
    srun_args.append("--kill-on-bad-exit=1")  # a node that fails its health check ends the others, as sbatch's
    if len(job.node_counts) > 1:  # a range: as the batch script does (render_sbatch, NTASKS_PER_NODE)
        srun_args.append("--ntasks-per-node=1")
    params = dict(
        nodes=job.nodes,
        cpus_per_task=job.cpus_per_node,
        timeout_min=_submitit_minutes(job.time),
        name=f"train-{job.run_dir.name}",
        slurm_signal_delay_s=job.warn_seconds,
        slurm_srun_args=srun_args,
        # A node range (MIN_NODES) goes to sbatch as it is: submitit's `nodes` is one number.
        slurm_additional_parameters={"requeue": True, "exclusive": True, "mem": "0", "nodes": job.nodes_text},
    )
    if len(job.node_counts) < 2:
        params["tasks_per_node"] = 1
    if job.gpus_per_node:
        params["gpus_per_node"] = job.gpus_per_node
    if job.partition:
        params["slurm_partition"] = job.partition
    if job.net_if:
        net_if = shlex.quote(job.net_if)  # submitit writes these lines into its batch script as they are
        params["slurm_setup"] = [f"export NCCL_SOCKET_IFNAME={net_if} GLOO_SOCKET_IFNAME={net_if}"]
    executor.update_parameters(**params)
    umask = os.umask(0o077)  # submitit's pickles and script: readable and writable by you only
    try:
        submitted = executor.submit(LaunchTask(job))
    finally:
        os.umask(umask)
    print(f"submitted job {submitted.job_id} (submitit): {job.nodes_text} node(s) x {job.nproc_per_node} process(es)")
    print(f"  log:     {folder}/{submitted.job_id}_0_log.out (task 0; _1_, _2_... for the other nodes)")
    print(f"  run dir: {job.run_dir}")
    return submitted.job_id


# ---- command line -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("submit", "Submit training to Slurm.")
    p.add_argument("--nodes", default="1", help="number of nodes")
    p.add_argument(
        "--min-nodes",
        default="",
        help="fewest nodes the job may run on (--nodes=MIN-NODES): after a node dies it goes on with the rest; "
        "empty: NODES",
    )
    p.add_argument("--gpus-per-node", default="", help="GPUs per node; empty: all GPUs of the partition's nodes (gres)")
    p.add_argument("--cpus-per-node", default="", help="CPUs per node; empty: all CPUs of the partition's nodes")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--run-dir", default="", help="run directory on a filesystem every node sees")
    p.add_argument("--time", default="", help="Slurm time limit; empty: the partition's default")
    p.add_argument("--partition", default="", help="empty: the cluster's default partition")
    p.add_argument("--container", default="", help=".sqsh or .sif file, or a registry image reference")
    p.add_argument(
        "--container-runtime",
        default="",
        choices=["", "pyxis", "apptainer"],
        help="empty: apptainer for .sif files, pyxis otherwise",
    )
    p.add_argument("--net-if", default="", help="network interface for NCCL and gloo (e.g. ib0); empty: their choice")
    p.add_argument("--launcher", default="sbatch", choices=["sbatch", "submitit"])
    p.add_argument(
        "--gpu-mem-gb", default="", help="memory of one GPU in GB; empty: from the partition's GPU type (gres)"
    )
    p.add_argument("--warn-seconds", default="120", help="time-limit warning, seconds before the limit")
    p.add_argument("--max-attempts", default="3", help="attempts without a new checkpoint before giving up")
    p.add_argument("--dry-run", action="store_true", help="print the resources and the batch script; submit nothing")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, key=value")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if not TEMPLATE.is_file():  # a wheel's install: the job runs the trainer from a checkout
            raise SubmitError(f"{TEMPLATE}: not found; submit from a checkout of the repository (make submit)")
        partition = query_partition(args.partition or None)
        job = parse_job(args, partition)
        check_config(job, partition, planning=args.dry_run)
        if job.runtime == "pyxis" and not args.dry_run and not has_pyxis():
            raise SubmitError(
                f"CONTAINER={args.container}: this cluster's srun has no Pyxis plugin "
                f"(--container-image); use an Apptainer .sif, or no container"
            )
        if args.dry_run:
            print(f"# {args.launcher} job, not submitted (DRY_RUN):\n{describe(job, partition)}")
            if job.memory:
                print(f"  the GPU memory estimate, per GPU:\n{job.memory}")
            for line in job.plan:
                print(f"  {line}")
            print()
            print(render_sbatch(job), end="")
            return 0
        print(describe(job, partition))
        if args.launcher == "submitit":
            submit_submitit(job)
        else:
            submit_sbatch(job)
    except SubmitError as e:
        print(f"submit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
