"""The run configuration: typed sections, loaded from YAML plus dotted command-line overrides.

Precedence: dataclass defaults, then the YAML file, then `key.sub=value` overrides. Each section is
defined beside the code it configures; this module only nests them and checks what a user wrote.
Every mistake becomes a `ConfigError` whose message says what, where and what to do.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.checkpoint import CheckpointArgs
from trainer.data import DataArgs
from trainer.launch import LaunchArgs
from trainer.metrics import LogArgs
from trainer.models import ModelArgs
from trainer.optim import OptimArgs
from trainer.parallel import ParallelArgs


class ConfigError(Exception):
    """A mistake in the user's configuration; the message is shown as one line."""


@dataclass
class TrainArgs:
    steps: int = 200  # total optimizer steps of the run
    global_batch_size: int = 32  # samples per optimizer step, summed over all ranks
    # Samples per optimizer step on each rank (the tutorials' batch_size): when set, global_batch_size
    # becomes this times the number of processes, whatever it says.
    rank_batch_size: int | None = None
    # How a step's loss is reduced over the rank's samples (tokens for the LM) before backward: mean,
    # or sum (the MNIST tutorial's nll_loss(reduction="sum"): gradients micro_batch x larger). The
    # gradients are averaged over the ranks either way; the logged loss is the mean in both cases.
    loss_reduction: Literal["mean", "sum"] = "mean"
    micro_batch_size: int | None = None  # samples per forward/backward on one rank; None: all at once
    seed: int = 0  # seeds the weights and the order of the data
    grad_clip: float | None = 1.0  # max global gradient norm, > 0; None disables clipping


@dataclass
class EvalArgs:
    interval: int = 0  # optimizer steps between evaluations; 0 disables them
    batches: int = 4  # micro-batches per rank in one evaluation


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


def load(path: str | None, overrides: list[str] = ()) -> Config:
    """Read `path` (may be None for pure defaults) and apply `key=value` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(path)
    sources = {key: path or "defaults" for key in _flatten(raw)}
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
        node[parts[-1]] = yaml.safe_load(text) if text else None
        sources[key] = f"override {item!r}"
    return _build(Config, raw, prefix="", sources=sources, default_source=path or "defaults")


class _DuplicateKey(Exception):
    def __init__(self, key, first: int, second: int):
        self.key, self.first, self.second = key, first, second


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error (SafeLoader
    silently keeps the last value)."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` is read by SafeLoader itself
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in lines:
                raise _DuplicateKey(key, lines[key], line)
            lines[key] = line
        return super().construct_mapping(node, deep)



def _read_yaml(path: str) -> dict:
    """The top-level mapping of the YAML file at `path`; every problem with the file is a ConfigError."""
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a folder; pass a YAML file with --config")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found; pass an existing file with --config")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          f"save the file as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror}); check its permissions") from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{path}:{e.second}: {e.key}: given twice (lines {e.first} and {e.second}); "
                          f"keep one of them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML ({problem}); fix the syntax") from None
    if raw is None:
        raise ConfigError(f"{path}: the file is empty (no settings, only blanks or comments); write settings "
                          f"into it (configs/default.yaml is an example)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return raw


def from_dict(raw: dict, where: str) -> Config:
    """A Config from a mapping such as to_dict's (a checkpoint's saved config); `where` names it."""
    return _build(Config, raw, prefix="", sources={}, default_source=where)


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
        names = [" or ".join(repr(c) for c in typing.get_args(a)) if typing.get_origin(a) is Literal else a.__name__
                 for a in args]
        raise ConfigError(f"{where}: '{key}' is {value!r}; expected {' or '.join(names)}")
    if origin is tuple:
        args = typing.get_args(tp)
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
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
