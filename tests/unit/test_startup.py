"""The one preflight (trainer/preflight/startup.py): each target gets the same answer for the same config,
the config is resolved once, and what the launcher checked reaches its ranks on their command line."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.helpers.bad_input import DEFAULT
from tests.helpers.run import TINY, python
from trainer import config, dist, models
from trainer.config import Config, ConfigError
from trainer.launchers import torchrun
from trainer.preflight import check, startup
from trainer.preflight.startup import Ready, Target, preflight

WORLD = 2  # every target below runs the config on 2 processes


def targets() -> dict[str, Target]:
    """The five targets, each for 2 processes on one node of this machine (a CPU one)."""
    return {
        "rank": Target.rank(dist.Env(0, 0, WORLD, WORLD, torch.device("cpu"))),
        "launch": Target.launcher(str(WORLD), 1),
        "slurm": Target.slurm(1, WORLD),
        "k8s": Target.k8s(1, WORLD),
        "api": Target.api(WORLD),
    }


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    """This machine as a CPU one (on a GPU machine the launcher would count its GPUs instead)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture()
def resolves(monkeypatch) -> list:
    """The calls of config.resolve (as trainer.check and anything else reach it), and of the model
    families' resolve that it calls."""
    calls: list = []
    real, real_model = config.resolve, models.resolve

    def counted(*args, **kw):
        calls.append("config")
        return real(*args, **kw)

    def counted_model(*args, **kw):
        calls.append("model")
        return real_model(*args, **kw)

    monkeypatch.setattr(config, "resolve", counted)
    monkeypatch.setattr(check, "resolve", counted)
    monkeypatch.setattr(models, "resolve", counted_model)
    return calls


BAD = [
    "train.global_batch_size=7",  # the batch arithmetic
    "model.size=huge",  # the family's own check
    "parallel.tp=3",  # the plan's
    "train.early_stop_patience=2",  # early stopping without evaluation
]


@pytest.mark.parametrize("bad", BAD)
def test_each_target_gives_the_same_line_for_the_same_bad_config(tmp_path, bad):
    lines = {}
    for name, target in targets().items():
        with pytest.raises(ConfigError) as e:
            preflight(target, DEFAULT, [f"run_dir={tmp_path / 'run'}", *TINY, bad])
        lines[name] = str(e.value)
    assert len(set(lines.values())) == 1, lines
    assert lines["rank"].startswith(f"override '{bad}': "), lines["rank"]
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("name", ["rank", "launch", "slurm", "k8s", "api"])
@pytest.mark.parametrize("layout", [[], ["parallel.tp=2", "train.global_batch_size=12"]], ids=["fsdp", "tp2"])
def test_the_config_is_resolved_once_for_each_target(tmp_path, resolves, name, layout):
    """validate's checks ask the resolved shape up to four times (the family, the tokens' sidecars,
    the sources, tensor parallelism) and the caller resolved again: now config.resolve runs once,
    and the Ready it gives holds that resolution."""
    ready = preflight(targets()[name], DEFAULT, [f"run_dir={tmp_path / 'run'}", *TINY, *layout])
    assert resolves == ["config", "model"]
    assert isinstance(ready, Ready) and not isinstance(ready, Config)
    assert ready.cfg.model.vocab_size is not None and ready.cfg.model.dim is not None  # resolved
    assert ready.cfg.data.eval_fraction is not None
    assert ready.target.world_size == WORLD and ready.memory_checked == (name == "launch")


def test_a_config_given_as_a_config_is_checked_as_its_file_is(tmp_path):
    """The API hands preflight a Config (trainer.api.config's): the same checks, its own `where`."""
    cfg = config.load(None, [f"run_dir={tmp_path / 'run'}", *TINY, "train.global_batch_size=7"])
    with pytest.raises(ConfigError, match=r"^the config of run_dir \S+: train.global_batch_size: 7 is not divisible"):
        preflight(Target.api(WORLD), cfg, where=f"the config of run_dir {cfg.run_dir}")


def test_the_launcher_counts_its_processes_after_the_config(tmp_path):
    """A config that does not load is said before a count of processes that is none, and the count
    before the config's checks (as the launcher did)."""
    with pytest.raises(ConfigError, match="'train.no_such_key'"):
        preflight(Target.launcher("0", 1), DEFAULT, [f"run_dir={tmp_path / 'run'}", *TINY, "train.no_such_key=1"])
    with pytest.raises(ConfigError, match="^--nproc-per-node=0: give a whole number"):
        preflight(Target.launcher("0", 1), DEFAULT, [f"run_dir={tmp_path / 'run'}", *TINY, "model.size=huge"])


