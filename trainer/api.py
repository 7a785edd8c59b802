"""The Python API, for a notebook or another program: build a config, train, read the metrics.

    from trainer import api

    cfg = api.config("configs/default.yaml", ["train.steps=6"], run_dir="runs/nb", model={"seq_len": 32})
    api.train(cfg)                # one rank in this process (or each rank of a torchrun)
    api.launch(cfg, nproc=2)      # python -m trainer.launch with 2 processes; 0, else LaunchError
    rows = api.metrics(cfg.run_dir)

Each is the command line's own path, not a second one: config() is `load_run` (the run dir's saved
run is the base, as for `python -m trainer`), train() runs `python -m trainer`'s checks and then
trainer.train, launch() runs the launcher, metrics() reads metrics.jsonl as `python -m trainer.metrics`
does. Bad input raises ConfigError with the line the command line prints after "error: ".

Importing this module imports no torch (the config needs none); train() and metrics() do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from trainer.config import Config, ConfigError, dump, load_run, to_dict

__all__ = ["Config", "ConfigError", "LaunchError", "config", "launch", "metrics", "train"]


class LaunchError(Exception):
    """launch()'s launcher exited non-zero; the message is its last line on stderr, `code` its exit code."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.code = code


def config(file: str | None = None, overrides: list[str] | tuple[str, ...] = (), **values: Any) -> Config:
    """The run's config: the YAML `file` (None: the defaults), then `values`, then the dotted
    `overrides` ("train.steps=100", as on the command line). A value is a section's mapping
    (`train={"steps": 100}`), a key of the top (`run_dir="runs/x"`), or a dotted key
    (`**{"train.steps": 100}`); each becomes a key=value override, so a mistake is named as the
    command line names it. A run dir that holds a run continues it, as `python -m trainer` does:
    its saved config is the base, `file` fills only what it lacks, and what is given here changes it."""
    given = [f"{key}={json.dumps(value, default=str)}" for key, value in _dotted(values).items()]  # a Path: str
    cfg, _, notes = load_run(file, [*given, *overrides])
    if os.environ.get("RANK", "0") == "0":  # what `python -m trainer` says about a continued run, once
        for line in notes:
            print(line, flush=True)
    return cfg


def _dotted(values: dict, prefix: str = "") -> dict:
    """{dotted key: value} of `values`, a mapping's values that are mappings taken key by key."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


# What trainer.dist.init sets in os.environ for a process of its own: put back after train(), so that
# a later call (or launch(), whose ranks inherit the environment) starts afresh.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def train(cfg: Config) -> None:
    """Train `cfg` in this process: one rank (gloo on the CPU, NCCL on a GPU), or the rank torchrun's
    variables name when a torchrun started this program. The checks of `python -m trainer` come
    first (ConfigError, before anything is written); the run dir's lease is taken as there. Returns
    when the run reached train.steps or stopped early (train.early_stop_patience); the trainer's
    errors (a lost lease, divergence) are raised.

    It may be called again in the same process (to continue the run, or train another): each call
    starts and ends its own process group. A group started otherwise is refused (RuntimeError).
    Ctrl-C interrupts at once (the run continues from its last checkpoint); launch() stops gracefully."""
    import torch.distributed as dist

    from trainer.dist import read_env, shutdown
    from trainer.observe.metrics import setup_logging
    from trainer.preflight.startup import Target, preflight
    from trainer.train import train as run

    if dist.is_initialized():  # not this module's: each call ends the group it starts
        raise RuntimeError(
            "trainer.api.train: torch.distributed is already initialized in this process (by something else); "
            "call destroy_process_group() first, or use trainer.api.launch() to train in processes of its own"
        )
    env = read_env()
    ready = preflight(Target.rank(env), cfg, where=_where(cfg))  # python -m trainer's checks, for this process
    setup_logging(env.rank)
    saved = {name: os.environ.get(name) for name in _DIST_ENV}
    try:
        run(ready)
    finally:
        shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _where(cfg: Config) -> str:
    """What a ConfigError calls a config given to train() or launch(): it has no file of its own."""
    return f"the config of run_dir {cfg.run_dir}"


def launch(cfg: Config, nproc: int | str = "auto", options: list[str] | tuple[str, ...] = ()) -> int:
    """Train `cfg` with `nproc` processes of this machine ("auto": one per GPU, else 1): `python -m
    trainer.launch`, the launcher of `make run`, with its checks, restarts and graceful stop, in a
    process of its own; `options`: more of its options (--max-restarts=0). Its output is passed on
    to this process's; Ctrl-C stops it as at `make run` (the ranks save) and is raised again.
    Returns 0; raises LaunchError with the launcher's last line on stderr (its `error:` line for
    bad input) and its exit code otherwise.

    The config travels as a YAML file, plus, for a run dir that holds a run (whose saved config is
    the base), the keys where `cfg` differs from it, as key=value overrides. The config is checked
    here first, so that a mistake is named as train() names it, not by that file's passing name."""
    if isinstance(nproc, int):  # "auto" is counted by the launcher, which checks it then
        from trainer.preflight.startup import Target, preflight

        preflight(Target.api(nproc), cfg, where=_where(cfg))
    with tempfile.TemporaryDirectory(prefix="trainer-api-") as folder:
        path = os.path.join(folder, "config.yaml")
        dump(cfg, path)
        base, _, _ = load_run(path)  # what the launcher reads from the file alone
        want, have = _dotted(to_dict(cfg)), _dotted(to_dict(base))
        changed = [f"{key}={json.dumps(value)}" for key, value in want.items() if have.get(key) != value]
        command = [sys.executable, "-m", "trainer.launch", f"--nproc-per-node={nproc}", *options]
        proc = subprocess.Popen(
            [*command, "--config", path, *changed],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a terminal's Ctrl-C reaches it once, from here, not twice
        )
        try:
            code, last = _follow(proc)
        except BaseException:  # Ctrl-C (a notebook's interrupt reaches this process only)
            proc.send_signal(signal.SIGINT)  # the launcher stops the ranks, which save, as at make run's Ctrl-C
            proc.wait()
            raise
    if code:
        raise LaunchError(last or f"python -m trainer.launch exited {code}", code)
    return code


def _follow(proc: subprocess.Popen) -> tuple[int, str]:
    """Pass `proc`'s output on to this process's sys.stdout and sys.stderr (a notebook's cell, which
    a child's inherited descriptors would miss) as it comes, until it ends: (exit code, last line
    on its stderr)."""
    out = threading.Thread(target=lambda: [sys.stdout.write(line) for line in proc.stdout], daemon=True)
    out.start()
    last = ""
    for line in proc.stderr:
        sys.stderr.write(line)
        last = line.strip() or last
    code = proc.wait()
    out.join()
    return code, last


def metrics(run_dir: str) -> list[dict]:
    """The rows of `run_dir`'s metrics.jsonl, oldest first (trainer.metrics' reader: a line that is
    not a row is left out with a warning; a link or FIFO there is refused): training rows have
    `step` and `loss`, evaluation rows `eval_loss`, event rows `event`."""
    from trainer.observe.metrics import read_rows
    from trainer.rundir.layout import METRICS_FILE

    return read_rows(os.path.join(run_dir, METRICS_FILE))
