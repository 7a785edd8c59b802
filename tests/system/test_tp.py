"""The system tier of tests/unit/test_tp.py, whose docstring says what both halves test."""

import os
import signal
import subprocess

import pytest

from tests.helpers.outputs import (
    assert_same_hf_folders,
    assert_same_losses,
    assert_same_weights,
    losses,
    metrics,
    rows,
    weights,
)
from tests.helpers.run import TINY, export_hf, kill_group, start, train, wait_for
from trainer.rundir import layout

# 20 steps, a constant learning rate (the schedule does not depend on train.steps, so a run of
# any length is the same run step by step), a checkpoint every 5 steps, all kept. A global batch of
# 24: the config check divides it over all processes (8 with tp=2), not over the data-parallel ranks.
B = 24
RUN = [*TINY, f"train.global_batch_size={B}", "train.steps=20", "optim.schedule=constant"]
RUN += ["checkpoint.interval=5", "checkpoint.keep=0", "eval.interval=10"]
TP = [*RUN, "parallel.tp=2", "data.trace=true"]
# Resuming at another layout with this learning rate leaves every weight as loaded (an update of
# 1e-30 is below a float32 weight's last bit): the step's checkpoint holds the loaded weights.
FROZEN = "optim.lr=1e-30"


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp2x2")
    train(run_dir, 4, *TP)
    return run_dir


def _trace(run_dir) -> dict[int, dict[int, list[int]]]:
    """Sample indices per step and rank."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for name in sorted(os.listdir(run_dir / "trace")):
        for line in (run_dir / "trace" / name).read_text().splitlines():
            step, *indices = map(int, line.split())
            by_step.setdefault(step, {})[int(name[5:10])] = indices
    return by_step


@pytest.mark.slow
def test_tp2_x_dp2_trains_as_dp4(tmp_path, tp_run):
    """Float tolerance: relative 1e-5 on each of the 20 losses and the evaluations' losses (the
    tensor-parallel matmuls and all-reduces add in another order); the final weights within 1e-4."""
    train(tmp_path, 4, *RUN)
    assert_same_losses(losses(tp_run), losses(tmp_path), rtol=1e-5)
    evals = [{r["step"]: r["eval_loss"] for r in metrics(d) if "eval_loss" in r} for d in (tp_run, tmp_path)]
    assert evals[0] and 20 in evals[0]  # the evaluation's loss, on sharded logits too
    assert_same_losses(*evals, rtol=1e-5)
    assert_same_weights(weights(tp_run), weights(tmp_path))
    trace = _trace(tp_run)
    assert sorted(trace) == list(range(20))
    for step, ranks in trace.items():
        assert ranks[0] == ranks[1] and ranks[2] == ranks[3], f"step {step}: a tp pair read different samples"
        assert sorted(ranks[0] + ranks[2]) == list(range(step * B, (step + 1) * B))


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = [int(p) for p in out.split()]
    return children + [d for c in children for d in _descendants(c)]


@pytest.mark.slow
def test_kill_9_and_resume_at_the_same_layout_is_bitwise(tmp_path, tp_run):
    """tp=2 on 4 ranks, killed (-9, every process) once its step-5 checkpoint is committed; a new run
    resumed from that checkpoint at the same layout repeats tp_run's steps 6..20 bit for bit. Through
    torchrun: `python -m trainer.launch` refuses 4 ranks on a machine of 2 CPU cores (CI's)."""
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    job = start(killed, 4, *TP, "train.steps=100000")
    try:
        wait_for(lambda: (layout.latest_committed_step(killed) or 0) >= 5, 180, "the step-5 checkpoint")
        for pid in [job.pid, *_descendants(job.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        kill_group(job)
        job.wait(30)
    train(resumed, 4, *TP, f"checkpoint.resume_from={killed}/checkpoints/step_00000005")
    assert losses(resumed) == {s: v for s, v in losses(tp_run).items() if s > 5}
    assert_same_weights(weights(resumed), weights(tp_run), exact=True)


@pytest.mark.slow
def test_checkpoints_reshard_between_layouts_and_export_the_same(tmp_path, tp_run):
    """tp=2 on 4 ranks -> tp=1 on 2 and on 3 ranks, and tp=2 on 8; tp=1 on 2 -> tp=2 on 4. Each run
    resumes, takes one step that changes nothing (FROZEN) and saves: its weights are the source's."""
    source = weights(tp_run, 10)
    loaded = {}
    for name, nproc, tp in (("1x2", 2, 1), ("1x3", 3, 1), ("2x8", 8, 2)):
        loaded[name] = tmp_path / name
        at = f"checkpoint.resume_from={tp_run}/checkpoints/step_00000010"
        out = train(loaded[name], nproc, *RUN, f"parallel.tp={tp}", FROZEN, "train.steps=11", at).stdout
        assert "at step 10" in out
        assert_same_weights(weights(loaded[name]), source, exact=True)
        assert {r["world_size"] for r in rows(loaded[name])} == {nproc}
    back = tmp_path / "back"
    at = f"checkpoint.resume_from={loaded['1x2']}/checkpoints/step_00000011"
    train(back, 4, *RUN, "parallel.tp=2", FROZEN, "train.steps=12", at)
    assert_same_weights(weights(back), source, exact=True)
    # Hugging Face export: the 2D checkpoint and the 1D one of the same weights give the same folder.
    export_hf(tp_run, tmp_path / "hf2d", "--step", "10")
    export_hf(loaded["1x2"], tmp_path / "hf1d")
    assert_same_hf_folders(tmp_path / "hf2d", tmp_path / "hf1d")


@pytest.mark.slow
def test_bf16_activation_checkpointing_and_compile_compose_with_tp(tmp_path, tp_run):
    """tp=2 on 2 ranks (one data-parallel rank) with bfloat16 compute, activation checkpointing and
    torch.compile together: the first 3 losses within bfloat16's tolerance (relative 1e-3) of tp_run's,
    float32 and eager. Without the DTensor residual stream (transformer_tp.py) step 2 was 3.5e-3 off."""
    options = ["parallel.param_dtype=bfloat16", "parallel.activation_checkpointing=true", "parallel.compile=true"]
    train(tmp_path, 2, *RUN, "parallel.tp=2", "train.steps=3", *options)
    assert_same_losses(losses(tmp_path), {s: v for s, v in losses(tp_run).items() if s <= 3}, rtol=1e-3)
