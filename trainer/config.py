"""The run configuration: typed sections, loaded from YAML plus dotted command-line overrides.

Precedence: dataclass defaults, then the YAML file, then `key.sub=value` overrides. Every mistake
becomes a `ConfigError` whose message says what, where and what to do.

Reading and checking a config needs no torch (a login node's `make check` and `make submit`): this
module imports none, nor does any module it imports. So a section is defined beside the code it
configures where that module imports torch only in the functions that use it and sits below the
config (optim, health, the model section in the models package, whose specs keep their networks
apart, as torchtitan keeps a model's args apart from its model code); the sections of the modules
that need torch to be imported at all (train, eval, data, parallel, checkpoint, log) and of the
launcher (a front door, above everything: nothing here imports it) are defined here, each imported
by its module. tools/imports.py keeps it so: no import circle, none running up its floors.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from trainer import cli, ranges
from trainer.models import ModelArgs
from trainer.optim import OptimArgs
from trainer.ranges import AT_LEAST_1, MAX_SEED, NOT_NEGATIVE, POSITIVE, TIMEOUT_S, Range
from trainer.resilience.health import HealthArgs
from trainer.rundir import files
from trainer.rundir.layout import CONFIG_FILE


class ConfigError(Exception):
    """A mistake in the user's configuration; the message is shown as one line."""


# Beside each number field: the values it takes (trainer/ranges.py; trainer/preflight/check.py refuses others).
_GRAD_CLIP = "give a positive norm, or null to disable clipping"
_MTBF = "give the hours between interruptions (> 0), or null for the Llama 3 report's rate"


@dataclass
class TrainArgs:
    steps: Annotated[int, AT_LEAST_1] = 200  # total optimizer steps of the run
    global_batch_size: Annotated[int, AT_LEAST_1] = 32  # samples per optimizer step, summed over all ranks
    # Samples per optimizer step on each rank (the tutorials' batch_size): when set, global_batch_size
    # becomes this times the number of processes, whatever it says.
    rank_batch_size: Annotated[int | None, AT_LEAST_1] = None
    # How a step's loss is reduced over the rank's samples (tokens for the LM) before backward: mean,
    # or sum (the MNIST tutorial's nll_loss(reduction="sum"): gradients micro_batch x larger). The
    # gradients are averaged over the ranks either way; the logged loss is the mean in both cases.
    loss_reduction: Literal["mean", "sum"] = "mean"
    # samples per forward/backward on one rank; None: all at once
    micro_batch_size: Annotated[int | None, AT_LEAST_1] = None
    # seeds the weights and the order of the data
    seed: Annotated[int, Range(0, MAX_SEED, note=" (numpy's and torch's generators)")] = 0
    # max global gradient norm; None: no clipping
    grad_clip: Annotated[float | None, Range(0, low_open=True, says=_GRAD_CLIP)] = 1.0
    # evaluations in a row without an improvement of the eval loss before the run stops early
    # (needs eval.interval; a NaN or infinite eval loss stops it at once); 0 or null: off
    early_stop_patience: Annotated[int | None, NOT_NEGATIVE] = None
    # how much lower than the best so far an eval loss must be to count as an improvement
    early_stop_min_delta: Annotated[float, NOT_NEGATIVE] = 0.0


@dataclass
class EvalArgs:
    # optimizer steps between evaluations; 0 disables them. An evaluation with the lowest eval loss so
    # far saves a checkpoint (the best one, which retention keeps) unless its step saves one anyway
    interval: Annotated[int, NOT_NEGATIVE] = 0
    batches: Annotated[int, AT_LEAST_1] = 4  # micro-batches per rank in one evaluation


@dataclass
class SourceArgs:
    """One token file of a weighted mixture (data.sources); trainer/data.py's Mixture reads them."""

    path: str | None = None  # the token file (data.token_dtype, as data.path)
    weight: float = 1.0  # share of the training samples, relative to the other sources' (> 0)
    eval_path: str | None = None  # this source's evaluation token file: eval rows get eval_loss/<name>
    name: str | None = None  # in rows and the live line ([A-Za-z0-9_.-]); None: the file name without extension

    @property
    def label(self) -> str:
        """The name rows and lines use: `name`, else the file's name without its extension."""
        return self.name or os.path.splitext(os.path.basename(self.path or ""))[0]


