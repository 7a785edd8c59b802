"""Trackers: TensorBoard (read back by TensorBoard's own loader and a real server), W&B offline and a
real MLflow server, each continuing the same tracker run after a restart."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.outputs import rows
from tests.helpers.run import TINY, env, train
from trainer.dist import free_port

pytestmark = pytest.mark.slow  # trains runs, starts TensorBoard and MLflow servers

CRASHED = [*TINY, "checkpoint.interval=3", "checkpoint.keep=0"]


def _crash_after_logging(run_dir: Path) -> None:
    """What a kill between step 6's rows and its save leaves: the rows of 4-6, the newest checkpoint 3."""
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")


def _get(url: str, timeout: float = 60):
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    run_dir = tmp_path_factory.mktemp("tb") / "run"
    train(run_dir, 1, *CRASHED, "log.tensorboard=true")
    _crash_after_logging(run_dir)
    train(run_dir, 1, *CRASHED, "log.tensorboard=true")
    return run_dir


def test_tensorboard_holds_each_step_once_after_a_restart(tensorboard_run):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer().AddRunsFromDirectory(str(tensorboard_run / "tensorboard"))
    mux.Reload()
    (run,) = mux.Runs()
    events = mux.Scalars(run, "train/loss")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    redone = {r["step"]: r["loss"] for r in rows(tensorboard_run)}  # metrics.jsonl: the redone values last
    assert [pytest.approx(e.value, rel=1e-6) for e in events] == [redone[s] for s in range(1, 7)]


def test_a_real_tensorboard_server_serves_the_loss_series(tensorboard_run):
    port = free_port("127.0.0.1")
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "tensorboard"),
            "--logdir",
            str(tensorboard_run / "tensorboard"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        tags = _get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags")
        (run,) = tags
        assert "train/loss" in tags[run]
        series = _get(f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run={run}&tag=train/loss")
        assert [point[1] for point in series] == [1, 2, 3, 4, 5, 6]
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_wandb_offline_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    train(run_dir, 1, *CRASHED, "log.wandb=true")
    first = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    _crash_after_logging(run_dir)
    train(run_dir, 1, *CRASHED, "log.wandb=true")
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"] == first
    sessions = sorted((run_dir / "wandb").glob(f"offline-run-*-{first}"))
    assert len(sessions) == 2 and all(list(s.glob("*.wandb")) for s in sessions)


def test_mlflow_server_gets_one_run_continued_after_a_restart(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    port = free_port("127.0.0.1")
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--default-artifact-root",
            str(tmp_path / "art"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        uri = f"http://127.0.0.1:{port}"
        _wait_http(f"{uri}/health")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        run_dir = tmp_path / "run"
        train(run_dir, 1, *CRASHED, "log.mlflow=true", "log.project=trainer-test")
        _crash_after_logging(run_dir)
        train(run_dir, 1, *CRASHED, "log.mlflow=true", "log.project=trainer-test")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name("trainer-test")
        (run,) = client.search_runs([experiment.experiment_id])
        assert run.info.run_id == json.loads((run_dir / "trackers.json").read_text())["mlflow"]
        assert run.data.params["run_dir"] == str(run_dir) and run.info.status == "FINISHED"
        steps = sorted({m.step for m in client.get_metric_history(run.info.run_id, "train_loss")})
        assert steps == [1, 2, 3, 4, 5, 6]
    finally:
        server.terminate()
        server.wait(timeout=30)


def _wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def test_a_tracker_without_its_package_is_one_line(tmp_path, monkeypatch):
    from trainer.observe import trackers

    monkeypatch.setattr(trackers.SINKS["wandb"], "package", "no_such_module_for_the_test")
    assert trackers.missing_package("wandb") == (
        "is true but the no_such_module_for_the_test package is not installed; "
        "pip install 'fsdp-trainer[wandb]', or set it to false"
    )