def test_the_launchers_own_devices_are_a_node_error_naming_the_node(tmp_path, monkeypatch):
    """More ranks than this node's GPUs: said by that node, with its name on a job of several."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(dist.NodeError, match=r"^node-7: --nproc-per-node=2 processes but this machine has 1 GPU;"):
        preflight(Target.launcher("2", 2, "node-7"), DEFAULT, [f"run_dir={tmp_path / 'run'}", *TINY])


def test_the_launcher_tells_its_ranks_what_it_checked_on_their_command_line(tmp_path):
    """The memory of the launcher's node and model.init_from's weights are checked once, by the
    launcher; its ranks are told so on their command line (--memory-checked, --weights-checked), and
    then do not check them again: no environment flag. A rank started by hand checks it all."""
    ready = preflight(Target.launcher("2", 1), DEFAULT, [f"run_dir={tmp_path / 'run'}", *TINY])
    assert (ready.memory_checked, ready.weights_checked) == (True, True)
    a = argparse.Namespace(
        nnodes=1, rdzv_endpoint="", local_addr="", config=DEFAULT, config_default=False, overrides=["x=1"]
    )
    args = torchrun.torchrun_args(a, 2, 30, 0, ready.memory_checked, ready.weights_checked)
    told = ["--memory-checked", "--weights-checked"]
    assert args[args.index("-m") :] == ["-m", "trainer", "--config", DEFAULT, *told, "x=1"]
    assert not set(told) & set(torchrun.torchrun_args(a, 2, 30, 0))
    env = dist.Env(0, 0, 2, 2, torch.device("cpu"))
    assert Target.rank(env, memory_checked=True).ranks_per_node is None  # validate's memory check: skipped
    assert Target.rank(env).ranks_per_node == 2
    assert Target.rank(env, weights_checked=True).weights_checked and not Target.rank(env).weights_checked
    for name, target in targets().items():  # make check, submit, the API: the launcher they start checks again
        ready = preflight(target, DEFAULT, [f"run_dir={tmp_path / 'run'}", *TINY])
        assert ready.weights_checked == (name == "launch"), name
    assert not hasattr(torchrun, "MEMORY_CHECKED_ENV")


def test_nothing_to_do_is_one_line_for_the_launcher_and_the_ranks():
    cfg = config.load(None, ["train.steps=6", "train.early_stop_patience=2", "eval.interval=2"])
    assert startup.nothing_to_do(cfg, None) is None and startup.nothing_to_do(cfg, 4) is None
    assert startup.nothing_to_do(cfg, 6) == "nothing to do: step 6 reached train.steps=6; raise train.steps to continue"
    stopped = {"best": 1.0, "best_step": 2, "since": 2, "stopped": 4, "reason": "patience"}
    assert startup.nothing_to_do(cfg, 4, stopped) == (
        "nothing to do: the run stopped early at step 4 (train.early_stop_patience=2); to train on, restart with "
        "train.early_stop_patience=0 or a larger patience"
    )
    larger = config.load(None, ["train.steps=6", "train.early_stop_patience=3", "eval.interval=2"])
    assert startup.nothing_to_do(larger, 4, stopped) is None  # the larger patience trains on


# What a Slurm submission runs of the trainer on a login node (submit.check_config): the preflight
# and the save's estimate; the modules it imported, printed.
SUBMISSION = """
import sys
from trainer.launchers import slurm  # noqa: F401 - the submission imports it
from trainer.preflight import interval
from trainer.preflight.startup import Target, preflight
ready = preflight(Target.slurm(2, 2, planning=True), sys.argv[1], sys.argv[2:])
print(interval.save_seconds(ready.cfg, 2, ready.cfg.run_dir)[1])
print(sorted(m for m in sys.modules if m.startswith("trainer.")))
"""


def test_a_submission_plans_without_the_checkpoint_module(tmp_path):
    """Planning (trainer/preflight/interval.py) sits beside the preflight, not in checkpoint I/O."""
    proc = python("-c", SUBMISSION, DEFAULT, f"run_dir={tmp_path / 'run'}", *TINY, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    estimate, modules = proc.stdout.splitlines()[-2:]
    assert estimate.startswith("estimated: ") and "parameters" in estimate
    assert "trainer.preflight.interval" in modules and "trainer.checkpoint.manager" not in modules, modules
