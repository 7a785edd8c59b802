"""Checks a config against itself and this machine before anything starts or is written.

    python -m trainer.check --config configs/default.yaml [--nproc N] [--nnodes K] [key=value ...]

exits 0 with a one-line summary, or 2 with one line saying what is wrong, where and what to do.
`make run` and `make submit` call it before they launch anything; every start checks the config
with `validate` too, once, through the preflight (trainer/preflight/startup.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import sys
import tempfile
import typing
from typing import TYPE_CHECKING

from trainer import cli, ranges
from trainer.config import (
    Config,
    ConfigError,
    eval_data,
    eval_data_problem,
    load_run,
    print_config,
    print_parser,
    resolve,
    resolve_batch,
)
from trainer.models import FamilyError, family_of
from trainer.models import choices as model_choices
from trainer.optim import schedule_warning
from trainer.parallel import pp as pipeline
from trainer.parallel import pp_plan
from trainer.parallel.plan import Plan
from trainer.prepare import token_file_problem
from trainer.rundir import files, objects
from trainer.rundir.layout import RUN_DIR_FILES, RUN_DIR_FOLDERS, WRITTEN_FILES, WRITTEN_FOLDERS

if TYPE_CHECKING:
    import torch


def validate(cfg: Config, world_size: int, *args, **kwargs) -> list[str]:
    """checked()'s warnings (its arguments), the resolved config left out."""
    return checked(cfg, world_size, *args, **kwargs)[0]


