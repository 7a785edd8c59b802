"""trainer/resilience/outcomes.py, the one table of outcomes: each exit code means one thing, every exception the
trainer raises on purpose has its row, and the launcher and the requeue check act on a code alike.
The module itself runs on Python 3.6 with the standard library (vermin: HOST_MODULES in
tests/unit/test_requeue.py)."""

from __future__ import annotations

import ast
import importlib
import json
import signal
from pathlib import Path

import pytest

from tests.helpers.run import ROOT
from tests.unit.test_requeue import HOST_MODULES
from trainer.launchers import requeue
from trainer.resilience import outcomes

ROWS = {o.name: o for o in outcomes.OUTCOMES}
# Exceptions the trainer defines that never end `python -m trainer` as themselves: each is caught and
# said where it is raised (or is another entry point's), so none needs a row. Why, for each:
NOT_AN_OUTCOME = {
    ("trainer.checkpoint.checksums", "ChecksumError"): "a checkpoint that is not what was written: CheckpointError",
    ("trainer.config", "_Refused"): "YAML refused while loading: ConfigError",
    ("trainer.checkpoint.reader", "Refused"): "a checkpoint's pickle refused: CheckpointError",
    ("trainer.checkpoint.reader", "_NotPlain"): "internal to the restricted unpickler",
    (
        "trainer.checkpoint.save_plan",
        "BadIndex",
    ): "a checkpoint's chunk index refused: the checkpoint is skipped as unreadable",
    ("trainer.rundir.objects", "PreconditionFailed"): "a conditional write that failed: handled where it is made",
    (
        "trainer.checkpoint.remote",
        "Unusable",
    ): "a shard fetched from the bucket not as its manifest lists it: the checkpoint is skipped as unreadable",
    ("trainer.hf", "HFError"): "a Hugging Face model refused: ConfigError or CheckpointError where raised",
    ("trainer.prepare", "PrepareError"): "python -m trainer.prepare's own: one line, exit 2 there",
    ("trainer.launchers.slurm", "SubmitError"): "make submit's own: one line, exit 2 there",
    ("trainer.launchers.k8s", "K8sError"): "make submit-k8s's own: one line, exit 2 there",
    (
        "trainer.checkpoint.stock",
        "Missing",
    ): "python -m trainer.checkpoint.stock's own (a checkpoint it cannot write .metadata for): one line, exit 2 there",
    (
        "trainer.launchers.torchrun",
        "OperatorEnvError",
    ): "a pod's operator variables refused by trainer.launch: one line, exit 2 there",
    ("trainer.api", "LaunchError"): "the Python API's: the launcher's exit code and line, raised to the caller",
}


def test_outcomes_is_a_host_module():
    """The requeue check reads the table on the login node's Python 3.6: vermin checks it there."""
    assert "trainer/resilience/outcomes.py" in HOST_MODULES
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse((ROOT / "trainer/resilience/outcomes.py").read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported <= {"collections", "os"}


def test_each_exit_code_is_defined_once_and_means_one_requeue_decision():
    assert len(ROWS) == len(outcomes.OUTCOMES), "names are unique"
    marks = [o.mark for o in outcomes.OUTCOMES if o.mark]
    assert len(marks) == len(set(marks))
    decisions: dict = {}
    for o in outcomes.OUTCOMES:
        if o is not outcomes.FINISHED:  # told apart from STOPPED by status.json, not by its code
            decisions.setdefault(o.code, set()).add(o.requeue)
    assert all(len(d) == 1 for d in decisions.values()), decisions
    for o in (outcomes.BAD_INPUT, outcomes.LEASE_LOST, outcomes.HEALTH_FAILED, outcomes.NODE_LOST):
        assert [r for r in outcomes.OUTCOMES if r.code == o.code] == [o], f"exit code {o.code} means {o.name} only"
    # requeue.py's names are the table's, not definitions of their own
    assert (requeue.BAD_INPUT, requeue.LEASE_LOST, requeue.HEALTH_FAILED, requeue.NODE_LOST) == (2, 3, 4, 5)
    assert outcomes.signal_code(15) == 143 and outcomes.by_code(143) is outcomes.FAILED


def _exception_classes() -> set[tuple[str, str]]:
    """(module, name) of every class in trainer/ that derives from an exception (by its bases' names)."""
    found = set()
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)  # a package's: its own name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.endswith(("Error", "Exception")) or b in {"LeaseLost", "Diverged"} for b in bases):
                    found.add((module, node.name))
    return found


def test_every_exception_the_trainer_raises_on_purpose_has_its_row():
    """A new exception class is either an outcome (a row in RAISED) or said why it is not, here."""
    defined = _exception_classes()
    assert defined == set(outcomes.RAISED) | set(NOT_AN_OUTCOME), (
        "exception classes of trainer/ without a row in trainer/resilience/outcomes.py RAISED "
        "or a reason in NOT_AN_OUTCOME: "
        f"{sorted(defined - set(outcomes.RAISED) - set(NOT_AN_OUTCOME))}"
    )
    for (module, name), row in outcomes.RAISED.items():
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Exception) and row in outcomes.OUTCOMES
        assert outcomes.of_exception(cls("x")) is row
    assert outcomes.of_exception(RuntimeError("x")) is None  # a rank's own failure: its traceback


