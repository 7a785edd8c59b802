"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow (rank 0 only).

    log.tensorboard: true   event files in <run_dir>/tensorboard/ (tensorboard --logdir <run_dir>/tensorboard)
    log.wandb: true         a W&B run (pip install 'fsdp-trainer[wandb]'; WANDB_MODE=offline works offline)
    log.mlflow: true        an MLflow run at MLFLOW_TRACKING_URI (pip install 'fsdp-trainer[mlflow]')

metrics.jsonl stays the record of the run; a tracker is a view of it. A restart continues the same
tracker run: the W&B and MLflow run ids are kept in <run_dir>/trackers.json, and TensorBoard purges
the events after the resumed step, so no step is shown twice. W&B and MLflow keep what was logged
after the resumed step (neither can delete it): after a crash their charts hold both the lost and
the redone steps; metrics.jsonl and TensorBoard hold each step once.
"""

from __future__ import annotations

import abc
import importlib.util
import logging
import math
import os

from trainer.rundir import files, layout

log = logging.getLogger("trainer")

IDS_FILE = "trackers.json"  # {"wandb": run id, "mlflow": run id} of the run dir's tracker runs


def missing_package(name: str) -> str | None:
    """The message for log.<name>=true without its package installed, or None."""
    module = SINKS[name].package
    if importlib.util.find_spec(module) is not None:
        return None
    return f"is true but the {module} package is not installed; pip install {SINKS[name].install}, or set it to false"


def _read_ids(run_dir: str) -> dict:
    try:
        ids = files.read_json(os.path.join(run_dir, IDS_FILE))
    except files.UnsafeFile as e:  # planted in a shared run dir: new ids, and the file is replaced
        log.warning(f"{e}: the trackers start new runs")
        return {}
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def _write_ids(run_dir: str, ids: dict) -> None:
    files.write_json(os.path.join(run_dir, IDS_FILE), ids)


def _numbers(row: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def tag(key: str) -> str:
    """TensorBoard/W&B/MLflow name of a metrics.jsonl key: eval_loss -> eval/loss, loss -> train/loss."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


class Sink(abc.ABC):
    """One tracker of a run, on rank 0: opened at the run's start, given each metrics row's numbers,
    closed at its end. A new tracker is a subclass and a row of SINKS (with its log.<name> switch in
    trainer/config.py's LogArgs); nothing else asks which trackers there are."""

    # The module it needs: log.<name>=true without it is bad input at the start (trainer/preflight/check.py).
    package = ""
    install = ""  # what to pip install for it, as the bad-input line says
    keeps_id = False  # its run continues after a restart: the run id is kept in <run_dir>/trackers.json
    run_id: str | None = None  # the tracker's own id of the run, where keeps_id

    @classmethod
    @abc.abstractmethod
    def open(cls, run_dir: str, args, config: dict, resumed_step: int | None, run_id: str | None) -> Sink | None:
        """The sink of the run in `run_dir` (log.* `args`, the resolved `config` as a dict), resumed
        after `resumed_step` (None: a first start), continuing tracker run `run_id` where one is kept;
        None where it cannot start (it says why in a warning; metrics.jsonl has every row)."""

    @abc.abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """The finite numbers of one metrics row, by metrics.jsonl key (tag() names them)."""

    @abc.abstractmethod
    def close(self, finished: bool) -> None:
        """The run's end: `finished` False where it stopped on a failure."""


