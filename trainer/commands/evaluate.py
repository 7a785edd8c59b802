"""Evaluate a checkpoint without training: the training loop's evaluation, on demand.

    python -m trainer.evaluate RUN_DIR [--step N | --best] [eval.batches=32 data.eval_path=... ...]

The checkpoint (the newest complete one by default; --best: the best eval loss's) is evaluated
with the config it was saved with, changed by the overrides given (eval.*, data.* and parallel.*
keys only: the model is the checkpoint's). The numbers are trainer.train.evaluate's, on the same evaluation samples: the
training loop's evaluation at that step gives the same eval_loss. The result is one JSON line on
stdout, `{"step", "eval_loss", "eval_accuracy" (classifiers), "eval_batches", "time" (unix seconds),
"source": "trainer.evaluate"}` (with data.sources' own eval_path files, `eval_loss/<source>` each and
eval_loss their weighted mean), also appended to RUN_DIR/metrics.jsonl as an evaluation row.

One process is enough whatever number of processes trained; under torchrun each rank reads the
whole model and the ranks share the batches, as in training. (With train.micro_batch_size set, the
evaluation samples depend on the number of processes, as the training loop's do: run as many as
trained to see its very samples.) The run's lease is not taken: this reads the checkpoint and writes
nothing but the one metrics row (one append), so it may run beside the training of the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from trainer import cli, data, models
from trainer import dist as distributed
from trainer.checkpoint import manager, remote
from trainer.commands.export import _config, add_choice, consolidate, readable
from trainer.config import ConfigError, eval_data_problem, from_dict, holds_out, to_dict
from trainer.observe.metrics import finite_or_null
from trainer.parallel import plan as parallel
from trainer.rundir import files, layout, objects

# What may change for an evaluation; the rest (the model above all) is the checkpoint's.
SECTIONS = ("eval", "data", "parallel")


def config(run_dir: str, path: str, overrides: list[str]):
    """The config the checkpoint at `path` was saved with, then the overrides (ConfigError if bad)."""
    for item in overrides:
        if item.partition("=")[0].split(".")[0] not in SECTIONS:
            raise ConfigError(
                f"override {item!r}: trainer.evaluate changes {', '.join(s + '.*' for s in SECTIONS)} "
                f"keys only; the model and the rest are the checkpoint's"
            )
    saved = from_dict(to_dict(_config(run_dir, path)), where=f"{path}/meta.json")
    cfg = from_dict(to_dict(saved), where=f"{path}/meta.json", overrides=overrides)
    if (cfg.data.eval_fraction or 0) != (saved.data.eval_fraction or 0) and holds_out(saved.data):
        raise ConfigError(
            f"data.eval_fraction={cfg.data.eval_fraction}: what the run held out for evaluation is its own "
            f"({saved.data.eval_fraction or 0:g}); another fraction is data it trained on: give data.eval_path instead"
        )
    if eval_data_problem(cfg.data):
        raise ConfigError(
            f"{path}: the run held nothing out for evaluation (data.eval_fraction {saved.data.eval_fraction or 0:g}: "
            f"it started without eval.interval, or with a trainer before the split), so every sample of its data "
            f"may have been trained on; give data.eval_path=FILE (or DIR) of data it did not train on"
        )
    if cfg.eval.batches < 1:
        raise ConfigError(f"eval.batches is {cfg.eval.batches}; give 1 or more micro-batches per rank")
    # How the weights are spread does not change the numbers; a hybrid mesh or a pipeline of the
    # training's shape may not fit this number of processes. Mixed precision (the numbers) stays.
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel, sharding="full", shard_size=None, activation_checkpointing=False, cpu_offload=False, pp=1
        ),
    )


def append_row(run_dir: str, row: dict) -> None:
    """Append `row` to RUN_DIR/metrics.jsonl in one write (O_APPEND: beside a training that writes too)."""
    line = (json.dumps(finite_or_null(row), allow_nan=False) + "\n").encode()
    with files.open_append(os.path.join(run_dir, layout.METRICS_FILE)) as f:
        f.buffer.write(line)  # one write, as the trainer's own rows


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        remote.remove_copies()  # an s3:// run dir's local copy: run() ends by os._exit, past atexit


def _main(argv: list[str] | None) -> int:
    parser = cli.parser("evaluate", __doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    add_choice(parser)
    parser.add_argument("overrides", nargs="*", help="eval.*, data.*, parallel.* key=value, e.g. eval.batches=32")
    args = parser.parse_intermixed_args(argv)
    env = distributed.read_env()
    try:  # everything that can be wrong, before a process group exists
        run_dir = readable(args.run_dir, args.step, args.best)  # an s3:// one: a local copy (not appended to)
        state, path = consolidate(run_dir, args.step, args.best)
        cfg = config(run_dir, path, args.overrides)
        models.family_of(cfg.model)  # model.family's module imports (FamilyError otherwise)
        eval_set = data.build(cfg.data, cfg.model, cfg.train.seed, train=False)
        # the run's tensor parallelism where it fits these processes, else none; the batch divides
        # over the data-parallel ranks (a tensor-parallel group's ranks share their samples)
        p = cfg.parallel if env.world_size % cfg.parallel.tp == 0 else dataclasses.replace(cfg.parallel, tp=1)
        if cfg.train.global_batch_size % (env.world_size // p.tp):
            ranks = f"{env.world_size} processes" + (f" / parallel.tp={p.tp}" if p.tp > 1 else "")
            raise ConfigError(
                f"train.global_batch_size={cfg.train.global_batch_size} does not divide over {ranks}; "
                f"evaluate on a number of processes that divides it"
            )
    except (ConfigError, manager.CheckpointError, data.DataError, models.FamilyError, objects.StoreError) as e:
        if env.is_main:
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        env = distributed.init(timeout_s=cfg.parallel.timeout_s)
        model = models.build(cfg.model)
        model.load_state_dict(state)
        del state
        plan = parallel.Plan.of(p, env)
        model = plan.apply(model, models.spec(cfg.model))  # its mixed precision
        from trainer.train import evaluate_sources

        result = evaluate_sources(model, cfg, env, eval_set, plan.autocast_dtype(model), plan)
    finally:
        distributed.shutdown()
    if env.is_main:
        row = {
            "step": manager.read_meta(path)["step"],
            **result,
            "eval_batches": cfg.eval.batches,
            "time": time.time(),
            "source": "trainer.evaluate",
        }
        if not objects.is_remote(args.run_dir):  # the bucket's metrics are the run's to upload
            append_row(args.run_dir, row)
        print(json.dumps(finite_or_null(row), allow_nan=False), flush=True)
    return 0


def run() -> None:
    """The fsdp-evaluate command: main, ended as a rank is (trainer/dist.py's exit_process)."""
    distributed.exit_process(main())


if __name__ == "__main__":
    run()