@pytest.mark.parametrize("row", sorted(set(outcomes.RAISED.values()), key=lambda o: o.name), ids=lambda o: o.name)
def test_a_rank_that_must_not_be_restarted_marks_it_for_its_launcher(row, tmp_path):
    """The launcher learns 'not restarted' only from a mark: an outcome of a rank's exception that is
    not restarted has one, and the launcher reads it back as that outcome."""
    assert (row.mark is None) == row.restart
    if row.mark:
        (tmp_path / row.mark).touch()
        assert outcomes.marked(str(tmp_path)) is row


@pytest.mark.parametrize("row", sorted(set(outcomes.RAISED.values()), key=lambda o: o.name), ids=lambda o: o.name)
def test_the_launcher_and_the_requeue_check_agree_on_a_ranks_outcome(row):
    """Every rank exits with the row's code: the launcher's exit code (trainer/launchers/torchrun.py passes on the
    codes of PASSED_ON, else exits 1) means the same requeue decision to the requeue check."""
    passed = outcomes.of_rank_codes({row.code, -9})  # one rank killed by srun meanwhile
    launcher_code = passed.code if passed else outcomes.FAILED.code
    assert outcomes.by_code(launcher_code).requeue == row.requeue
    assert (passed is not None) == (row in outcomes.PASSED_ON)


def _cluster(tmp_path: Path, state: str) -> tuple[Path, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "JobId=7 JobState={state}"\n')
    (bin_dir / "scontrol").chmod(0o755)
    calls.write_text("")
    return bin_dir, calls


@pytest.mark.parametrize(
    "row", [o for o in outcomes.OUTCOMES if o is not outcomes.FINISHED], ids=lambda o: o.name.replace(" ", "-")
)
def test_the_requeue_check_does_what_the_row_says(row, tmp_path, monkeypatch, capsys):
    """trainer/launchers/requeue.py, given the row's exit code after a step that did not finish: not requeued
    with the row's line and code, requeued, requeued without the node whose record names it, or left
    to Slurm, which requeues the job itself."""
    slurm_requeues = row.requeue == outcomes.BY_SLURM
    bin_dir, calls = _cluster(tmp_path, "NODE_FAIL" if slurm_requeues else "RUNNING")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the requeue's SIGTERM ignored: not in pytest
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps({"steps": 20, "state": "running"}))
    if row.requeue == outcomes.WITHOUT_NODES:
        records = run_dir / "slurm" / "health"
        records.mkdir(parents=True)
        (records / "7.n2.json").write_text(json.dumps({"job": "7", "node": "n2", "reason": "gpu 0", "time": 1.0}))
    code = row.code if row.code is not None else outcomes.signal_code(15)
    result = requeue.requeue_check(str(run_dir), code, 3, "7", max_excluded=1)
    said = capsys.readouterr()
    if row.requeue == outcomes.NOT_REQUEUED:
        line = row.line.format(where="no checkpoint yet", run_dir=run_dir)
        assert (result, said.err) == (row.code, f"requeue-check: job 7: {line}\n")
        assert "requeue" not in calls.read_text()
    elif slurm_requeues:
        assert result == 0 and "Slurm requeues the job itself" in said.out
        assert "requeue 7" not in calls.read_text()
    else:
        assert result == 0 and "requeue 7" in calls.read_text()
        excluded = "update jobid=7 ExcNodeList=n2" in calls.read_text()
        assert excluded == (row.requeue == outcomes.WITHOUT_NODES), calls.read_text()


@pytest.mark.parametrize(
    "module",
    [
        "trainer/__main__.py",
        "trainer/launchers/torchrun.py",
        "trainer/launchers/requeue.py",
        "trainer/launchers/k8s.py",
    ],
)
def test_the_modules_that_read_the_table_write_no_exit_code_of_their_own(module):
    """#34 item 2: BAD_INPUT was defined twice (launch.py, requeue.py). An exit code other than 0 and
    1 (finished, and the requeue check's own failure) named, returned or compared as a number, or a 128
    + a signal's number, is one the table should give."""
    numbers = []
    for node in ast.walk(ast.parse((ROOT / module).read_text())):
        values = []
        if isinstance(node, (ast.Return, ast.Assign)):
            values = [node.value]
        elif isinstance(node, ast.Compare):
            values = [node.left, *node.comparators]
        elif isinstance(node, ast.BinOp):
            values = [node.left, node.right]
        numbers += [
            (node.lineno, v.value)
            for v in values
            if isinstance(v, ast.Constant) and type(v.value) is int and v.value in {2, 3, 4, 5, 128}
        ]
    assert numbers == []