def checked(
    cfg: Config,
    world_size: int,
    where: str = "config",
    overrides: list[str] = (),
    ranks_per_node: int | None = None,
    planning: bool = False,
    node_size: int | None = None,
    weights_checked: bool = False,
) -> tuple[list[str], Config]:
    """(warnings, the config resolved for `world_size` processes: config.resolve, run once, by the
    first check that needs the resolved shape or else at the end). Raise ConfigError for the first
    problem found; `where` names the config file, `overrides` are the command line's key=value
    items: a value given there is blamed on the override. With
    `ranks_per_node`, what they need must fit this machine's memory (CPU training; a GPU's memory
    is checked by each rank, check_gpu_memory: asking for it here would create a CUDA context).
    `planning`: the run is for another machine (a GPU target, a dry run from a login node), so the
    data files and the run dir this one cannot see are returned as warnings instead of raised.
    `node_size`: the ranks of one node of the target (make check's NPROC, make submit's GPUS_PER_NODE)
    where no memory is checked here; else ranks_per_node: parallel.tp must divide it.
    `weights_checked`: this node's launcher read model.init_from's weights (config.resolve).
    Only the memory check, the last, imports torch: the config alone is checked without it."""
    warnings: list[str] = [cfg.parallel.deprecated] if cfg.parallel.deprecated else []

    def fail(key: str, message: str):
        raise ConfigError(f"{source(key)}: {key}: {message}")

    def elsewhere(key: str, message: str):
        """A problem of a path that the target machine, not this one, must have."""
        if not planning:
            fail(key, message)
        warnings.append(
            f"{source(key)}: {key}: {message} (not an error when planning for another machine: it must hold there)"
        )

    def source(key: str) -> str:
        field = key.split("[")[0]  # optim.betas[1] was given as optim.betas
        given = [
            item for item in overrides if field == item.split("=")[0] or field.startswith(item.split("=")[0] + ".")
        ]
        return f"override {given[-1]!r}" if given else where

    once: list[Config] = []

    def resolved() -> Config:
        """The config resolved, once; a problem of model.init_from's folder blames where the folder was named."""
        if not once:
            once.append(resolve(cfg, source("model.init_from"), world_size, weights_checked))
        return once[0]

    for key, value in _floats(cfg):
        if not math.isfinite(value):
            fail(key, f"is {value}; give a finite number")
    # The range of every number of the config, declared beside its field (trainer/ranges.py).
    for key, value, allowed in _ranges(cfg):
        if not allowed.allows(value):
            fail(key, f"is {value}; {allowed}")

    if cfg.train.early_stop_patience and not cfg.eval.interval:  # it stops on the eval loss (trainer/early_stop.py)
        fail(
            "train.early_stop_patience",
            f"is {cfg.train.early_stop_patience}, but eval.interval is 0: no evaluation gives a loss to stop on; "
            f"set eval.interval (steps between evaluations) or train.early_stop_patience=0",
        )

    if cfg.eval.interval and cfg.data.eval_fraction is not None and eval_data_problem(cfg.data):  # None: resolved
        fail("eval.interval", f"is {cfg.eval.interval}, but {eval_data_problem(cfg.data)}")

    if "\0" in cfg.health.command:
        fail("health.command", "holds a NUL byte; give a shell command line, e.g. /etc/nhc/nhc")

    # model and data
    m, d = cfg.model, cfg.data
    try:
        family = family_of(m)
    except FamilyError as e:
        fail("model.family", str(e).removeprefix("model.family: "))
    if m.init_from and (family is None or family.hf is None):
        fail("model.init_from", f"applies to the transformer only (model.name is {m.name!r}); remove it")
    if family is None:
        fail("model.name", f"is {m.name!r}; use {model_choices()}")
    family.check(m, d, fail, lambda: resolved().model)
    if d.name == "tokens":  # the family takes token data: the files must fit its vocabulary
        vocab_size = resolved().model.vocab_size
        for key, path in (("data.path", d.path), ("data.eval_path", d.eval_path)):
            if path and os.path.isfile(path):
                _check_sidecar(key, path, d.token_dtype, vocab_size, fail)
    if d.sources:  # several token files mixed by weight
        _check_sources(d, m.seq_len, lambda: resolved().model.vocab_size, fail, elsewhere)
    elif d.name in ("tokens", "imagefolder", "mnist"):
        if not d.path:
            fail("data.path", f"is not set; data.name={d.name} needs it")
        for key, path in (("data.path", d.path), ("data.eval_path", d.eval_path)):
            problem = _data_problem(d, path, m.seq_len) if path else None
            if problem:
                (elsewhere if not os.path.exists(path) else fail)(key, problem)

    from trainer.observe.trackers import SINKS, missing_package

    for name in SINKS:
        problem = getattr(cfg.log, name) and missing_package(name)
        if problem:
            fail(f"log.{name}", problem)

    # batch arithmetic: the global batch is divided over the data-parallel ranks, the world over
    # parallel.tp x parallel.pp (the ranks of one tensor-parallel group and a pipeline's stages share
    # their samples); degrees that do not divide the world are the plan's to refuse, below
    plan = Plan(cfg.parallel, world_size, ranks_per_node=node_size or ranks_per_node)
    if world_size % plan.dims.non_data_parallel_size == 0:
        t, dp = resolve_batch(cfg, world_size).train, plan.dp_size
        degrees = (("cp", plan.dims.cp), ("tp", plan.tp), ("pp", plan.pp))
        split = " x ".join(f"{name} {n}" for name, n in degrees if n > 1)
        ranks = (
            f"{world_size} processes"
            if dp == world_size
            else f"{dp} data-parallel ranks (dp_size: {world_size} / {split})"
        )
        if t.global_batch_size % dp:
            fail(
                "train.global_batch_size", f"{t.global_batch_size} is not divisible by {ranks}; use a multiple of {dp}"
            )
        per_rank = t.global_batch_size // dp
        if t.micro_batch_size is not None and per_rank % t.micro_batch_size:
            fail(
                "train.micro_batch_size",
                f"{t.micro_batch_size} does not divide the {per_rank} samples per rank "
                f"(global_batch_size {t.global_batch_size} / {ranks}); use a divisor of {per_rank}",
            )
        problem = plan.pp > 1 and pipeline.batch_problem(cfg.parallel, per_rank, t.micro_batch_size, ranks)
        if problem:
            fail("train.micro_batch_size" if t.micro_batch_size else "train.global_batch_size", problem)

    # parallelism: the plan's own checks (trainer.parallel.plan, imported without torch)
    if plan.dims.cp > 1 and family.kind != "lm":  # context parallelism, planned: it splits sequences
        fail("parallel.cp", f"is {plan.dims.cp} but model {m.name!r} has no sequence to split; set cp=1")
    split = cfg.parallel.tp > 1 or cfg.parallel.pp > 1 or plan.dims.cp > 1
    for key, message in plan.problems(resolved().model if split else None):  # the model keys tp, pp and cp split
        fail(key, message)
    if cfg.parallel.float8 != "none":  # torchao, compile, the blocks' dimensions; the GPU is each rank's check_float8
        from trainer.parallel.float8 import config_problem

        problem = config_problem(cfg)
        if problem:
            fail("parallel.float8", problem)

    # files
    c = cfg.checkpoint
    if objects.is_remote(c.resume_from):  # downloaded and checked against its manifest at the start (remote.py)
        found = objects.checkpoint_of(c.resume_from)
        if found is None:
            fail(
                "checkpoint.resume_from",
                f"{c.resume_from} is not a checkpoint of an s3:// run dir; give one such as "
                f"s3://BUCKET/PREFIX/checkpoints/step_00000100",
            )
        elif not planning:  # committed: its manifest is there (the bucket's credentials said as run_dir's are)
            _check_store(found[0], source("checkpoint.resume_from"), planning)
            if objects.Store(found[0]).size(objects.step_key(found[1], objects.MANIFEST)) is None:
                fail(
                    "checkpoint.resume_from",
                    f"{c.resume_from} is not a committed checkpoint: it has no {objects.MANIFEST} (a save that "
                    f"never finished, or one retention deleted); give a step whose {objects.MANIFEST} is there",
                )
    elif c.resume_from is not None and os.path.isfile(c.resume_from):
        fail(
            "checkpoint.resume_from",
            f"{c.resume_from} is a file; give the checkpoint folder that holds it, such as "
            f"run_dir/checkpoints/step_00000100",
        )
    elif c.resume_from is not None and not os.path.isdir(c.resume_from):
        fail(
            "checkpoint.resume_from",
            f"{c.resume_from} does not exist; give a checkpoint folder such as run_dir/checkpoints/step_00000100",
        )
    try:
        if objects.is_remote(cfg.run_dir):  # the bucket, reachable with this environment's credentials
            _check_store(cfg.run_dir, source("run_dir"), planning)
        else:
            _check_writable(cfg.run_dir, source("run_dir"))
    except ConfigError as e:
        if not planning:
            raise
        warnings.append(f"{e} (not an error when planning for another machine: it must hold there)")

    # memory: what the ranks of this node need, estimated on the meta device (torch)
    if ranks_per_node and not _cuda_available():
        _check_memory(cfg, world_size, ranks_per_node, fail)
    return warnings, resolved()