# What a source's label may hold: it becomes part of row keys (eval_loss/<label>) and of the live line.
SOURCE_LABEL = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass
class DataArgs:
    # What the samples are: generated token sequences the model can learn, a token file made by
    # trainer.prepare, MNIST, a folder of images in one subfolder per class, or generated images.
    name: Literal["synthetic", "tokens", "mnist", "imagefolder", "synthetic_images"] = "synthetic"
    path: str | None = None  # token file, MNIST root or ImageFolder root (for the training split)
    # The same for evaluation; None: MNIST's test split, generated data's own far range, and for a token
    # file or image folder the part data.eval_fraction holds out of data.path.
    eval_path: str | None = None
    # The fraction of a token file's sequences (its last ones) or of an image folder's images (every
    # k-th in the folder's order, so each class gives its share) held out for evaluation, which training
    # never reads: of data.path when data.eval_path is not set, of each data.sources file without its own
    # eval_path. None: 0.01 when evaluation is on (eval.interval) at the run's first start, else 0; the
    # run's config.yaml records the number, so every resume holds out the same part.
    eval_fraction: Annotated[float | None, Range(0, 1, high_open=True)] = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # element type of a token file
    download: bool = True  # MNIST: download into `path` when the files are not there
    num_workers: Annotated[int, NOT_NEGATIVE] = 0  # DataLoader worker processes per rank
    trace: bool = False  # append each rank's global sample indices to run_dir/trace/ (debugging)
    # Several token files mixed by weight (data.name=tokens, instead of data.path), e.g.
    # [{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]; empty: the single data.path.
    sources: tuple[SourceArgs, ...] = ()


# data.eval_fraction of a run that evaluates and names no evaluation file (HF's run_clm holds out 5%,
# nanoGPT's OpenWebText 0.05%; an evaluation reads eval.batches micro-batches of it at a time).
DEFAULT_EVAL_FRACTION = 0.01


def holds_out(d: DataArgs) -> bool:
    """Whether data.eval_fraction applies to the data `d` names: a token file or image folder without
    an evaluation file, or a mixture with a source that has none."""
    if d.sources:
        return not d.eval_path and not all(s.eval_path for s in d.sources)
    return d.name in ("tokens", "imagefolder") and not d.eval_path


def eval_data(d: DataArgs) -> str:
    """What an evaluation of the data `d` names reads, in words (make check's `evaluation:` line)."""
    held = f"the last {(d.eval_fraction or 0) * 100:g}%"
    if d.eval_path:
        return f"data.eval_path {d.eval_path}"
    if d.sources:
        each = [f"{s.label}: {s.eval_path or held + ' of ' + str(s.path)}" for s in d.sources]
        return f"each source's own ({'; '.join(each)}), which training never reads"
    never = f"(data.eval_fraction={d.eval_fraction or 0:g}), which training never reads"
    if d.name == "tokens":
        return f"{held} of {d.path}'s sequences {never}"
    if d.name == "imagefolder":
        return f"{held} of {d.path}'s images, evenly spread {never}"
    return f"MNIST's test split under {d.path}" if d.name == "mnist" else "generated samples training never reaches"


def eval_data_problem(d: DataArgs) -> str | None:
    """Why an evaluation of the data `d` names would read nothing held out from training, or None."""
    if not holds_out(d) or d.eval_fraction:
        return None
    if d.sources:
        return (
            "evaluation needs data that training does not read, and no source has an eval_path while "
            "data.eval_fraction is 0; give data.eval_path or data.sources[i].eval_path files, or set "
            f"data.eval_fraction={DEFAULT_EVAL_FRACTION} to hold out the last 1% of each source"
        )
    what = "sequences" if d.name == "tokens" else "images"
    return (
        f"evaluation needs data that training does not read: data.eval_path is not set and "
        f"data.eval_fraction is 0; give data.eval_path, or set data.eval_fraction={DEFAULT_EVAL_FRACTION} to "
        f"hold out 1% of data.path's {what} (training then never reads them)"
    )


