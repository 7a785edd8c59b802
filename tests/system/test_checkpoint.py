"""DCP checkpoints: exact resume after any stop, on any number of processes; never a half-written
checkpoint picked up; retention, async saves, export; clear errors for unusable checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.outputs import assert_same_losses, assert_same_weights, losses, rows, weights
from tests.helpers.run import TINY, kill_group, python, start, train, wait_for
from trainer.checkpoint import manager
from trainer.data import SyntheticLM

pytestmark = pytest.mark.slow  # every test trains in real processes (save, kill, resume)

B = 12  # global batch of TINY
RESUMABLE = [*TINY, "train.steps=8", "checkpoint.interval=4", "checkpoint.keep=0", "data.trace=true"]


def trace(run_dir) -> dict[int, list[int]]:
    """Global sample indices consumed per step, over all ranks (a step redone keeps its last run)."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for name in sorted(os.listdir(run_dir / "trace")):
        for line in (run_dir / "trace" / name).read_text().splitlines():
            step, *indices = map(int, line.split())
            by_step.setdefault(step, {})[int(name[5:10])] = indices  # rank_00001.txt -> 1
    return {step: sorted(i for r in ranks.values() for i in r) for step, ranks in by_step.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-process run of 8 steps that keeps its step-4 checkpoint."""
    run_dir = tmp_path_factory.mktemp("reference")
    train(run_dir, 2, *RESUMABLE)
    return run_dir


def test_resume_same_processes_is_bitwise(tmp_path, reference):
    out = train(tmp_path, 2, *RESUMABLE, f"checkpoint.resume_from={reference}/checkpoints/step_00000004").stdout
    assert "resumed from" in out and "at step 4" in out
    assert_same_weights(weights(tmp_path), weights(reference), exact=True)
    assert losses(tmp_path) == {s: v for s, v in losses(reference).items() if s > 4}


@pytest.mark.parametrize("n_from, n_to", [(2, 3), (3, 2)])
def test_resume_on_other_process_counts(tmp_path, reference, n_from, n_to):
    source = reference
    if n_from != 2:
        source = tmp_path / "source"
        train(source, n_from, *RESUMABLE)
    resumed = tmp_path / "resumed"
    train(resumed, n_to, *RESUMABLE, f"checkpoint.resume_from={source}/checkpoints/step_00000004")
    assert_same_losses(losses(resumed), {s: v for s, v in losses(reference).items() if s > 4})
    assert_same_weights(weights(resumed), weights(reference))
    # The sample stream continues exactly: steps 4..7 (0-based) read the same global samples,
    # each once, as the uninterrupted run, although the ranks split them differently.
    got, expected = trace(resumed), trace(reference)
    assert sorted(got) == [4, 5, 6, 7]
    for step in got:
        assert got[step] == expected[step] == list(range(step * B, (step + 1) * B))
    assert {r["world_size"] for r in rows(resumed)} == {n_to}


def test_stop_signal_saves_and_restart_resumes_bitwise(tmp_path):
    overrides = [*TINY, "train.steps=40", "checkpoint.interval=0", "data.trace=true"]
    reference = tmp_path / "reference"
    train(reference, 2, *overrides)

    run_dir = tmp_path / "run"
    job = start(run_dir, 2, *overrides)
    wait_for(lambda: len(rows(run_dir)) >= 5, what="5 logged steps")
    os.kill(job.pid, signal.SIGTERM)  # to torchrun, like `docker stop` or Slurm; it forwards it
    out = job.communicate(timeout=120)[0]
    assert "stopped by signal after step" in out, out[-3000:]
    stopped_at = manager.latest_step(str(run_dir))
    assert stopped_at is not None and 5 <= stopped_at < 40
    assert max(losses(run_dir)) == stopped_at  # no step lost: the checkpoint is the last step done

    out = train(run_dir, 2, *overrides).stdout
    assert f"at step {stopped_at}" in out
    assert_same_weights(weights(run_dir), weights(reference), exact=True)
    assert losses(run_dir) == losses(reference)
    assert trace(run_dir) == trace(reference)


# killed in step 3's save, resumed: 10 steps leave 7 after the kill to end equal to the reference
KILLED = [*TINY, "train.steps=10", "checkpoint.interval=1", "checkpoint.keep=2", "model.size=small"]


@pytest.fixture(scope="module")
def killed_reference(tmp_path_factory):
    """The uninterrupted run the killed-and-resumed runs must end equal to."""
    run_dir = tmp_path_factory.mktemp("killed_reference")
    train(run_dir, 2, *KILLED)
    return run_dir


@pytest.mark.parametrize("target, delay", [("rank", 0.05), ("job", 0.0), ("job", 0.12)])
def test_kill_9_during_saves_never_leaves_a_usable_half_checkpoint(tmp_path, killed_reference, target, delay):
    overrides = KILLED
    run_dir = tmp_path / "run"
    job = start(run_dir, 2, *overrides)
    ckpts = run_dir / "checkpoints"
    wait_for(
        lambda: ckpts.is_dir() and any(n.startswith(".tmp_step_00000003") for n in os.listdir(ckpts)),
        what="the third save to begin",
    )
    time.sleep(delay)
    if target == "job":
        kill_group(job)
    else:
        workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(workers[-1]), signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0
    for name in os.listdir(ckpts):
        if name.startswith("step_"):
            assert manager.problem(str(ckpts / name)) is None, f"{name} is visible but incomplete"
    killed_at = manager.latest_step(str(run_dir))

    out = train(run_dir, 2, *overrides).stdout
    assert (f"at step {killed_at}" in out) if killed_at else ("resumed" not in out)
    assert_same_weights(weights(run_dir), weights(killed_reference), exact=True)
    assert not [n for n in os.listdir(ckpts) if n.startswith(".")]  # leftovers cleaned up


def test_retention_keeps_newest_and_every_kth(tmp_path):
    ckpts = tmp_path / "checkpoints"
    bogus = ckpts / "step_00000099"
    bogus.mkdir(parents=True)  # newer-looking but incomplete: must be skipped, not trusted
    out = train(
        tmp_path, 1, *TINY, "train.steps=9", "checkpoint.interval=1", "checkpoint.keep=2", "checkpoint.keep_every=4"
    ).stdout
    assert f"skipping checkpoint {bogus}: no DCP .metadata" in out
    assert sorted(os.listdir(ckpts)) == ["step_00000004", "step_00000008", "step_00000009", "step_00000099"]


def test_corrupt_newest_checkpoint_is_skipped(tmp_path):
    train(tmp_path, 1, *TINY, "train.steps=6", "checkpoint.interval=3")
    newest = tmp_path / "checkpoints" / "step_00000006"
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk
    out = train(tmp_path, 1, *TINY, "train.steps=6", "checkpoint.interval=3").stdout
    assert f"skipping checkpoint {newest}: shard file {shard.name} missing or truncated" in out
    assert "at step 3" in out


def test_unreadable_shard_stops_every_rank_with_its_cause(tmp_path, reference):
    """Rank 1's shards lost (zeroed, the file keeps its size): a rank fails to read them, and every
    rank stops with its cause (only rank 0 prints the error line)."""
    source = tmp_path / "step_00000004"
    shutil.copytree(reference / "checkpoints" / "step_00000004", source)
    shard = source / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    lost = 0
    for index, info in dcp.FileSystemReader(str(source)).read_metadata().storage_data.items():
        if info.relative_path == shard.name and index.offset and index.offset[0] > 0:  # rank 1's half of a tensor
            data[info.offset : info.offset + info.length] = bytes(info.length)
            lost += 1
    assert lost
    shard.write_bytes(data)
    files = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    proc = train(tmp_path / "run", 2, *RESUMABLE, f"checkpoint.resume_from={source}", expect=1)  # torchrun's code
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: checkpoint.resume_from={source} is unreadable: rank "), (
        proc.stderr
    )
    # The shard file's checksum (trainer/checkpoint/checksums.py) catches the damage before its pickle does.
    assert "could not read its shards (ChecksumError: __1_0.distcp is damaged" in errors[0], errors[0]
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == files


def test_async_save_matches_sync_and_resumes(tmp_path, reference):
    async_run = tmp_path / "async"
    out = train(async_run, 2, *RESUMABLE, "checkpoint.async_save=true", "checkpoint.interval=2").stdout
    assert out.count("saved checkpoint") == 4
    assert_same_weights(weights(async_run), weights(reference), exact=True)
    assert_same_weights(weights(async_run, 4), weights(reference, 4), exact=True)
    resumed = tmp_path / "resumed"
    train(resumed, 2, *RESUMABLE, f"checkpoint.resume_from={async_run}/checkpoints/step_00000004")
    assert_same_weights(weights(resumed), weights(reference), exact=True)


def test_raising_steps_continues_and_export_round_trips(tmp_path):
    from trainer import models
    from trainer.config import load

    overrides = [*TINY, "train.steps=6", "eval.interval=8", "eval.batches=1", "train.global_batch_size=4"]
    train(tmp_path, 2, *overrides)
    out = train(tmp_path, 2, *overrides, "train.steps=8").stdout
    assert "at step 6" in out and sorted(losses(tmp_path)) == list(range(1, 9))

    for name in ("model.pt", "model.safetensors"):
        proc = python("-m", "trainer.export", str(tmp_path), "--out", str(tmp_path / name), timeout=120)
        assert proc.returncode == 0, proc.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    from safetensors.torch import load_file

    assert_same_weights(state, load_file(tmp_path / "model.safetensors"), exact=True)

    # The exported weights are the ones the trainer evaluated: same loss on the same samples.
    cfg = load(str(tmp_path / "config.yaml"))
    model = models.build(cfg.model)
    model.load_state_dict(state)  # strict: every key of the plain model
    dataset = SyntheticLM(256, cfg.model.seq_len, seed=0)
    x, y = map(torch.stack, zip(*(dataset[2**61 + i] for i in range(4))))  # eval: 2 ranks x 2 samples
    with torch.no_grad():
        loss = models.loss_fn(model(x), y).item()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    eval_loss = next(r["eval_loss"] for r in logged if "eval_loss" in r and r["step"] == 8)
    assert loss == pytest.approx(eval_loss, rel=1e-5)


def test_incompatible_checkpoint_is_refused_untouched(tmp_path):
    train(tmp_path, 1, *TINY, "train.steps=2")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")}
    proc = train(tmp_path, 1, *TINY, "train.steps=4", "model.size=small", expect=2)
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: checkpoint ") and "has shape [64, 64] but the model has" in line, proc.stderr
    assert "use the matching model.* config or a new run_dir" in line
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")} == before


def test_resume_from_a_folder_that_is_no_checkpoint(tmp_path):
    proc = train(tmp_path / "run", 1, *TINY, f"checkpoint.resume_from={tmp_path}", expect=2)
    assert f"checkpoint.resume_from={tmp_path} is not a usable checkpoint: no DCP .metadata" in proc.stderr
