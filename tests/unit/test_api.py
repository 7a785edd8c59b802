"""The Python API (trainer/api.py) as a user runs it: README's block as written, one-rank training
that writes what `python -m trainer` writes, two calls in one process, the launcher's errors, and
bad input named as the command line names it."""

from __future__ import annotations

import pytest

from tests.helpers.bad_input import one_line
from tests.helpers.run import ROOT, python
from trainer import api

DEFAULT = str(ROOT / "configs" / "default.yaml")


def test_a_bad_override_is_the_command_lines_line(tmp_path):
    with pytest.raises(api.ConfigError) as raised:
        api.config(DEFAULT, ["train.steps=abc"], run_dir=str(tmp_path / "run"))
    line = one_line(python("-m", "trainer", "--config", DEFAULT, f"run_dir={tmp_path / 'run'}", "train.steps=abc"))
    assert line == f"error: {raised.value}"
    assert not (tmp_path / "run").exists()


def test_values_are_overrides_named_as_such(tmp_path):
    """A section's dict and a dotted key land where the YAML would put them; a mistake names the key."""
    cfg = api.config(DEFAULT, ["train.steps=7"], run_dir=tmp_path, train={"steps": 5, "seed": 3}, **{"log.interval": 2})
    assert (cfg.run_dir, cfg.train.steps, cfg.train.seed, cfg.log.interval) == (str(tmp_path), 7, 3, 2)
    with pytest.raises(api.ConfigError, match=r"override 'train.stepz=5': unknown key 'train.stepz'"):
        api.config(DEFAULT, train={"stepz": 5})


def test_launch_raises_the_launchers_line(tmp_path):
    cfg = api.config(DEFAULT, run_dir=str(tmp_path / "run"))
    with pytest.raises(api.LaunchError) as raised:
        api.launch(cfg, nproc="zero")
    cli = one_line(python("-m", "trainer.launch", "--nproc-per-node=zero", "--config", DEFAULT))
    assert (raised.value.code, str(raised.value)) == (2, cli)
    with pytest.raises(
        api.ConfigError, match=r"^the config of run_dir .*: train.global_batch_size: 32 is not divisible by 3"
    ):
        api.launch(cfg, nproc=3)  # checked before a process starts
    assert not (tmp_path / "run").exists()


def test_import_is_cheap(tmp_path):
    """Importing the api and reading a run's rows (api.metrics: JSONL) import no torch."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5, "time": 1.0}\n')
    script = (
        "import sys\nfrom trainer import api\nprint('torch' in sys.modules)\n"
        f"print(api.metrics({str(tmp_path)!r})[0]['loss'], 'torch' in sys.modules)\n"
    )
    proc = python("-c", script)
    assert proc.stdout == "False\n2.5 False\n", proc.stderr


def test_train_refuses_a_process_group_it_did_not_start(tmp_path):
    """torch.distributed starts once per process group: train() starts and ends its own, and says so
    where another is there, before anything is written."""
    script = f"""
import torch.distributed as dist
from trainer import api
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    api.train(api.config({DEFAULT!r}, run_dir={str(tmp_path / "run")!r}))
except RuntimeError as e:
    print(e)
"""
    proc = python("-c", script)
    assert proc.stdout.strip().startswith("trainer.api.train: torch.distributed is already initialized"), proc.stderr
    assert not (tmp_path / "run").exists()