@dataclass
class ParallelArgs:
    strategy: Literal["fsdp", "ddp", "none"] = "fsdp"  # none: plain single-process training
    # full: shard params, grads and optimizer state (FULL_SHARD, ZeRO-3); grad_op: keep params
    # unsharded between forward and backward (SHARD_GRAD_OP, ZeRO-2); hybrid: full shard inside a
    # group of `shard_size` ranks, replicate across groups (HYBRID_SHARD, a 2-D mesh).
    sharding: Literal["full", "grad_op", "hybrid"] = "full"
    # hybrid: ranks per shard group; None: the data-parallel ranks of a node's share of a pipeline stage
    shard_size: Annotated[int | None, AT_LEAST_1] = None
    # block: one FSDP unit per model block (transformer layer, ResNet block); size: one unit per
    # module holding at least `wrap_min_params` parameters not already wrapped below it.
    wrap: Literal["block", "size"] = "block"
    wrap_min_params: Annotated[int, AT_LEAST_1] = 100_000  # size policy threshold, in parameters
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute dtype
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # gradient reduction dtype
    # float16 only: the loss scale the run starts from (GradScaler's init_scale); it halves at each step
    # whose gradients overflow (that step is skipped) and doubles after 2000 steps without one. > 0.
    loss_scale: Annotated[float, POSITIVE] = 65536.0
    cpu_offload: bool = False  # keep sharded params, grads and optimizer state in host memory
    # Recompute activations in backward instead of keeping them (torchtitan's activation_checkpoint.mode):
    # none; full: every block's whole forward again; selective: as parallel.selective_ac says. The old
    # true/false still mean full/none (a deprecation line says so).
    activation_checkpointing: Literal["none", "full", "selective"] | bool = "none"
    # activation_checkpointing=selective (torchtitan's selective_ac_option): op: every block keeps the outputs
    # of its matmuls (every other one of them) and attention, and recomputes the rest (norms, activations,
    # RoPE); N: every Nth block is checkpointed in full, the others keep all their activations.
    selective_ac: Annotated[int | Literal["op"], AT_LEAST_1] = "op"
    # When FSDP reduces the gradients under accumulation: every_micro_batch reduce-scatters each
    # micro-batch's into the sharded gradients (1/N held, as torchtitan and ZeRO-2/3; hybrid all-reduces
    # across its replicas at the last only); last_micro_batch keeps them unsharded, in reduce_dtype, until
    # the last micro-batch (one reduce-scatter a step, a whole copy of the gradients on every rank); auto:
    # last_micro_batch where the memory estimate fits the GPU (less communication), else every_micro_batch.
    # DDP reduces at the last micro-batch always (no_sync).
    grad_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto"
    compile: bool = False  # torch.compile each block and the loss
    # float8 matmuls in the blocks' linear layers (torchao: pip install .[float8]); tensorwise: one scale a
    # tensor, weights all-gathered in float8 under FSDP; rowwise: one scale a row, closer to bf16, slower.
    # Needs a GPU of compute capability 8.9+ and compile=true. The head and embeddings stay as they are.
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    float8_emulate: bool = False  # float8 math emulated in high precision, on any device: for tests, no faster
    # Context-parallel degree, planned (make check estimates it; every start refuses cp > 1, not built): ranks
    # that split each sequence, ring attention between them, as torchtitan's context_parallel.
    cp: Annotated[int, AT_LEAST_1] = 1
    # Tensor-parallel degree: each transformer block's matmuls split over `tp` ranks of one node (a 2D mesh,
    # dp x tp, as torchtitan's); FSDP shards over the data-parallel ranks. Must divide the ranks of a node.
    tp: Annotated[int, AT_LEAST_1] = 1
    # Pipeline-parallel degree (torch.distributed.pipelining): the model's blocks split into `pp` stages of
    # consecutive blocks (the embedding on the first, the norm and head on the last), outermost in the mesh
    # (pp x dp x tp, torchtitan's order); FSDP shards each stage over its data-parallel ranks.
    pp: Annotated[int, AT_LEAST_1] = 1
    # The pipeline's schedule (torch.distributed.pipelining's): gpipe (every micro-batch's forward, then every
    # backward: all of them in flight) or 1f1b (one forward, one backward in the steady state: at most pp in
    # flight; needs pp_microbatches >= pp), one stage a rank; interleaved_1f1b (1f1b over several stages a
    # rank: rank r holds stages r, r + pp, ...; a smaller bubble), interleaved_zb (its zero-bubble form: the
    # backward split into its input's and weights' halves) or zbv (zero bubble over two stages a rank in a V),
    # pp_stages_per_rank stages a rank. The zero-bubble ones keep FSDP's units gathered from forward to backward.
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = "1f1b"
    # Stages a rank holds (torchtitan's virtual stages): the model's blocks split into pp x this many stages.
    # None: 2 under interleaved_1f1b, interleaved_zb and zbv (which needs 2), 1 under gpipe and 1f1b (which need 1).
    pp_stages_per_rank: Annotated[int | None, AT_LEAST_1] = None
    # Pipeline micro-batches per forward/backward of a rank (each train.micro_batch_size samples); None: pp.
    pp_microbatches: Annotated[int | None, AT_LEAST_1] = None
    # Seconds a collective of the training process group waits for a rank that does not answer;
    # then the run stops with an error naming the step (exit code 1), so that Slurm can requeue it.
    timeout_s: Annotated[int, TIMEOUT_S] = 600

    deprecated: typing.ClassVar[str | None] = None  # the line a deprecated value of a key gets (set by __post_init__)

    def __post_init__(self):
        if isinstance(self.activation_checkpointing, bool):  # the old key: true/false, one deprecation line
            self.deprecated = AC_DEPRECATED.format(str(self.activation_checkpointing).lower(), self.ac_mode)
            self.activation_checkpointing = self.ac_mode

    @property
    def ac_mode(self) -> str:
        """activation_checkpointing as none, full or selective (the old true/false: full/none)."""
        ac = self.activation_checkpointing
        return ("full" if ac else "none") if isinstance(ac, bool) else ac


AC_DEPRECATED = (
    "parallel.activation_checkpointing={} is deprecated: it means parallel.activation_checkpointing={}; write "
    "that (none, full or selective)"
)


