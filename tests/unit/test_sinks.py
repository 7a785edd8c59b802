"""The trackers' sink interface (trainer/observe/trackers.py, issue #43): a new tracker is one Sink subclass and
one row of SINKS; Trackers opens the configured ones in order, hands each the finite numbers of every
row by step, keeps the run ids of those that continue their run, and closes each once. The real
TensorBoard, W&B and MLflow runs are in tests/system/test_trackers.py (slow)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from trainer.config import LogArgs
from trainer.observe import trackers


class Probe(trackers.Sink):
    """A tracker of the test's own: what it was given."""

    package, install, keeps_id = "json", "probe", True
    seen: list = []

    def __init__(self, run_id):
        self.run_id = run_id

    @classmethod
    def open(cls, run_dir, args, config, resumed_step, run_id):
        cls.seen.append(("open", resumed_step, run_id, config))
        return cls(run_id or "probe-1")

    def log(self, step, values):
        self.seen.append(("log", step, values))

    def close(self, finished):
        self.seen.append(("close", finished))


def test_a_new_sink_is_one_class_and_one_row(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.SINKS, "probe", Probe)
    monkeypatch.setattr(Probe, "seen", [])
    args = SimpleNamespace(tensorboard=False, wandb=False, mlflow=False, probe=True, project=None)
    assert trackers.sinks_on(args) == ["probe"]
    first = trackers.Trackers(str(tmp_path), args, {"train": {"steps": 3}}, None)
    first.log({"step": 1, "loss": 2.5, "eval_loss": math.nan, "stopped": True, "source": "x", "tokens": 7})
    first.log({"loss": 1.0})  # no step: not a step's row
    first.close(finished=False)
    first.close()  # closed once
    assert Probe.seen == [
        ("open", None, None, {"train": {"steps": 3}}),
        ("log", 1, {"loss": 2.5, "tokens": 7.0}),
        ("close", False),
    ]
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"probe": "probe-1"}

    trackers.Trackers(str(tmp_path), args, {}, 1).close()  # a restart continues the kept run
    assert Probe.seen[-2:] == [("open", 1, "probe-1", {}), ("close", True)]
    assert trackers.missing_package("probe") is None  # its package (json) imports


def test_each_tracker_names_its_package_and_its_install():
    assert list(trackers.SINKS) == ["tensorboard", "wandb", "mlflow"]  # log.<name> keys, opened in this order
    assert [s.package for s in trackers.SINKS.values()] == ["tensorboard", "wandb", "mlflow"]
    assert [s.keeps_id for s in trackers.SINKS.values()] == [False, True, True]
    for name in trackers.SINKS:
        assert isinstance(getattr(LogArgs(), name), bool)  # its switch in the config


def test_tensorboard_sink_holds_each_step_once_after_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    args = LogArgs(progress=False, tensorboard=True)
    run = trackers.Trackers(str(tmp_path), args, {}, None)
    for step in (1, 2, 3):
        run.log({"step": step, "loss": float(step), "eval_loss": 10.0 + step})
    run.close()
    run = trackers.Trackers(str(tmp_path), args, {}, 1)  # resumed after step 1: 2 and 3 again
    for step in (2, 3):
        run.log({"step": step, "loss": -float(step)})
    run.close()
    assert not (tmp_path / "trackers.json").exists()  # TensorBoard keeps no run id
    mux = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "tensorboard"))
    mux.Reload()
    (name,) = mux.Runs()
    assert [(e.step, e.value) for e in mux.Scalars(name, "train/loss")] == [(1, 1.0), (2, -2.0), (3, -3.0)]
    assert [(e.step, e.value) for e in mux.Scalars(name, "eval/loss")] == [(1, 11.0)]
