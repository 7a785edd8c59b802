"""The CUDA path (NCCL, cuda:LOCAL_RANK, pinned-memory staging, bf16, torch.compile) on a real GPU.

Skipped where no GPU is visible, as in CI; `make test-gpu` runs it on a GPU machine. The other test
files hide the GPUs and train on the CPU, so on a GPU machine the whole suite runs as in CI.
"""

import pytest
import torch

from tests.helpers.outputs import assert_same_losses, assert_same_weights, losses, rows, weights
from tests.helpers.run import TINY, train

pytestmark = [
    pytest.mark.slow,  # trains on the GPU (make test-gpu)
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make test-gpu` on one)"),
]

RESUMABLE = [*TINY, "train.steps=8", "checkpoint.interval=4", "checkpoint.keep=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 8-step run on the GPU that saves asynchronously (pinned staging) at step 4."""
    run_dir = tmp_path_factory.mktemp("gpu_reference")
    train(run_dir, 1, *RESUMABLE, "checkpoint.async_save=true", gpu=True)
    return run_dir


def test_gpu_trains_like_the_cpu(tmp_path, reference):
    out = train(tmp_path, 1, *RESUMABLE, gpu=False).stdout
    assert "on 1 x cpu" in out
    # The same float32 arithmetic on other hardware: equal up to rounding (no TF32 by default).
    assert_same_losses(losses(tmp_path), losses(reference), rtol=1e-4)
    assert all(r["peak_mem_gb"] > 0 for r in rows(reference))


def test_gpu_resume_from_an_async_checkpoint_continues_the_run(tmp_path, reference):
    out = train(
        tmp_path, 1, *RESUMABLE, f"checkpoint.resume_from={reference}/checkpoints/step_00000004", gpu=True
    ).stdout
    assert "resumed from" in out and "at step 4" in out and "on 1 x cuda" in out
    assert_same_losses(losses(tmp_path), {s: v for s, v in losses(reference).items() if s > 4}, rtol=1e-6)
    assert_same_weights(weights(tmp_path), weights(reference), atol=1e-6)


def test_gpu_checkpoint_resumes_on_the_cpu(tmp_path, reference):
    out = train(tmp_path, 1, *RESUMABLE, f"checkpoint.resume_from={reference}/checkpoints/step_00000004").stdout
    assert "resumed from" in out and "on 1 x cpu" in out
    assert_same_losses(losses(tmp_path), {s: v for s, v in losses(reference).items() if s > 4}, rtol=1e-4)
    assert_same_weights(weights(tmp_path), weights(reference), atol=1e-4)


@pytest.mark.parametrize(
    "strategy",
    [["parallel.cpu_offload=true"], ["parallel.strategy=ddp"], ["parallel.strategy=none"]],
    ids=["fsdp-cpu-offload", "ddp", "none"],
)
def test_other_strategies_on_the_gpu_match_fsdp(tmp_path, reference, strategy):
    train(tmp_path, 1, *RESUMABLE, *strategy, gpu=True)
    assert_same_losses(losses(tmp_path), losses(reference), rtol=1e-5)


def test_batchnorm_model_in_bf16_on_the_gpu(tmp_path):
    """torchvision's ResNet under autocast (FSDP keeps BatchNorm models in float32 parameters)."""
    train(
        tmp_path,
        1,
        "model.name=resnet18",
        "data.name=synthetic_images",
        "model.image_size=64",
        "train.global_batch_size=16",
        "train.steps=4",
        "log.interval=1",
        "log.progress=false",
        "checkpoint.interval=0",
        "parallel.param_dtype=bfloat16",
        "optim.name=sgd",
        "optim.lr=0.1",
        gpu=True,
    )
    got = [r["loss"] for r in rows(tmp_path)]
    assert len(got) == 4 and all(0 < v < 10 for v in got), got


def test_bf16_compiled_training_learns_and_reports_mfu(tmp_path):
    train(
        tmp_path,
        1,
        "model.size=small",
        "model.seq_len=256",
        "train.global_batch_size=16",
        "train.steps=40",
        "log.interval=10",
        "log.progress=false",
        "checkpoint.interval=0",
        "parallel.param_dtype=bfloat16",
        "parallel.compile=true",
        "optim.lr=3e-3",
        gpu=True,
        timeout=600,
    )
    got = rows(tmp_path)
    assert got[-1]["loss"] < 0.7 * got[0]["loss"], [r["loss"] for r in got]
    for r in got:
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_gb"] > 0, r


def test_bf16_with_activation_checkpointing_trains_on_the_gpu(tmp_path):
    """#33 item 1: with torch < 2.13 this raised CheckpointError at step 1 (eager and compiled)."""
    for compiled in ("false", "true"):
        run_dir = tmp_path / f"compile-{compiled}"
        train(
            run_dir,
            1,
            *TINY,
            "parallel.param_dtype=bfloat16",
            "parallel.activation_checkpointing=true",
            f"parallel.compile={compiled}",
            gpu=True,
        )
        got = [r["loss"] for r in rows(run_dir)]
        assert len(got) == 6 and all(0 < v < 20 for v in got), (compiled, got)


def test_more_processes_than_gpus_is_refused_before_anything_starts(tmp_path):
    n = torch.cuda.device_count() + 1
    proc = train(
        tmp_path / "run", n, *TINY, "train.global_batch_size=" + str(12 * n), gpu=True, expect=1
    )  # torchrun's code for failed workers; each exits 2
    assert f"{n} processes on this node but {n - 1} GPU(s) visible" in proc.stderr
    assert not (tmp_path / "run").exists()