@dataclass
class CheckpointArgs:
    # Optimizer steps between saves; 0: save only at the end and when stopped; auto: the Young-Daly
    # interval sqrt(2 x blocking save seconds x mtbf), in steps, from the run's own save and step times.
    interval: Annotated[int | Literal["auto"], NOT_NEGATIVE] = 100
    # Mean time between interruptions of the whole job in hours (interval=auto); None: the Llama 3
    # report's trainer.checkpoint.manager.GPU_MTBF_HOURS (45,566 GPU-hours) divided by the job's processes.
    mtbf_hours: Annotated[float | None, Range(0, low_open=True, says=_MTBF)] = None
    # newest complete checkpoints kept, older ones are deleted (never the best eval loss's); 0 keeps all
    keep: Annotated[int, NOT_NEGATIVE] = 3
    # also keep forever every checkpoint whose step is a multiple of this; 0: none
    keep_every: Annotated[int, NOT_NEGATIVE] = 0
    async_save: bool = False  # write shards in the background while training goes on
    # a checkpoint folder (or s3://BUCKET/PREFIX/checkpoints/step_N) a new run starts from; once run_dir has
    # its own, they win
    resume_from: str | None = None
    # start from step 0 although status.json says this run saved checkpoints that are gone (else refused); once
    start_over: bool = False
    timeout_s: Annotated[int, TIMEOUT_S] = 3600  # limit for the collectives of one save or load (slow filesystems)


@dataclass
class LogArgs:
    interval: Annotated[int, AT_LEAST_1] = 10  # optimizer steps between metric rows
    progress: bool = True  # live progress line on a terminal (rank 0 only)
    tensorboard: bool = (
        False  # also write TensorBoard event files to <run_dir>/tensorboard (trainer/observe/trackers.py)
    )
    wandb: bool = False  # also log to a Weights & Biases run, the same one after each restart
    mlflow: bool = False  # also log to an MLflow run at MLFLOW_TRACKING_URI, the same one after each restart
    project: str | None = None  # W&B project / MLflow experiment; None: the run dir's name
    # A rank whose compute time per step (a metrics row's compute_s_*) exceeds this many times the
    # median of all ranks' for 3 logged windows in a row is named as a straggler (rank and node); > 1.
    straggler_factor: Annotated[float, Range(1, low_open=True, note=" (times the median compute time)")] = 1.5


@dataclass
class LaunchArgs:
    # Times the launcher (trainer/launchers/torchrun.py) restarts every rank of the job, in the same allocation,
    # from the newest checkpoint after a rank failed (killed, crashed; never bad input, divergence or a
    # stop signal), counted over one launch (torchrun's --max-restarts); 0: a failure ends the launch at
    # once. The default 3 survives a few transient faults (a killed process, a lost connection) without
    # the queue; a failure that repeats at once costs 3 quick starts before the exit code says it.
    max_restarts: Annotated[int, NOT_NEGATIVE] = 3


@dataclass
class Config:
    run_dir: str = "runs/default"  # config, metrics and checkpoints of the run all go here
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    log: LogArgs = field(default_factory=LogArgs)
    launch: LaunchArgs = field(default_factory=LaunchArgs)
    health: HealthArgs = field(default_factory=HealthArgs)


def resolve_batch(cfg: Config, world_size: int) -> Config:
    """train.global_batch_size made train.rank_batch_size x data-parallel ranks where that is set: the
    processes over parallel.cp x parallel.tp x parallel.pp (a tensor-parallel group's ranks, a pipeline's
    stages and a context-parallel group's ranks share their samples; degrees that do not divide them are
    refused by the plan's check)."""
    if cfg.train.rank_batch_size is None:
        return cfg
    split = cfg.parallel.cp * cfg.parallel.tp * cfg.parallel.pp  # the pipeline's stages, cp's ranks share them too
    split = split if world_size % split == 0 else 1
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, global_batch_size=cfg.train.rank_batch_size * (world_size // split))
    )


def resolve(cfg: Config, where: str = "config", world_size: int = 1, weights_checked: bool = False) -> Config:
    """The config as the run records it: the global batch of `world_size` processes, and the
    transformer's shape spelled out, from model.init_from's config.json (keys the config sets
    must agree with it; trainer/hf.py reads the folder), from the token files' sidecars for the
    vocabulary (trainer/prepare.py reads them; a mixture: the largest), and else from model.size; and
    data.eval_fraction's number (DEFAULT_EVAL_FRACTION when evaluation is on and needs it, else 0).
    `weights_checked`: this node's launcher read the folder's weights; its config.json alone is read here."""
    from trainer import hf  # torch only where a folder's weights are read
    from trainer.models import resolve as resolve_model
    from trainer.prepare import sidecar_vocab

    cfg = resolve_batch(cfg, world_size)
    if cfg.data.eval_fraction is None:  # at the run's first start; its config.yaml keeps the number
        evaluates = cfg.eval.interval > 0 and holds_out(cfg.data)
        fraction = DEFAULT_EVAL_FRACTION if evaluates else 0.0
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_fraction=fraction))
    model = cfg.model
    try:
        model = hf.init_args(model, weights_checked)
    except hf.HFError as e:
        raise ConfigError(f"{where}: model.init_from: {e}") from None
    if cfg.data.name == "tokens" and model.vocab_size is None and not model.init_from:
        paths = [cfg.data.path] + [source.path for source in cfg.data.sources]
        model = dataclasses.replace(model, vocab_size=max(filter(None, map(sidecar_vocab, paths)), default=None))
    return dataclasses.replace(cfg, model=resolve_model(model))


# The configs that ship with the trainer: trainer/configs/ in an installed wheel (pyproject.toml maps
# the checkout's configs/ there), configs/ beside the package in a checkout.
SHIPPED_CONFIGS = (Path(__file__).parent / "configs", Path(__file__).parent.parent / "configs")