def _cuda_available() -> bool:
    """Whether torch sees a GPU here; torch is imported only when asked (validating needs no torch)."""
    import torch

    return torch.cuda.is_available()


def _data_problem(d, path: str, seq_len: int) -> str | None:
    """What is wrong with the data file or folder at `path`, or None."""
    if d.name == "tokens":
        return token_file_problem(path, d.token_dtype, seq_len)
    if d.name == "imagefolder" and not os.path.isdir(path):
        return f"folder {path} does not exist; point it at a folder of class subfolders"
    if d.name == "imagefolder" and not any(e.is_dir() for e in os.scandir(path)):
        return f"{path} has no class folders; put the images in one subfolder per class ({path}/<class>/<image>)"
    if d.name == "mnist" and not d.download and not os.path.isdir(os.path.join(path, "MNIST", "raw")):
        return f"{path}/MNIST/raw does not exist; set data.download=true or copy the MNIST files there"
    return None


def _check_memory(cfg: Config, world_size: int, ranks_per_node: int, fail) -> None:
    """The ranks of this node must fit its memory (trainer.preflight.memory's estimate of a CPU rank)."""
    from trainer.preflight import memory

    have = memory.machine_bytes()
    per_rank = cfg.train.global_batch_size // memory.dp_size(cfg, world_size)
    micro = pipeline.micro_batch(cfg.parallel, per_rank, cfg.train.micro_batch_size)
    profile = memory.measure(cfg)
    need = memory.estimate(cfg, world_size, micro, profile=profile)
    if have is None or need.total * ranks_per_node <= have:
        return
    key = "train.micro_batch_size" if cfg.train.micro_batch_size else "train.global_batch_size"
    one, two = (memory.estimate(cfg, world_size, n, profile=profile).total for n in (1, 2))  # linear in the micro-batch
    fits = (have // ranks_per_node - (2 * one - two)) // (two - one) if two > one else 0
    todo = (
        f"set train.micro_batch_size to {fits} or less (the rest becomes gradient accumulation)"
        if fits >= 1
        else "use a smaller model, fewer ranks per node or more nodes"
    )
    fail(
        key,
        f"one micro-batch of {micro} samples needs about {memory.gb(need.activations)} of activations per rank, "
        f"{memory.gb(need.total * ranks_per_node)} in all for {ranks_per_node} rank(s), but this machine has "
        f"{memory.gb(have)} of memory; {todo}",
    )


def _check_sidecar(key: str, path: str, dtype: str, vocab_size: int, fail) -> None:
    """A token file written by trainer.prepare must fit the model: its dtype, its vocabulary, its ids."""
    from trainer.prepare import read_sidecar, sidecar_path

    try:
        info = read_sidecar(path)
    except (OSError, ValueError) as e:
        fail(key, f"the sidecar {sidecar_path(path)} is unreadable ({e}); run trainer.prepare again or remove it")
    if info is None:
        return
    what = f"{path} was tokenized with {info.get('tokenizer')} ({sidecar_path(path)})"
    if info.get("dtype") != dtype:
        fail(
            "data.token_dtype",
            f"is {dtype} but {what} as {info.get('dtype')}; set data.token_dtype={info.get('dtype')}",
        )
    if info.get("vocab_size", 0) > vocab_size or info.get("max_id", -1) >= vocab_size:
        fail(
            "model.vocab_size",
            f"is {vocab_size} but {what}, vocabulary {info.get('vocab_size')}, largest id "
            f"{info.get('max_id')}; set model.vocab_size={info.get('vocab_size')} or more",
        )


def _check_sources(d, seq_len: int, vocab_size, fail, elsewhere) -> None:
    """data.sources: token files (each one's sidecar agreeing with data.token_dtype and the model's
    vocabulary `vocab_size()`) with positive weights and distinct names, instead of data.path."""
    from trainer.config import SOURCE_LABEL

    if d.path:
        fail("data.sources", f"and data.path ({d.path}) are both set; give the token files in one of them")
    if d.name != "tokens":
        fail("data.sources", f"mixes token files: it needs data.name=tokens (it is {d.name})")
    problem = token_file_problem(d.eval_path, d.token_dtype, seq_len) if d.eval_path else None
    if problem:  # one evaluation file for the whole mixture (its sidecar is checked with data.path's)
        (elsewhere if not os.path.exists(d.eval_path) else fail)("data.eval_path", problem)
    seen: dict[str, int] = {}
    for i, source in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not source.path:
            fail(f"{key}.path", "is not set; give the source's token file")
        if not (math.isfinite(source.weight) and source.weight > 0):
            fail(f"{key}.weight", f"is {source.weight}; give a positive share (relative to the other sources')")
        if not SOURCE_LABEL.fullmatch(source.label):
            fail(
                f"{key}.name",
                f"{source.label!r} may hold letters, digits, '_', '.' and '-' only (1 to 64 of them); it names "
                f"the source in rows (eval_loss/<name>): set data.sources[{i}].name",
            )
        if source.label in seen:
            fail(
                f"{key}.name",
                f"{source.label!r} also names data.sources[{seen[source.label]}]; give each source its own name",
            )
        seen[source.label] = i
        if source.eval_path and d.eval_path:
            fail(f"{key}.eval_path", "and data.eval_path are both set; evaluate on one file or per source")
        for name, path in (("path", source.path), ("eval_path", source.eval_path)):
            problem = token_file_problem(path, d.token_dtype, seq_len) if path else None
            if problem:
                (elsewhere if not os.path.exists(path) else fail)(f"{key}.{name}", problem)
            elif path:
                _check_sidecar(f"{key}.{name}", path, d.token_dtype, vocab_size(), fail)


def _ranges(section, prefix: str = ""):
    """(dotted key, value, Range) of every number of the config whose field declares a range beside
    it, in the order of the sections' fields; a tuple's element as `key[i]`, a null value skipped."""
    hints = typing.get_type_hints(type(section), include_extras=True)
    for field in dataclasses.fields(section):
        value, key = getattr(section, field.name), prefix + field.name
        if dataclasses.is_dataclass(value):
            yield from _ranges(value, key + ".")
            continue
        for allowed in ranges.of(hints[field.name]):
            if allowed.item is not None:
                value_i, key_i = value[allowed.item], f"{key}[{allowed.item}]"
            else:
                value_i, key_i = value, key
            if isinstance(value_i, (int, float)) and not isinstance(value_i, bool):
                yield key_i, value_i, allowed


def _floats(section, prefix: str = ""):
    """(dotted key, value) of every float in the config, tuples included."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        key = prefix + field.name
        if dataclasses.is_dataclass(value):
            yield from _floats(value, key + ".")
        elif isinstance(value, float):
            yield key, value
        elif isinstance(value, tuple):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float))


def _check_store(run_dir: str, where: str, planning: bool) -> None:
    """An s3:// run dir (trainer/rundir/objects.py): s3fs installed, the credentials, the bucket and
    the endpoint, each said in one line; the bucket is not asked when planning for another machine."""
    try:
        store = objects.Store(run_dir)
        if not planning:
            store.check()
    except objects.StoreError as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_writable(run_dir: str, where: str) -> None:
    """The run dir can be created and written: tried, not judged from permission bits (root, ACLs,
    read-only mounts and /proc answer os.access wrongly). A probe folder with a fresh name is made
    in the run dir, or in the nearest folder that exists above it, and removed at once, so ranks
    checking at the same time do not disturb each other and nothing is left behind."""
    if not run_dir:  # abspath('') is the current folder, but the ranks' makedirs('') fails
        raise ConfigError(f"{where}: run_dir: is empty; give the run's folder, e.g. runs/default")
    path = os.path.abspath(run_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{where}: run_dir: {run_dir} is a file, not a folder; choose another run_dir")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{where}: run_dir: cannot create {run_dir}: {existing} is a file; choose another run_dir")
    _check_planted(path, where)
    for name in RUN_DIR_FOLDERS:
        inside = os.path.join(path, name)
        if os.path.exists(inside) and not os.path.isdir(inside):
            raise ConfigError(
                f"{where}: run_dir: {inside} is a file where the run keeps its {name} folder; "
                f"move it away or choose another run_dir"
            )
    for name in RUN_DIR_FILES:
        inside = os.path.join(path, name)
        if os.path.isdir(inside):
            raise ConfigError(
                f"{where}: run_dir: {inside} is a folder where the run writes its {name} file; "
                f"move it away or choose another run_dir"
            )
    probed = [existing] + [os.path.join(path, n) for n in RUN_DIR_FOLDERS if os.path.isdir(os.path.join(path, n))]
    for folder in probed:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".trainer-check-", dir=folder))
        except OSError as e:
            raise ConfigError(
                f"{where}: run_dir: cannot write to {folder} ({e.strerror}); choose a writable run_dir"
            ) from None


def _check_planted(path: str, where: str) -> None:
    """No link, FIFO, device or socket where the run writes or reads one of its files or folders
    (layout.WRITTEN_FILES, WRITTEN_FOLDERS): in a shared run dir someone else may have planted it, to
    have the trainer write through it, copy what it points at, or hang on it. The project never
    follows one (trainer/rundir/files.py); refusing here says so in one line, before anything is written."""
    for name, folder in [(n, False) for n in WRITTEN_FILES] + [(n, True) for n in WRITTEN_FOLDERS]:
        inside = os.path.join(path, name)
        try:
            st = os.lstat(inside)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) or (folder and stat.S_ISDIR(st.st_mode)):
            continue
        if stat.S_ISDIR(st.st_mode):
            continue  # a folder where a file belongs: the check above names the ones it matters for
        kind = files.kind(st.st_mode)
        raise ConfigError(
            f"{where}: run_dir: {inside} is {kind}, where the run keeps its {name} "
            f"{'folder' if folder else 'file'}; the trainer never follows or reads one (someone else may have "
            f"put it there): remove it, and keep the run dir writable by you only"
        )


def check_devices(nproc: int, option: str = "--nproc {}") -> str | None:
    """The number of processes per node must fit this machine's GPUs (ConfigError naming `option`, the
    command's own: `--nproc-per-node={}` for the launcher, `--nproc {}` for the check; make's NPROC
    beside it). Without a GPU, more processes than CPU cores run all the same, sharing the cores (gloo,
    as torchrun runs them: a laptop can try parallel.tp=2 with 2 data-parallel ranks): the warning to
    say then, else None. The cores are this process's (its affinity: a Slurm or container cpuset)."""
    import torch

    if nproc < 1:
        raise ConfigError(f"{option.format(nproc)}: give 1 or more processes")
    if torch.cuda.is_available():
        have = torch.cuda.device_count()
        if nproc > have:
            raise ConfigError(
                f"{option.format(nproc)} processes but this machine has {have} GPU{'s' if have != 1 else ''}; use "
                f"{option.format(have)} or fewer (NPROC={have} under make), or hide the GPUs (CUDA_VISIBLE_DEVICES=) "
                f"to train on the CPU"
            )
        return None
    have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc <= have:
        return None
    return (
        f"{nproc} processes on {have} CPU core(s) (no GPU found): the ranks share the cores, so every step is "
        f"slower than on {have}; fine to try a layout (parallel.tp, data-parallel ranks), not to train fast"
    )