class TensorBoard(Sink):
    """Event files in <run_dir>/tensorboard/; a restart purges the events after the resumed step."""

    package = install = "tensorboard"

    def __init__(self, writer, held: files.HeldFolder):
        self.writer, self.held = writer, held

    @classmethod
    def open(cls, run_dir, args, config, resumed_step, run_id):
        from torch.utils.tensorboard import SummaryWriter

        # A link planted at <run_dir>/tensorboard (a neighbour in a shared run dir) would have the
        # events written into any folder of ours: the folder is checked and held (issue 41 item 4);
        # the start's check (trainer/preflight/check.py, layout.WRITTEN_FOLDERS) refuses one before this.
        # The writer is given the held folder's own path (/proc/<pid>/fd/N): a link swapped in at the
        # name afterwards changes nothing.
        folder = os.path.join(run_dir, layout.TENSORBOARD_DIR)
        try:
            files.make_folder(folder)
            held = files.HeldFolder(folder)
        except files.UnsafeFile as e:
            log.warning(f"{e}: no TensorBoard events are written in this start (metrics.jsonl has every row)")
            return None
        # purge_step: events at or after it, written before a crash, are dropped from the view
        purge = resumed_step + 1 if resumed_step is not None else None
        return cls(SummaryWriter(held.path, purge_step=purge), held)

    def log(self, step, values):
        for key, value in values.items():
            self.writer.add_scalar(tag(key), value, step)
        self.writer.flush()

    def close(self, finished):
        self.writer.close()
        self.held.close()


class WandB(Sink):
    """A Weights & Biases run, its files in <run_dir>/wandb/ (WANDB_MODE=offline works offline)."""

    package, install, keeps_id = "wandb", "'fsdp-trainer[wandb]'", True

    def __init__(self, run):
        self.run, self.run_id = run, run.id

    @classmethod
    def open(cls, run_dir, args, config, resumed_step, run_id):
        import wandb

        files.make_folder(os.path.join(run_dir, layout.WANDB_DIR))  # wandb writes there itself: not a link
        name = os.path.basename(os.path.abspath(run_dir))
        return cls(
            wandb.init(project=args.project or name, name=name, id=run_id, resume="allow", dir=run_dir, config=config)
        )

    def log(self, step, values):
        self.run.log({tag(k): v for k, v in values.items()}, step=step)

    def close(self, finished):
        self.run.finish(exit_code=0 if finished else 1)


class MLflow(Sink):
    """An MLflow run at MLFLOW_TRACKING_URI, the config as its parameters (at its first start)."""

    package, install, keeps_id = "mlflow", "'fsdp-trainer[mlflow]'", True

    def __init__(self, run_id: str):
        self.run_id = run_id

    @classmethod
    def open(cls, run_dir, args, config, resumed_step, run_id):
        import mlflow

        name = os.path.basename(os.path.abspath(run_dir))
        mlflow.set_experiment(args.project or name)
        run = mlflow.start_run(run_id=run_id, run_name=None if run_id else name)
        if run_id is None:
            mlflow.log_params(_flat_params(config))
        return cls(run.info.run_id)

    def log(self, step, values):
        import mlflow

        mlflow.log_metrics({tag(k).replace("/", "_"): v for k, v in values.items()}, step=step)

    def close(self, finished):
        import mlflow

        mlflow.end_run("FINISHED" if finished else "KILLED")


# The trackers by their log.<name> switch, opened in this order.
SINKS: dict[str, type[Sink]] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def sinks_on(args) -> list[str]:
    """The names of SINKS whose log.<name> switch is on in `args` (LogArgs)."""
    return [name for name in SINKS if getattr(args, name)]


class Trackers:
    """The configured trackers of one run, on rank 0; `log` takes metrics.jsonl's rows."""

    def __init__(self, run_dir: str, args, config: dict, resumed_step: int | None):
        self.sinks: list[Sink] = []
        ids = _read_ids(run_dir)
        on = sinks_on(args)
        for name in on:
            sink = SINKS[name].open(run_dir, args, config, resumed_step, ids.get(name))
            if sink is not None:
                self.sinks.append(sink)
                if sink.run_id is not None:
                    ids[name] = sink.run_id
        if any(SINKS[name].keeps_id for name in on):
            _write_ids(run_dir, ids)

    def log(self, row: dict) -> None:
        values = _numbers(row)
        if "step" in row and values:
            for sink in self.sinks:
                sink.log(int(row["step"]), values)

    def close(self, finished: bool = True) -> None:
        sinks, self.sinks = self.sinks, []  # closed once
        for sink in sinks:
            sink.close(finished)


def _flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: dotted keys, values as text (MLflow caps a value at 6000 chars)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat_params(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = str(value)[:6000]
    return out
