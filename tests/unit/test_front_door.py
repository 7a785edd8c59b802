"""Small front-door texts (#33 item 9): what a user reads must be right where they read it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.run import ROOT
from trainer.optim import OptimArgs, schedule_change


def test_the_end_of_run_hint_names_the_interpreter_that_ran_it(tmp_path, monkeypatch):
    """The hint said `python -m trainer.metrics ...`, which outside the venv fails with `No module
    named 'torch'`: it now names sys.executable, relative to the cwd when inside it."""
    from trainer.train import next_commands

    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    text = next_commands("runs/a")
    assert text.startswith(f"{os.path.join('.venv', 'bin', 'python')} -m trainer.metrics runs/a (summary)"), text
    assert " python -m" not in text
    monkeypatch.setattr(sys, "executable", "/opt/py/bin/python3")
    assert next_commands("runs/a").startswith("/opt/py/bin/python3 -m trainer.metrics runs/a"), text


def test_an_lr_that_did_not_change_is_not_said_to_have_changed():
    """`the lr at step 19 is 0.00285 (it would have been 0.00285)`: said when nothing changed."""
    saved = {"train": {"steps": 50}, "optim": {"schedule": "constant", "warmup_steps": 2}}
    line = schedule_change(saved, OptimArgs(schedule="constant", warmup_steps=5), 50, 18)
    assert line is not None and "optim.warmup_steps 2 -> 5" in line, line
    assert "would have been" not in line and "the lr at step" not in line, line
    # where it does change, both are said
    saved = {"train": {"steps": 20}, "optim": {"schedule": "warmup_cosine", "warmup_steps": 2, "decay_steps": None}}
    line = schedule_change(saved, OptimArgs(warmup_steps=2), 40, 18)
    assert "the lr at step 19 is" in line and "would have been" in line, line


def test_a_resume_under_make_s_default_config_says_nothing_of_the_file(tmp_path):
    """`make run` with no CONFIG= passed configs/default.yaml, and a resume of a run started with
    log.interval=7 warned that the file `differs from the run ... in log.interval`: the user chose
    no file. A file the user did give still gets its line."""
    from trainer.config import dump, load, load_run

    run = tmp_path / "r"
    run.mkdir()
    default = str(ROOT / "configs" / "default.yaml")
    dump(load(default, [f"run_dir={run}", "log.interval=7"]), run / "config.yaml")
    _, _, lines = load_run(default, [f"run_dir={run}"], config_chosen=False)
    assert not any("differs from the run" in line for line in lines), lines
    _, _, lines = load_run(default, [f"run_dir={run}"])
    assert any("differs from the run" in line and "log.interval" in line for line in lines), lines

    def run_line(*args):
        out = subprocess.run(["make", "-n", "run", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        return next(line for line in out.stdout.splitlines() if "trainer.launch" in line)

    assert "--config-default" in run_line()
    assert "--config-default" not in run_line("CONFIG=configs/default.yaml")


def test_a_finished_run_started_again_says_so_before_any_set_up(tmp_path, monkeypatch, capsys):
    """A finished run started again took 11.6 s to say `nothing to do`: the ranks built the model and
    the process group first. The launcher now says it from the newest checkpoint's step: no health
    check, no torchrun, exit 0, and the status says finished (what the requeue check reads)."""
    from tests.helpers.run import TINY
    from trainer.launchers import torchrun
    from trainer.rundir import layout

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setattr(layout, "latest_committed_step", lambda d: 6 if str(d) == str(run_dir) else None)

    def started(*args, **kwargs):
        raise AssertionError("set-up began")

    monkeypatch.setattr(torchrun, "_health_check", started)
    monkeypatch.setattr(torchrun, "_supported", started)
    args = ["--nproc-per-node=1", "--config", str(ROOT / "configs/default.yaml"), f"run_dir={run_dir}", *TINY]
    assert torchrun.main(args) == 0  # TINY: train.steps=6
    out = capsys.readouterr().out
    assert "nothing to do: step 6 reached train.steps=6; raise train.steps to continue" in out, out
    assert layout.read_status(str(run_dir))["state"] == "finished"


def test_make_help_lists_every_target_that_says_what_it_does():
    """Every Makefile target with a `## what it does` comment is a line of `make help` (submit-k8s was
    missing: the pattern took only letters and dashes for a target's name)."""
    import re

    from tests.helpers.run import env

    documented = re.findall(r"^([a-z0-9-]+):.*## ", (ROOT / "Makefile").read_text(), re.M)
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, env=env(), capture_output=True, text=True, check=True)
    listed = [line.split("\t")[0] for line in out.stdout.splitlines()]
    assert listed == documented and "submit-k8s" in listed