def find_config(path: str | None) -> str | None:
    """`path` itself when something is at that name; else the shipped config it names (`llama-8b`,
    `llama-8b.yaml`, `configs/llama-8b.yaml`), so that an installed trainer finds its configs from any
    folder. A name that matches none is returned as given: reading it then says it is not found."""
    if path is None or os.path.lexists(path) or os.path.dirname(path) not in ("", "configs"):
        return path
    name = os.path.basename(path)
    name = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    shipped = [folder / name for folder in SHIPPED_CONFIGS if (folder / name).is_file()]
    return str(shipped[0]) if shipped else path


def load(path: str | None, overrides: list[str] = ()) -> Config:
    """Read `path` (may be None for pure defaults; a shipped config's name: find_config) and apply
    `key=value` overrides."""
    path = find_config(path)
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(path)
    sources = {key: path or "defaults" for key in _flatten(raw)}
    _apply_overrides(raw, overrides, sources)
    return _build(Config, raw, prefix="", sources=sources, default_source=path or "defaults")


def _apply_overrides(raw: dict, overrides: list[str], sources: dict) -> None:
    """Set each `key.sub=value` of `overrides` in `raw`, recording where each value came from."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=100")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = _parse(text, f"override {item!r}") if text else None
        sources[key] = f"override {item!r}"


SAVED = CONFIG_FILE  # the resolved config a run writes into its run dir at every start


def load_run(path: str | None, overrides: list[str] = (), config_chosen: bool = True) -> tuple[Config, str, list[str]]:
    """The config of a start in a run dir: (config, where its values come from, lines to show).

    A run dir that holds a saved run (its config.yaml) continues that run: the saved config is the
    base, the command line's overrides apply on top. The --config file only names the run dir and
    fills keys the saved config lacks (written by an older trainer); a value it sets that differs
    from the run's is not used, and one of the lines says so, unless the user did not choose the file
    (config_chosen=False: make's default CONFIG). A new run dir: `load(path, overrides)`.
    The saved config is read only when nobody but the user could have written it (`_read_saved`);
    naming it as the --config file adopts it as the user's own."""
    path = find_config(path)
    cfg = load(path, overrides)
    saved = os.path.join(cfg.run_dir, SAVED)
    if not (os.path.islink(saved) or os.path.isfile(saved)):  # a FIFO or folder there: the start's check names it
        return cfg, path or "defaults", []
    adopted = path is not None and os.path.abspath(path) == os.path.abspath(saved)
    saved_raw = _read_yaml(saved) if adopted else _read_saved(saved)
    given = {item.partition("=")[0] for item in overrides}
    file_raw = _read_yaml(path) if path is not None else {}
    raw = _merge(file_raw, {**saved_raw, "run_dir": cfg.run_dir})
    if given & {"model.size", "model.init_from"} and isinstance(raw.get("model"), dict):
        # The saved shape was resolved from the old size (or folder): the new one resolves it anew,
        # except for the keys given here too.
        from trainer.models import SHAPE_KEYS

        raw["model"] = {k: v for k, v in raw["model"].items() if k not in SHAPE_KEYS or f"model.{k}" in given}
    sources = {key: saved for key in _flatten(raw)}
    _apply_overrides(raw, overrides, sources)
    result = _build(Config, raw, prefix="", sources=sources, default_source=saved)
    run = _leaves(to_dict(from_dict({**_merge(file_raw, saved_raw), "run_dir": cfg.run_dir}, saved)))
    now, from_file = _leaves(to_dict(result)), _leaves(to_dict(cfg))
    lines = []
    changed = [f"{k} {run[k]!r} -> {now[k]!r}" for k in now if k != "run_dir" and now[k] != run.get(k)]
    if changed:
        lines.append(
            f"{cfg.run_dir}: continuing the run saved in {saved}, changed on the command line: {', '.join(changed)}"
        )
    ignored = [
        f"{k} ({from_file[k]!r}; the run has {now[k]!r})"
        for k in _leaves(file_raw)
        if k in now
        and k not in given
        and k != "run_dir"
        and _leaves(file_raw)[k] is not None
        and from_file[k] != now[k]
    ]
    if ignored and config_chosen:
        lines.append(
            f"{path} differs from the run saved in {saved} in {', '.join(ignored)}: the run's values are "
            f"used; to change one, give key=value on the command line"
        )
    return result, saved, lines


def _read_saved(saved: str) -> dict:
    """The run dir's config.yaml `saved`, read only when nobody but the user could have written it
    (files.read_trusted: your regular file, not a link, writable by nobody else, in a run dir
    nobody else can write), and checked on the very file it reads. Every value of it sets the run
    (the learning rate, how many checkpoints are kept, health.command, model.family), so one that
    fails is refused as a whole, before a byte of it is read, in one line naming its owner. The
    user adopts it by naming it: `--config <run_dir>/config.yaml` (their own choice, as any
    --config file), after reading it."""
    try:
        return _parse_file(files.read_trusted(saved, CONFIG_FILE_BYTES), saved)
    except files.Untrusted as e:
        raise ConfigError(
            f"{saved}: not used, because {_with_owner_name(e.why, e.owner)}, so someone else may have written it "
            f"(its values set the run: learning rate, checkpoints kept, commands); if it is yours, read it and "
            f"continue with it by naming it: --config {saved} (make: CONFIG={saved}), and keep the run dir "
            f"writable by you only (chmod go-w)"
        ) from None
    except files.UnsafeFile as e:
        raise ConfigError(f"{e.path}: {e.why}; move it away") from None
    except OSError as e:
        raise ConfigError(f"{saved}: cannot read the run's config ({e.strerror}); check its permissions") from None


def _with_owner_name(why: str, owner: int | None) -> str:
    """`why` with the login name of uid `owner` after its number, where the system knows it."""
    if owner is None or owner == os.geteuid():
        return why
    try:
        import pwd

        name = pwd.getpwuid(owner).pw_name
    except (ImportError, KeyError):
        return why
    return why.replace(f"uid {owner},", f"uid {owner} ({name}),", 1)


def refuse_untrusted_family(path: str, family: str) -> None:
    """A ConfigError when the file at `path` (a run dir's config.yaml, a checkpoint's meta.json) names
    the model.family module `family` and someone other than us could have written it (files.trusted):
    importing the module runs its code. The command line's model.family, or the user's own --config
    file's, is taken instead (load_run does not ask then)."""
    problem = files.trusted(path)
    if problem is not None:
        raise ConfigError(
            f"{path}: its model.family {family!r} is not imported (importing runs its code) because {problem}, "
            f"so someone else may have written it; give model.family= on the command line or in your own --config "
            f"file, and keep the run dir writable by you only (chmod go-w)"
        )


def _merge(base: dict, top: dict) -> dict:
    """`base` with `top`'s values put over it, section by section."""
    merged = dict(base)
    for key, value in top.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def _leaves(d: dict, prefix: str = "") -> dict:
    """{dotted key: value} of every value of `d` that is not a section."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + str(k)] = v
    return out


# Bounds on what a YAML text may hold: a config nests 3 levels (section, key, list) and holds a few
# hundred values. Aliases are kept (`<<: *anchor` merges work) but counted as what they expand to,
# so that a few hundred bytes of nested aliases (billion laughs) are refused, not built.
MAX_DEPTH = 32  # nesting levels
MAX_VALUES = 10_000  # nodes (keys, values, lists, mappings) with every alias expanded
_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep; a config needs 3 (section, key, list): write it flatter"


class _Refused(Exception):
    """A YAML text refused as it is read: `problem` at line `line` (1-based)."""

    def __init__(self, line: int, problem: str):
        self.line, self.problem = line, problem


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error (SafeLoader
    silently keeps the last value), and that nesting, aliases that expand beyond MAX_VALUES and
    an alias inside the node it names (a loop) are refused while the text is composed: before
    anything is built, and before Python's recursion limit."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0  # nodes being composed around the next one
        self._sizes: dict = {}  # composed node -> (nodes, levels) it expands to; absent while being composed

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None and target not in self._sizes:
                raise _Refused(event.start_mark.line + 1, "an alias inside the value it names (a loop); remove it")
        elif self._depth == MAX_DEPTH:  # before PyYAML's recursion goes deeper
            raise _Refused(event.start_mark.line + 1, _TOO_DEEP)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node not in self._sizes:  # a new node, its children counted (an alias returns a counted one)
            children = (
                [n for pair in node.value for n in pair]
                if isinstance(node, yaml.MappingNode)
                else (node.value if isinstance(node, yaml.SequenceNode) else [])
            )
            sizes = [self._sizes[child] for child in children]
            self._sizes[node] = count, levels = 1 + sum(n for n, _ in sizes), 1 + max((d for _, d in sizes), default=0)
            if levels > MAX_DEPTH:  # aliases nested in aliases
                raise _Refused(node.start_mark.line + 1, _TOO_DEEP)
            if count > MAX_VALUES:
                raise _Refused(
                    node.start_mark.line + 1,
                    f"more than {MAX_VALUES} values once aliases are expanded; a "
                    f"config holds a few hundred: write the values out instead of "
                    f"nesting aliases",
                )
        return node

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` is read by SafeLoader itself
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in lines:
                raise _Refused(line, f"{key}: given twice (lines {lines[key]} and {line}); keep one of them")
            lines[key] = line
        return super().construct_mapping(node, deep)


def _parse(text: str, where: str, lines: bool = False) -> Any:
    """The value of the YAML `text`; any problem is a ConfigError that starts with `where` (and the
    line, with `lines`: a file's, not an override's)."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except _Refused as e:
        at = f"{where}:{e.line}" if lines else where
        raise ConfigError(f"{at}: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark and lines else where
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        todo = "fix the syntax" if lines else "fix the value"
        raise ConfigError(f"{at}: invalid YAML ({problem}); {todo}") from None


# The most a config file may hold: a config is a few kilobytes (a long data.sources list tens).
CONFIG_FILE_BYTES = 1 << 20


def _read_yaml(path: str) -> dict:
    """The top-level mapping of the YAML file at `path` (a file the user named: a link is followed),
    at most CONFIG_FILE_BYTES of it; every problem with the file is a ConfigError."""
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a folder; pass a YAML file with --config")
    kind = files.special_file(path)
    if kind:  # never opened: reading a FIFO waits for a writer
        raise ConfigError(f"{path}: is {kind}, not a regular file; pass a YAML file with --config")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found; pass an existing file with --config")
    try:  # opened without blocking and checked as opened: a FIFO swapped in after the stat above
        data = files.read_named(path, CONFIG_FILE_BYTES)
    except files.UnsafeFile as e:
        raise ConfigError(f"{path}: {e.why}; pass a YAML file with --config") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror}); check its permissions") from None
    return _parse_file(data, path)


