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

import importlib.util
import logging
import math
import os

from trainer import files, layout

log = logging.getLogger("trainer")

IDS_FILE = "trackers.json"  # {"wandb": run id, "mlflow": run id} of the run dir's tracker runs
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # log.<key> -> the module it needs


def missing_package(name: str) -> str | None:
    """The message for log.<name>=true without its package installed, or None."""
    module = PACKAGES[name]
    if importlib.util.find_spec(module) is not None:
        return None
    extra = f"'fsdp-trainer[{name}]'" if name != "tensorboard" else "tensorboard"
    return f"is true but the {module} package is not installed; pip install {extra}, or set it to false"


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


def _tag(key: str) -> str:
    """TensorBoard/W&B/MLflow name of a metrics.jsonl key: eval_loss -> eval/loss, loss -> train/loss."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


class Trackers:
    """The configured trackers of one run, on rank 0; `log` takes metrics.jsonl's rows."""

    def __init__(self, run_dir: str, args, config: dict, resumed_step: int | None):
        self.writers: list = []
        self.held: list[files.HeldFolder] = []  # folders held open for the trackers' writers
        ids = _read_ids(run_dir)
        name = os.path.basename(os.path.abspath(run_dir))
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A link planted at <run_dir>/tensorboard (a neighbour in a shared run dir) would have the
            # events written into any folder of ours: the folder is checked and held (issue 41 item 4);
            # the start's check (trainer/check.py, layout.WRITTEN_FOLDERS) refuses one before this.
            # The writer is given the held folder's own path (/proc/<pid>/fd/N): a link swapped in at the
            # name afterwards changes nothing.
            folder = os.path.join(run_dir, layout.TENSORBOARD_DIR)
            try:
                files.make_folder(folder)
                held = files.HeldFolder(folder)
            except files.UnsafeFile as e:
                log.warning(f"{e}: no TensorBoard events are written in this start (metrics.jsonl has every row)")
            else:
                self.held.append(held)
                folder = held.path
                # purge_step: events at or after it, written before a crash, are dropped from the view
                purge = resumed_step + 1 if resumed_step is not None else None
                self.tensorboard = SummaryWriter(folder, purge_step=purge)
                self.writers.append(self._tensorboard)
        if args.wandb:
            import wandb

            files.make_folder(os.path.join(run_dir, layout.WANDB_DIR))  # wandb writes there itself: not a link

            self.wandb = wandb.init(
                project=args.project or name, name=name, id=ids.get("wandb"), resume="allow", dir=run_dir, config=config
            )
            ids["wandb"] = self.wandb.id
            self.writers.append(self._wandb)
        if args.mlflow:
            import mlflow

            mlflow.set_experiment(args.project or name)
            self.mlflow = mlflow.start_run(run_id=ids.get("mlflow"), run_name=None if "mlflow" in ids else name)
            if "mlflow" not in ids:
                mlflow.log_params(_flat_params(config))
            ids["mlflow"] = self.mlflow.info.run_id
            self.writers.append(self._mlflow)
        if args.wandb or args.mlflow:
            _write_ids(run_dir, ids)

    def log(self, row: dict) -> None:
        values = _numbers(row)
        if "step" in row and values:
            for write in self.writers:
                write(int(row["step"]), values)

    def _tensorboard(self, step: int, values: dict) -> None:
        for key, value in values.items():
            self.tensorboard.add_scalar(_tag(key), value, step)
        self.tensorboard.flush()

    def _wandb(self, step: int, values: dict) -> None:
        self.wandb.log({_tag(k): v for k, v in values.items()}, step=step)

    def _mlflow(self, step: int, values: dict) -> None:
        import mlflow

        mlflow.log_metrics({_tag(k).replace("/", "_"): v for k, v in values.items()}, step=step)

    def close(self, finished: bool = True) -> None:
        if hasattr(self, "tensorboard"):
            self.tensorboard.close()
        for held in self.held:
            held.close()
        self.held = []
        if hasattr(self, "wandb"):
            self.wandb.finish(exit_code=0 if finished else 1)
        if hasattr(self, "mlflow"):
            import mlflow

            mlflow.end_run("FINISHED" if finished else "KILLED")


def _flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: dotted keys, values as text (MLflow caps a value at 6000 chars)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat_params(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = str(value)[:6000]
    return out
