"""Issue #18: the memory preflight ("will it fit?") and checkpoint.interval=auto ("how often should it
save?"). The GPU's memory is the one thing mocked: no GPU here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT
from trainer import check, memory
from trainer.config import load

LLAMA_8B = str(ROOT / "configs" / "llama-8b.yaml")
SYNTHETIC = ["data.name=synthetic"]  # the 8b config points at a token file of the cluster


def run_check(capsys, tmp_path, *argv, config=LLAMA_8B):
    code = check.main(["--config", config, f"run_dir={tmp_path / 'run'}", *SYNTHETIC, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_estimate_counts_each_part_by_strategy():
    cfg = load(None, ["model.seq_len=32"])
    pr = memory.measure(cfg)
    n = pr.params
    one, four = memory.estimate(cfg, 1, 2, profile=pr), memory.estimate(cfg, 4, 2, profile=pr)
    assert (four.parameters, four.gradients, four.optimizer) == (n, n, 2 * n)
    assert four.unsharded == 4 * (pr.root_params + 2 * pr.largest_unit)  # float32 all-gather: root + unit + prefetch
    ddp = memory.estimate(load(None, ["model.seq_len=32", "parallel.strategy=ddp"]), 4, 2, profile=pr)
    assert (ddp.parameters, ddp.reduce_buffers) == (4 * n, 4 * n)  # replicated, plus the buckets
    grad_op = memory.estimate(load(None, ["model.seq_len=32", "parallel.sharding=grad_op"]), 4, 2, profile=pr)
    assert grad_op.unsharded == 4 * n  # every unit stays all-gathered
    hybrid = memory.estimate(load(None, ["model.seq_len=32", "parallel.sharding=hybrid"]), 8, 2, ranks_per_node=2, profile=pr)
    assert hybrid.parameters == 2 * n  # sharded over the 2 ranks of a node only
    offload = memory.estimate(load(None, ["model.seq_len=32", "parallel.cpu_offload=true"]), 4, 2, gpu=True, profile=pr)
    assert (offload.parameters, offload.optimizer, offload.host) == (0, 0, 4 * n)
    assert offload.overhead >= memory.CUDA_CONTEXT_BYTES and one.overhead == 0
    assert one.activations == 2 * pr.activations > 2 * pr.activations_checkpointed > 0


def test_bfloat16_halves_the_all_gathered_copies_and_the_activations_of_the_blocks():
    f32, bf16 = (memory.measure(load(None, ["model.size=small", "model.seq_len=64", f"parallel.param_dtype={d}"]))
                 for d in ("float32", "bfloat16"))
    assert bf16.compute_dtype.itemsize == 2 and bf16.params == f32.params
    e32, e16 = (memory.estimate(load(None, ["model.size=small", f"parallel.param_dtype={d}"]), 4, 1, profile=p)
                for d, p in (("float32", f32), ("bfloat16", bf16)))
    assert e16.unsharded * 2 == e32.unsharded
    assert 0.5 * f32.activations < bf16.activations < f32.activations  # the loss's logits stay float32


def test_attention_is_counted_as_the_fused_kernels_keep_it():
    """Not the seq x seq scores: doubling the sequence doubles the activations."""
    short, long = (memory.measure(load(None, ["model.size=small", f"model.seq_len={t}"])) for t in (256, 512))
    assert long.activations == pytest.approx(2 * short.activations, rel=0.01)


def test_a_job_that_fits_prints_the_estimate_beside_the_gpu(capsys, tmp_path):
    code, out, err = run_check(capsys, tmp_path, "--nproc", "2", "--nnodes", "4", "--gpu-mem-gb", "85.5")
    assert code == 0, err
    assert re.search(r"memory: about [\d.]+ GB per GPU estimated, of the 85.5 GB of GPU_MEM_GB=85.5 \(\d+%\)", out), out
    for part in ("parameters", "gradients", "optimizer", "unsharded", "reduce buffers", "activations", "overhead", "total"):
        assert re.search(rf"^  {part} +[\d.]+ GB", out, re.M), part


def test_a_job_that_cannot_fit_is_refused_with_what_would_fit(capsys, tmp_path):
    code, out, err = run_check(capsys, tmp_path, "--nproc", "2", "--nnodes", "4", "--gpu-mem-gb", "40",
                               "parallel.sharding=full", "parallel.activation_checkpointing=false")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    m = re.fullmatch(r"error: .*llama-8b.yaml: memory: one GPU needs about ([\d.]+) GB \(estimated.*\), ([\d.]+) GB more "
                     r"than the 40.0 GB of GPU_MEM_GB=40; it would fit with (.*)", lines[0])
    assert m, lines[0]
    assert float(m[1]) - 40 == pytest.approx(float(m[2]), abs=0.11)
    fixes = m[3].split(", or ")
    assert any(f.startswith("parallel.activation_checkpointing=true") for f in fixes), fixes
    assert not any("micro_batch_size" in f for f in fixes)  # already 1 sample: no smaller one to offer
    # every suggestion, applied, passes the same check
    for fix in fixes:
        option = fix.split(" (")[0]
        argv = ["--nproc", "2", "--nnodes", "4", "--gpu-mem-gb", "40", "parallel.sharding=full",
                "parallel.activation_checkpointing=false"]
        if option.startswith("--nnodes"):
            argv[3] = option.split()[1]
        else:
            argv.append(option)
        code, out, err = run_check(capsys, tmp_path, *argv)
        assert code == 0, (fix, err)


def test_the_local_gpus_memory_is_the_target_without_gpu_mem_gb(capsys, tmp_path, monkeypatch):
    """The GPU is mocked (there is none here): the local GPU's total_memory is the target."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(memory, "local_gpu_bytes", lambda: 40 * 10**9)
    code, out, err = run_check(capsys, tmp_path, "--nproc", "1", "model.size=1b", "model.seq_len=2048",
                               "parallel.sharding=full", "train.global_batch_size=8", "train.micro_batch_size=8",
                               "parallel.activation_checkpointing=false")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "than the 40.0 GB of this machine's GPU" in lines[0], err
    assert re.search(r"train.micro_batch_size=\d \(", lines[0]), lines[0]