def _parse_file(data: bytes, path: str) -> dict:
    """The top-level mapping of a config file's bytes `data`; every problem is a ConfigError naming `path`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            f"save the file as UTF-8"
        ) from None
    raw = _parse(text, path, lines=True)
    if raw is None:
        raise ConfigError(
            f"{path}: the file is empty (no settings, only blanks or comments); write settings "
            f"into it (configs/default.yaml is an example)"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return raw


def from_dict(raw: dict, where: str, overrides: list[str] = ()) -> Config:
    """A Config from a mapping such as to_dict's (a checkpoint's saved config), then `key=value`
    overrides; `where` names the mapping in messages."""
    raw, sources = copy.deepcopy(raw), {}
    _apply_overrides(raw, overrides, sources)
    return _build(Config, raw, prefix="", sources=sources, default_source=where)


def _flatten(d: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in d.items():
        keys.append(prefix + str(k))
        if isinstance(v, dict):
            keys += _flatten(v, prefix + str(k) + ".")
    return keys


def _build(cls: type, raw: dict, prefix: str, sources: dict, default_source: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = prefix + str(key)
        where = sources.get(dotted, default_source)
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"{where}: unknown key '{dotted}'; known keys here: {known}")
        kwargs[key] = _coerce(hints[key], value, dotted, where, sources, default_source)
    return cls(**kwargs)


def _coerce(tp, value, key: str, where: str, sources: dict, default_source: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: '{key}' is a section; give it as a mapping of keys")
        return _build(tp, value, key + ".", sources, default_source)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _coerce(args[0], value, key, where, sources, default_source)
        for arm in args:  # int | Literal["auto"]: the first arm that takes the value
            try:
                return _coerce(arm, value, key, where, sources, default_source)
            except ConfigError:
                pass
        names = [
            " or ".join(repr(c) for c in typing.get_args(a)) if typing.get_origin(a) is Literal else a.__name__
            for a in args
        ]
        raise ConfigError(f"{where}: '{key}' is {value!r}; expected {' or '.join(names)}")
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # a list of any length (data.sources)
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{where}: '{key}' is {value!r}; expected a list")
            return tuple(_coerce(args[0], v, f"{key}[{i}]", where, sources, where) for i, v in enumerate(value))
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: '{key}' is {value!r}; expected a list of {len(args)} values")
        return tuple(_coerce(a, v, key, where, sources, default_source) for a, v in zip(args, value))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: '{key}' is {value!r}; choose one of {', '.join(map(str, choices))}")
        return value
    if value is None:
        raise ConfigError(f"{where}: '{key}' must not be empty; give a {tp.__name__}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads '1e-3' as a string
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise TypeError(f"unsupported config type {tp} for {key}")
    raise ConfigError(f"{where}: '{key}' is {value!r}; expected {tp.__name__}")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump(cfg: Config, path: str | Path) -> None:
    """Write the config as YAML to `path` (files.write_text: a link or FIFO there is replaced)."""
    files.write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


# --- The whole config in view (python -m trainer.config --print, make config; docs/configuration.md's key table)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its comment} of the dataclass `cls`, read from its source once: the comment at
    the end of the field's line, else the comment lines right above it (STYLE.md: a field is
    documented where it is defined, so the meaning shown is the one next to the code)."""
    lines, _ = inspect.getsourcelines(cls)
    comments: dict[int, str] = {}  # line (0-based in `lines`) -> its comment's text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(iter(lines).__next__):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0] - 1] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0] - 1)
    docs = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for node in ast.parse(textwrap.dedent("".join(lines))).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)) or node.target.id not in names:
            continue
        line = node.lineno - 1
        beside = [comments[i] for i in range(line, node.end_lineno) if i in comments]
        if beside:  # at the end of the field's line(s)
            docs[node.target.id] = " ".join(beside)
            continue
        above = []
        while line - 1 in comments and line - 1 not in code_lines:
            line -= 1
            above.insert(0, comments[line])
        docs[node.target.id] = " ".join(above)
    return docs


