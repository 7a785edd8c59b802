"""The system tier of tests/unit/test_sources.py, whose docstring says what both halves test."""

import json
import os
import signal
import subprocess

import pytest

from tests.helpers.outputs import assert_same_losses, losses, rows
from tests.helpers.run import PYTHON, ROOT, TINY, env, start, train, wait_for
from tests.unit import test_sources as unit
from tests.unit.test_sources import MIX, all_rows, mixture, sources
from trainer.checkpoint import manager

files = unit.files  # the fixture, shared with the unit tests


def epoch_rows(run_dir) -> list[tuple]:
    return [(r["data_source"], r["epoch"], r["step"]) for r in all_rows(run_dir) if r.get("event") == "epoch"]


def trace(run_dir) -> dict[int, list[int]]:
    """Global sample indices consumed per step, over all ranks (a step redone keeps its last run)."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for name in sorted(os.listdir(run_dir / "trace")):
        for line in (run_dir / "trace" / name).read_text().splitlines():
            step, *indices = map(int, line.split())
            by_step.setdefault(step, {})[int(name[5:10])] = indices
    return {step: sorted(i for r in ranks.values() for i in r) for step, ranks in by_step.items()}


@pytest.mark.slow
def test_a_mixture_stopped_on_2_processes_resumes_on_3_as_if_never_stopped(tmp_path, files):
    """The uninterrupted 2-process run and one stopped by a signal, then resumed on 3 processes in the
    same run dir: the same losses, samples and epoch rows (each once), and per-source eval rows."""
    overrides = [
        *TINY,
        *MIX,
        sources(files),
        "train.steps=30",
        "eval.interval=10",
        "eval.batches=1",
        "data.trace=true",
    ]
    reference = tmp_path / "reference"
    train(reference, 2, *overrides)
    expected = epoch_rows(reference)
    # 30 steps x 12 samples: web (0.7, 40 windows) begins epochs 1..6, code (0.3, 20 windows) 1..5
    assert sorted((s, e) for s, e, _ in expected) == [
        *(("code", e) for e in range(1, 6)),
        *(("web", e) for e in range(1, 7)),
    ]
    m = mixture([0.7, 0.3], [40, 20])
    for source, e, step in expected:  # at the step that reads the epoch's first sample
        k = ["web", "code"].index(source)
        assert m.counts((step - 1) * 12)[k] <= e * [40, 20][k] < m.counts(step * 12)[k]
    evals = [r for r in all_rows(reference) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]
    for r in evals:
        assert r["eval_loss"] == pytest.approx(0.7 * r["eval_loss/web"] + 0.3 * r["eval_loss/code"], rel=1e-6)
    last = rows(reference)[-1]
    assert last["epoch/web"] == pytest.approx(m.counts(360)[0] / 40) and last["epoch/code"] == pytest.approx(
        m.counts(360)[1] / 20
    )

    run_dir = tmp_path / "run"
    job = start(run_dir, 2, *overrides)
    wait_for(lambda: len(rows(run_dir)) >= 5, what="5 logged steps")
    os.kill(job.pid, signal.SIGTERM)  # to torchrun, as Slurm or docker stop; it forwards it
    out = job.communicate(timeout=120)[0]
    assert "stopped by signal after step" in out, out[-3000:]
    stopped_at = manager.latest_step(str(run_dir))
    assert stopped_at is not None and 5 <= stopped_at < 30

    out = train(run_dir, 3, *overrides).stdout
    assert f"at step {stopped_at}" in out
    assert_same_losses(losses(run_dir), losses(reference))
    assert trace(run_dir) == trace(reference)
    assert epoch_rows(run_dir) == expected  # each once, although the run stopped and resumed
    got = {r["step"]: r for r in all_rows(run_dir) if "eval_loss" in r}
    for r in evals:
        for key in ("eval_loss", "eval_loss/web", "eval_loss/code"):
            assert got[r["step"]][key] == pytest.approx(r[key], rel=1e-5), (r["step"], key)

    # trainer.evaluate gives the training loop's per-source numbers for the last checkpoint
    proc = subprocess.run(
        [PYTHON, "-m", "trainer.evaluate", str(reference)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["step"] == 30
    for key in ("eval_loss", "eval_loss/web", "eval_loss/code"):
        assert row[key] == pytest.approx(evals[-1][key], rel=1e-5), key


@pytest.mark.slow
def test_a_single_token_file_counts_its_epochs_in_rows_and_the_live_line(tmp_path, files):
    """One file (no data.sources): epoch rows without `source`, each once, at the step that reads the
    pass's first sample; training rows and the live line carry the passes made."""
    run_dir = tmp_path / "run"
    out = train(run_dir, 1, *TINY, *MIX, f"data.path={files['code']}", "train.steps=6").stdout
    # 20 windows, 12 samples a step: passes begin at samples 20, 40, 60 (steps 2, 4, 6)
    assert [(r.get("data_source"), r["epoch"], r["step"]) for r in all_rows(run_dir) if r.get("event") == "epoch"] == [
        (None, 1, 2),
        (None, 2, 4),
        (None, 3, 6),
    ]
    assert {r["step"]: r["epoch"] for r in rows(run_dir)} == {s: s * 12 / 20 for s in range(1, 7)}
    assert "step 6/6  loss" in out and "epoch 3.60" in out
    assert "epoch 1 of the training data begins at step 2" in out


@pytest.mark.slow
def test_a_run_resumed_with_other_weights_goes_on_from_each_source_s_position(tmp_path, files):
    """0.7/0.3 for 5 steps, then 0.2/0.8: the line says where each source goes on from, the
    checkpoint keeps the new origin, each source's passes go on without a jump, and every pass that
    begins has its epoch row once."""
    run_dir = tmp_path / "run"
    common = [*TINY, *MIX, "checkpoint.interval=5"]
    weighted = lambda w, v: (
        f"data.sources=[{{path: {files['web']}, weight: {w}}}, {{path: {files['code']}, weight: {v}}}]"
    )
    train(run_dir, 1, *common, weighted(0.7, 0.3), "train.steps=5")
    first = mixture([0.7, 0.3], [40, 20]).counts(60)
    out = train(run_dir, 1, *common, weighted(0.2, 0.8), "train.steps=15").stdout
    assert f"from sample 60 on each source goes on from where it was (web from its sample {first[0]}, code from its " \
        f"sample {first[1]})" in out  # fmt: skip
    meta = json.loads((run_dir / "checkpoints" / "step_00000015" / "meta.json").read_text())
    assert meta["mixture"] == {"start": 60, "taken": first}
    m = mixture([0.2, 0.8], [40, 20])
    m.start, m.taken = 60, first
    got = {r["step"]: (r["epoch/web"], r["epoch/code"]) for r in rows(run_dir)}
    for step in range(6, 16):
        web, code = m.counts(step * 12)
        assert got[step] == (pytest.approx(web / 40), pytest.approx(code / 20)), step
    expected = sorted(
        (["web", "code"][k], e, s)
        for s in range(1, 16)
        for k in range(2)
        for e in range(1, 20)
        if (mixture([0.7, 0.3], [40, 20]) if s <= 5 else m).counts((s - 1) * 12)[k]
        <= e * [40, 20][k]
        < (mixture([0.7, 0.3], [40, 20]) if s <= 5 else m).counts(s * 12)[k]
    )
    assert sorted(epoch_rows(run_dir)) == expected