def check_gpus(local_world_size: int) -> None:
    """Each process of a node needs a GPU of its own: NCCL refuses two ranks on one device."""
    import torch

    if not torch.cuda.is_available():
        return
    have = torch.cuda.device_count()
    if local_world_size > have:
        raise ConfigError(
            f"{local_world_size} processes on this node but {have} GPU(s) visible; each process needs its "
            f"own GPU: start at most {have} per node (torchrun --nproc-per-node={have}), or hide the "
            f"GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU"
        )


def check_float8(cfg: Config, device: torch.device, where: str = "config") -> None:
    """Each rank: float8 matmuls need its GPU to have compute capability 8.9+ (emulation runs anywhere)."""
    if cfg.parallel.float8 == "none":
        return
    from trainer.parallel.float8 import device_problem

    problem = device_problem(cfg.parallel, device)
    if problem:
        raise ConfigError(f"{where}: parallel.float8: {problem}")


def config_main(argv: list[str] | None = None) -> int:
    """`python -m trainer.config --print` (fsdp-config, make config), which hands its command line over
    to this: every key of the config with the value a run of it would take, checked as make check
    checks it (what only the training machine has, its data files, is a warning) and resolved as a
    run resolves it (the shape, the batch of --nproc x --nnodes processes)."""
    args = print_parser().parse_intermixed_args(argv)
    try:
        cfg, where, notes = load_run(args.config, args.overrides)
        nproc = max(1, cfg.parallel.tp) if args.nproc is None else args.nproc  # unsaid: the fewest that fit tp
        if nproc < 1 or args.nnodes < 1:
            raise ConfigError(f"--nproc {nproc} --nnodes {args.nnodes}: give 1 or more of each")
        world = nproc * args.nnodes
        warnings, cfg = checked(cfg, world, where=where, overrides=args.overrides, planning=True, node_size=nproc)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in [*notes, *(f"warning: {w}" for w in warnings)]:
        print(line, file=sys.stderr)
    try:
        print(f"# the config of {cfg.run_dir}, from {where}{' and the command line' if args.overrides else ''}")
        print(print_config(cfg), flush=True)
    except BrokenPipeError:  # `make config | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["--print-config"]:  # python -m trainer.config's hand-over
        return config_main((sys.argv[1:] if argv is None else argv)[1:])
    parser = cli.parser("check", __doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--nproc", type=int, help="processes per node; checked against this machine's devices")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes (for the batch arithmetic)")
    parser.add_argument(
        "--gpu-mem-gb",
        default="",
        help="memory of one GPU in GB (1e9 bytes) to check the "
        "estimate against; empty: this machine's GPUs, none without GPUs",
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_intermixed_args(argv)  # overrides may come before --config too
    try:
        cfg, where, notes = load_run(args.config, args.overrides)
        planning = bool(args.gpu_mem_gb)  # a GPU target: this machine is not the one that trains
        warnings = []
        if args.nproc is not None:  # this machine's devices (torch tells them), then the config
            try:
                warnings += filter(None, [check_devices(args.nproc)])
            except ConfigError as e:
                if not planning or args.nproc < 1:
                    raise
                warnings.append(f"{e} (not an error when planning for GPU_MEM_GB={args.gpu_mem_gb})")
        if args.nnodes < 1:
            raise ConfigError(f"the number of nodes is {args.nnodes}; it must be at least 1")
        world = (args.nproc or 1) * args.nnodes
        # A GPU target (GPU_MEM_GB) is checked below; this machine's RAM only for CPU training here.
        found, cfg = checked(
            cfg,
            world,
            where=where,
            overrides=args.overrides,
            ranks_per_node=None if planning else args.nproc or 1,
            planning=planning,
            node_size=args.nproc or 1,
        )
        warnings += found
        fit = gpu_preflight(cfg, world, args.nproc or 1, args.nnodes, args.gpu_mem_gb, where=where)
        if fit is None:  # no GPU to check against: what one CPU process of this machine needs
            fit = cpu_memory_line(cfg, world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"config OK: {args.config}: {cfg.model.name} on {world} processes (NPROC={args.nproc or 1} x "
        f"NODES={args.nnodes}), run_dir {cfg.run_dir}"
    )
    for line in plan_lines(cfg, args.nproc or 1, args.nnodes):
        print(line)
    if cfg.eval.interval:  # never the training data (data.eval_fraction)
        print(f"evaluation: every {cfg.eval.interval} steps on {eval_data(cfg.data)}")
    for line in notes:
        print(line)
    for line in warnings:
        print(f"warning: {line}")
    warning = schedule_warning(cfg.optim, cfg.train.steps)
    if warning:
        print(f"warning: {warning}")
    if fit:
        print(fit)
    return 0


def check_gpu_memory(
    cfg: Config, world_size: int, device: torch.device, local_world_size: int, where: str = "config"
) -> None:
    """Each rank, before anything is written: the estimate must fit its own GPU, `device` (ConfigError
    with what would make it fit). The ranks ask, not the launcher, because asking creates a CUDA
    context, and `make run`, compose and sbatch starts have no `make check` before them. The estimate
    is within a few percent of measured CPU peaks and of four H100 peaks (tests/unit/test_memory_calibration.py)."""
    if device.type != "cuda":
        return
    import torch

    from trainer.preflight import memory

    torch.cuda.set_device(device)  # the context goes to this rank's own GPU
    have = torch.cuda.get_device_properties(device).total_memory
    what = f"GPU {device.index} ({torch.cuda.get_device_name(device)})"
    try:
        memory.preflight(
            cfg,
            world_size,
            local_world_size,
            have,
            what,
            nodes=max(1, world_size // local_world_size),
            nodes_option="{} nodes",
        )
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def cpu_memory_line(cfg: Config, world: int) -> str:
    """The estimated peak of one CPU process, against this machine's memory."""
    from trainer.preflight import memory

    per_rank = cfg.train.global_batch_size // memory.dp_size(cfg, world)
    need = memory.estimate(cfg, world, pipeline.micro_batch(cfg.parallel, per_rank, cfg.train.micro_batch_size))
    have = memory.machine_bytes()
    of = f", of the {memory.gb(have)} of this machine" if have else ""
    return (
        f"memory: about {memory.gb(need.total)} per process estimated on the CPU{of} (give GPU_MEM_GB= to check "
        f"a GPU instead)\n{need.breakdown()}"
    )


def gpu_target(gpu_mem_gb: str) -> tuple[int, str] | None:
    """(bytes of one GPU, what they are) from --gpu-mem-gb, else this machine's GPUs; None without
    either. Only trainer.check asks torch for the GPUs (a CUDA context): never the launcher."""
    from trainer.preflight import memory

    if gpu_mem_gb:
        try:
            value = float(gpu_mem_gb)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise ConfigError(f"GPU_MEM_GB={gpu_mem_gb!r}: give the memory of one GPU in GB, e.g. 80")
        return int(value * 1e9), f"GPU_MEM_GB={gpu_mem_gb}"
    have = memory.local_gpu_bytes()
    return (have, "this machine's GPU") if have else None


def gpu_preflight(
    cfg: Config, world: int, ranks_per_node: int, nnodes: int, gpu_mem_gb: str, where: str = "config"
) -> str | None:
    """Refuse (ConfigError) a config whose estimated peak does not fit one GPU of the target; else the
    line that says estimate and target, or None where there is no GPU to check against."""
    from trainer.preflight import memory

    target = gpu_target(gpu_mem_gb)
    if target is None:
        return None
    have, what = target
    options = dict(nodes=nnodes, nodes_option="NODES={}", ranks_option="NPROC={}")
    try:
        need = memory.preflight(cfg, world, ranks_per_node, have, what, **options)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    line = (
        f"memory: about {memory.gb(need.total)} per GPU estimated for NPROC={ranks_per_node} x NODES={nnodes}, of "
        f"the {memory.gb(have)} of {what} ({need.total / have:.0%})\n{need.breakdown()}"
    )
    warning = memory.headroom_warning(cfg, world, ranks_per_node, have, need, **options)
    return line + (f"\nwarning: {warning}" if warning else "")


def plan_lines(cfg: Config, nproc: int, nnodes: int, per_node: str = "NPROC") -> list[str]:
    """What a run of `cfg` on `nproc` processes x `nnodes` nodes does: the batch arithmetic, the
    checkpoint interval and, where an earlier run in its run dir logged step times, how long it takes.
    `per_node`: what the user sets the processes per node with (make submit: GPUS_PER_NODE)."""
    from trainer import models

    world = nproc * nnodes
    plan = Plan(cfg.parallel, world)
    dp, m = plan.dp_size, plan.pp_microbatches
    per_rank = cfg.train.global_batch_size // dp
    micro = pipeline.micro_batch(cfg.parallel, per_rank, cfg.train.micro_batch_size)
    family = models.spec(cfg.model)
    tokens = family.input_shape(cfg.model)[0] if family.kind == "lm" else None
    per_step = (
        f"{cfg.train.global_batch_size * tokens:,} tokens per step ({tokens} per sample)"
        if tokens
        else f"{cfg.train.global_batch_size:,} samples per step"
    )
    shape = f"{per_node}={nproc} x NODES={nnodes}"
    degrees = (("cp", plan.dims.cp), ("tp", plan.tp), ("pp", plan.pp))
    split = " x ".join(f"parallel.{name}={n}" for name, n in degrees if n > 1)
    ranks = f"{world} ranks ({shape})" if dp == world else f"{dp} data-parallel ranks ({shape} / {split})"
    if plan.pp > 1:  # global / dp ranks = pipeline micro-batches x micro-batch x accumulation; the bubble
        p = cfg.parallel
        v = pp_plan.stages_per_rank(p)
        form, idle = pp_plan.bubble(p)
        stages = f"{p.pp} stages" if v == 1 else f"{p.pp * v} stages ({v} a rank)"
        lines = [
            f"batch: global {cfg.train.global_batch_size} / {ranks} = {m} pipeline micro-batches "
            f"(parallel.pp_microbatches) x micro-batch {micro} x {per_rank // (m * micro)} accumulation step(s); "
            f"{per_step}",
            f"pipeline: {stages}, schedule {pp_plan.schedule(p)}: bubble {form} = {float(idle):.0%} of each "
            f"forward/backward idle; the first stage holds {float(pp_plan.in_flight(p)):g} micro-batch(es) of "
            f"activations at once",
        ]
    else:
        lines = [
            f"batch: global {cfg.train.global_batch_size} / {ranks} / "
            f"micro-batch {micro} = {per_rank // micro} accumulation step(s); {per_step}"
        ]
    interval = cfg.checkpoint.interval
    if interval == "auto":
        lines.append("checkpoint: interval auto (Young-Daly, chosen by the run from its measured step and save times)")
    elif interval:
        lines.append(f"checkpoint: every {interval} steps, {cfg.train.steps // interval} save(s) in {cfg.train.steps}")
    else:
        lines.append("checkpoint: no interval (checkpoint.interval=0): at the end and on a stop only")
    step_s = logged_step_time(cfg.run_dir)
    if step_s:
        seconds, rows = step_s
        total = seconds * cfg.train.steps
        lines.append(
            f"duration: about {total / 3600:.1f} h for {cfg.train.steps} steps at {seconds:.3g} s per step (the "
            f"median of {rows} logged windows in {_join(cfg.run_dir, 'metrics.jsonl')}; its ranks and "
            f"machine may differ)"
        )
    else:
        lines.append("duration: unknown until a run has logged step times in its run dir")
    return lines


def _join(run_dir: str, name: str) -> str:
    return f"{run_dir.rstrip('/')}/{name}" if objects.is_remote(run_dir) else os.path.join(run_dir, name)


# The most of a run's metrics.jsonl the plan reads for its step time (a longer one: duration unknown).
PLAN_METRICS_BYTES = 64 << 20


def logged_step_time(run_dir: str) -> tuple[float, int] | None:
    """(median step_time_s, windows) of the training rows of run_dir's metrics.jsonl, the first
    window left out (compilation and warm-up), or None where none is logged."""
    import json
    import statistics

    path = os.path.join(run_dir, "metrics.jsonl")
    try:  # a shared run dir: no link followed, no FIFO blocked on, bounded (trainer/rundir/files.py)
        if objects.is_remote(run_dir):  # an s3:// run dir's, from the bucket (bounded likewise)
            text = (objects.read_run_file(run_dir, "metrics.jsonl", PLAN_METRICS_BYTES) or b"").decode()
        else:
            text = files.read_text(path, limit=PLAN_METRICS_BYTES)
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"step_time_s"' in line]
    except (OSError, ValueError):
        return None
    rows = [r for r in rows if isinstance(r, dict)]
    times = [r["step_time_s"] for r in rows[1:] if isinstance(r.get("step_time_s"), (int, float))]
    return (statistics.median(times), len(times)) if times else None


if __name__ == "__main__":
    sys.exit(main())