def meaning(doc: str) -> str:
    """The first sentence of a field's comment: its meaning on one line."""
    match = re.match(r"(.+?(?<!e\.g)(?<!i\.e)\.)\s+(?=[^a-z])", doc)
    return (match.group(1) if match else doc).rstrip(".")


def _choices(tp) -> tuple | None:
    """The values a Literal type (or a Literal | None) allows, or None."""
    for arm in (tp, *typing.get_args(tp)):
        if typing.get_origin(arm) is Literal:
            return typing.get_args(arm)
    return None


def keys(
    cfg: Config | None = None, prefix: str = "", defaults=None, whole: bool = False
) -> list[tuple[str, Any, Any, str]]:
    """(dotted key, value in `cfg`, default, meaning) of every key of the config, in the order of
    the sections' fields; the meaning is the first sentence of the field's comment, `whole`: all of
    it, and the choices of a field that has them. A section that may be null (model.rope_scaling) is
    listed with its keys, whose defaults are what they take when the section is given."""
    cfg = Config() if cfg is None else cfg
    defaults = type(cfg)() if defaults is None else defaults
    docs = field_docs(type(cfg))
    hints = typing.get_type_hints(type(cfg))
    extras = typing.get_type_hints(type(cfg), include_extras=True)
    out = []
    for f in dataclasses.fields(cfg):
        key, value, default = prefix + f.name, getattr(cfg, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value) and dataclasses.is_dataclass(default):
            out += keys(value, key + ".", default, whole)
            continue
        doc = docs.get(f.name, "") if whole else meaning(docs.get(f.name, ""))
        choices = _choices(hints[f.name])
        if choices:
            doc = "; ".join(filter(None, (doc.rstrip("."), f"one of {', '.join(map(str, choices))}")))
        allowed = ranges.of(extras[f.name])
        if allowed:  # beside the field (trainer/ranges.py), as trainer/preflight/check.py checks it
            bounds = " and ".join(f"[{r.item}] {r.bounds()}" if r.item is not None else r.bounds() for r in allowed)
            doc = f"{doc.rstrip('.')}; {bounds}"
        out.append((key, value, default, doc))
        inner = [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)]
        if inner and typing.get_origin(hints[f.name]) is tuple:  # a list of sections (data.sources): each item's keys
            section = inner[0]
            if not value:  # none given (the key table): the keys an item takes, as key[].sub
                out += [(k, None, d, m) for k, _, d, m in keys(section(), key + "[].", section(), whole)]
            for i, item in enumerate(value):  # each item given, as key[i].sub
                out += keys(item, f"{key}[{i}].", section(), whole)
        elif inner:  # a section that may be null: its keys, with the defaults they take when given
            section = inner[0]
            for k, _, d, m in keys(section(), key + ".", section(), whole):
                out.append((k, getattr(value, k.rpartition(".")[2]) if value is not None else None, d, m))
    return out


def show(value: Any) -> str:
    """A value as YAML spells it on a command line: null, true, [0.9, 0.95], fsdp."""
    if isinstance(value, tuple):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]  # data.sources' items
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, str):
        return json.dumps(value) if value == "" or value != value.strip() else value
    return json.dumps(value)


def key_table() -> str:
    """docs/configuration.md's table of every key (between its `config keys` markers), from the fields' own
    comments: tests/unit/test_config_print.py keeps the two equal."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k}` | `{show(d)}` | {m.replace('|', '&#124;')} |" for k, _, d, m in keys(whole=True)]
    return "\n".join(rows) + "\n"


def print_config(cfg: Config) -> str:
    """Every key of `cfg` on a line: key, value, default (where the value differs), meaning."""
    rows = [(k, show(v), show(d), m) for k, v, d, m in keys(cfg)]
    width = max(len(k) for k, *_ in rows)
    value_width = min(24, max(len(v) for _, v, _, _ in rows))
    lines = []
    for k, v, d, m in rows:
        differs = f" (default {d})" if v != d else ""
        lines.append(f"{k:<{width}}  {v + differs:<{value_width}}  # {m}")
    return "\n".join(lines)


def print_parser() -> argparse.ArgumentParser:
    """The command line of `python -m trainer.config` (fsdp-config, make config)."""
    parser = cli.parser(
        "config",
        "Print every key of the config (the defaults, a YAML file and key=value overrides, or a run "
        "dir's saved run): the value a run of it would take, its default where that differs, and its meaning. "
        "The config is checked as make check checks it first.",
    )
    parser.add_argument("--print", action="store_true", help="print every key (the default action)")
    parser.add_argument("--table", action="store_true", help="print docs/configuration.md's markdown table of the keys")
    parser.add_argument("--config", help="YAML config file; none: the defaults")
    parser.add_argument(
        "--nproc", type=int, help="processes per node a run would have (the batch); default: parallel.tp, the fewest"
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes a run would have (the batch)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = print_parser().parse_intermixed_args(argv)
    if args.table:
        sys.stdout.write(key_table())
        return 0
    # Printing what a run would take means checking the config as make check does and resolving it
    # (trainer.preflight.check.config_main): that is a floor above this module, which imports none of it
    # (tools/imports.py), so the command line is handed over to it whole, as the Makefile would.
    argv = sys.argv[1:] if argv is None else argv
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "trainer.check", "--print-config", *argv])


if __name__ == "__main__":
    sys.exit(main())
