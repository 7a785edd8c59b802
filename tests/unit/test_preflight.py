"""Issue #18: the memory preflight ("will it fit?") and checkpoint.interval=auto ("how often should it
save?"). The GPU's memory is the one thing mocked: no GPU here."""

from __future__ import annotations

import re

import pytest

from tests.helpers.run import ROOT
from trainer.config import load
from trainer.preflight import check, memory

LLAMA_8B = str(ROOT / "configs" / "llama-8b.yaml")
SYNTHETIC = ["data.name=synthetic"]  # the 8b config points at a token file of the cluster


def run_check(capsys, tmp_path, *argv, config=LLAMA_8B):
    code = check.main(["--config", config, f"run_dir={tmp_path / 'run'}", *SYNTHETIC, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_model_is_measured_once_per_process_for_the_same_keys(monkeypatch):
    """measure() runs the model on the meta device once for the same family, model and parallel keys
    and `gpu`; a changed key, the GPU's kernels, or another family under the same name measure again."""
    import dataclasses

    from trainer import models

    measured = []
    real = memory._measure
    monkeypatch.setattr(memory, "_PROFILES", {})
    monkeypatch.setattr(memory, "_measure", lambda *a: measured.append(a[1].model.seq_len) or real(*a))
    cfg = load(None, ["model.size=tiny", "model.seq_len=32"])
    first = memory.measure(cfg)
    assert memory.measure(load(None, ["model.size=tiny", "model.seq_len=32"])) is first
    assert measured == [32]
    longer = memory.measure(load(None, ["model.size=tiny", "model.seq_len=64"]))
    assert longer.activations > first.activations and measured == [32, 64]
    assert memory.measure(cfg, gpu=True) is not first and len(measured) == 3
    checkpointed = load(None, ["model.size=tiny", "model.seq_len=32", "parallel.activation_checkpointing=full"])
    assert memory.measure(checkpointed) is not first and len(measured) == 4
    monkeypatch.setitem(models.FAMILIES, cfg.model.name, dataclasses.replace(models.spec(cfg.model)))
    assert memory.measure(cfg) == first and len(measured) == 5  # another family object: measured again


def test_the_estimate_counts_each_part_by_strategy():
    cfg = load(None, ["model.seq_len=32"])
    pr = memory.measure(cfg)
    n = pr.params
    one, four = memory.estimate(cfg, 1, 2, profile=pr), memory.estimate(cfg, 4, 2, profile=pr)
    assert (four.parameters, four.optimizer) == (n, 2 * n)
    assert four.gradients == 4 * n  # 4 micro-batches: FSDP keeps every gradient unsharded (float32) until the last
    assert four.unsharded == 4 * (pr.root_params + 2 * pr.largest_unit)  # float32 all-gather: root + unit + prefetch
    ddp = memory.estimate(load(None, ["model.seq_len=32", "parallel.strategy=ddp"]), 4, 2, profile=pr)
    assert (ddp.parameters, ddp.reduce_buffers) == (4 * n, 4 * n)  # replicated, plus the buckets
    grad_op = memory.estimate(load(None, ["model.seq_len=32", "parallel.sharding=grad_op"]), 4, 2, profile=pr)
    assert grad_op.unsharded == 4 * n  # every unit stays all-gathered
    hybrid = memory.estimate(
        load(None, ["model.seq_len=32", "parallel.sharding=hybrid"]), 8, 2, ranks_per_node=2, profile=pr
    )
    assert hybrid.parameters == 2 * n  # sharded over the 2 ranks of a node only
    offload = memory.estimate(load(None, ["model.seq_len=32", "parallel.cpu_offload=true"]), 4, 2, gpu=True, profile=pr)
    assert (offload.parameters, offload.optimizer, offload.host) == (0, 0, 4 * n)
    assert offload.overhead >= memory.CUDA_CONTEXT_BYTES and one.overhead >= memory.CPU_PROCESS_BYTES
    assert one.activations == 2 * pr.activations > 2 * pr.activations_checkpointed > 0


def test_bfloat16_halves_the_all_gathered_copies_and_the_activations_of_the_blocks():
    f32, bf16 = (
        memory.measure(load(None, ["model.size=small", "model.seq_len=64", f"parallel.param_dtype={d}"]))
        for d in ("float32", "bfloat16")
    )
    assert bf16.compute_dtype.itemsize == 2 and bf16.params == f32.params
    e32, e16 = (
        memory.estimate(load(None, ["model.size=small", f"parallel.param_dtype={d}"]), 4, 1, profile=p)
        for d, p in (("float32", f32), ("bfloat16", bf16))
    )
    assert e16.unsharded * 2 == e32.unsharded
    assert 0.5 * f32.activations < bf16.activations < f32.activations  # the loss's logits stay float32


def test_attention_is_counted_as_the_fused_kernels_keep_it():
    """Not the seq x seq scores: doubling the sequence doubles the activations."""
    short, long = (memory.measure(load(None, ["model.size=small", f"model.seq_len={t}"])) for t in (256, 512))
    assert long.activations == pytest.approx(2 * short.activations, rel=0.01)


def test_a_job_that_fits_prints_the_estimate_beside_the_gpu(capsys, tmp_path):
    code, out, err = run_check(capsys, tmp_path, "--nproc", "8", "--nnodes", "4", "--gpu-mem-gb", "85.5")
    assert code == 0, err
    assert re.search(
        r"memory: about [\d.]+ GB per GPU estimated for NPROC=8 x NODES=4, of the 85.5 GB of GPU_MEM_GB=85.5 \(\d+%\)",
        out,
    ), out
    for part in (
        "parameters",
        "gradients",
        "optimizer",
        "unsharded",
        "reduce buffers",
        "activations",
        "overhead",
        "total",
    ):
        assert re.search(rf"^  {part} +[\d.]+ GB", out, re.M), part


def test_the_local_gpus_memory_is_the_target_without_gpu_mem_gb(capsys, tmp_path, monkeypatch):
    """The GPU is mocked (there is none here): the local GPU's total_memory is the target."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(memory, "local_gpu_bytes", lambda: 40 * 10**9)
    code, out, err = run_check(
        capsys,
        tmp_path,
        "--nproc",
        "1",
        "model.size=1b",
        "model.seq_len=2048",
        "parallel.sharding=full",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "parallel.activation_checkpointing=none",
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "than the 40.0 GB of this machine's GPU" in lines[0], err
    assert re.search(r"train.micro_batch_size=\d \(", lines[0]), lines[0]


# ---------------------------------------------------------------------------------------------------
# checkpoint.interval=auto


@pytest.mark.parametrize(
    "save_s, mtbf_s, step_s, steps",
    [
        (10.0, 3600 * 5, 1.0, 600),  # sqrt(2 x 10 x 18000) = 600 s
        (30.0, 3600 * 24, 2.0, 1138),  # sqrt(5,184,000) = 2276.8 s
        (0.5, 100.0, 0.01, 1000),  # sqrt(100) = 10 s
        (1.0, 1.0, 10.0, 1),  # shorter than a step: every step
        (0.0, 1e6, 1.0, 1),  # a free save: every step
    ],
)
def test_young_daly_interval(save_s, mtbf_s, step_s, steps):
    from trainer.preflight.interval import young_daly_interval

    assert young_daly_interval(save_s, mtbf_s, step_s) == steps


def test_the_default_mtbf_is_the_llama_3_rate_per_gpu():
    from trainer.preflight.interval import GPU_MTBF_HOURS

    assert GPU_MTBF_HOURS == pytest.approx(45566, abs=1)  # 54 days x 24 h x 16,384 GPUs / 466 interruptions


def test_auto_interval_is_chosen_again_when_the_save_cost_changes():
    from trainer.preflight.interval import AutoInterval

    auto = AutoInterval(mtbf_s=7200.0, estimated_save_s=2.0, how="estimated")
    assert auto.choose(step_s=1.0) == 170  # sqrt(2 x 2 x 7200) = 169.7
    assert not auto.measured(2.4)  # +20%: kept
    assert auto.measured(8.0)  # 4x: chosen again
    assert auto.choose(step_s=1.0) == 339


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("25", 25), ("0", 0)])
def test_interval_takes_a_number_or_auto(value, expected):
    assert load(None, [f"checkpoint.interval={value}"]).checkpoint.interval == expected


def test_interval_refuses_other_words():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"'checkpoint.interval' is 'often'; expected int or 'auto'"):
        load(None, ["checkpoint.interval=often"])


def test_check_refuses_llama_8b_on_2_ranks_and_advises_more_ranks_not_what_is_set(capsys, tmp_path):
    """It printed `about 79.8 GB ... (100%)`, exited 0 and advised a smaller micro-batch and activation
    checkpointing, both already set; nothing said the worked example's figure (docs/planning.md) needs NPROC=8."""
    code, out, err = run_check(capsys, tmp_path, "--nproc", "2", "--gpu-mem-gb", "80")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (out, err)
    fixes = lines[0].split("it would fit with ")[1].split(", or ")
    assert any(re.fullmatch(r"NPROC=\d \([\d.]+ GB\)", f) for f in fixes), fixes
    assert not any("activation_checkpointing" in f or "micro_batch_size" in f for f in fixes), fixes


def test_check_warns_under_10_percent_headroom_with_only_changes_not_made(capsys, tmp_path):
    # the 8B example as it shipped before #44: gradients unsharded until the last micro-batch, full recompute
    before = ["parallel.grad_sync=last_micro_batch", "parallel.activation_checkpointing=full"]
    code, out, err = run_check(capsys, tmp_path, "--nproc", "4", "--nnodes", "4", "--gpu-mem-gb", "76", *before)
    assert code == 0, err
    assert "per GPU estimated for NPROC=4 x NODES=4" in out, out
    warning = next(line for line in out.splitlines() if line.startswith("warning: less than 10% headroom"))
    assert re.search(r"the estimate is 9\d% of the GPU", warning), warning
    assert "NPROC=8 (" in warning and "parallel.grad_sync=every_micro_batch (" in warning, warning
    assert "activation_checkpointing" not in warning and "micro_batch_size" not in warning, warning


def test_check_shows_the_batch_arithmetic_the_checkpoint_interval_and_a_known_duration(capsys, tmp_path):
    import json

    run = tmp_path / "run"
    code, out, err = run_check(capsys, tmp_path, "--nproc", "8", "--nnodes", "4", "--gpu-mem-gb", "80")
    assert code == 0, err
    assert (
        "batch: global 256 / 32 ranks (NPROC=8 x NODES=4) / micro-batch 1 = 8 accumulation step(s); "
        "1,048,576 tokens per step (4096 per sample)" in out
    ), out
    assert "checkpoint: every 250 steps, 200 save(s) in 50000" in out
    assert "duration: unknown until a run has logged step times" in out
    run.mkdir()
    rows = [{"step": 10 * i, "loss": 2.0, "step_time_s": 9.0 if i == 1 else 5.0} for i in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_check(capsys, tmp_path, "--nproc", "8", "--nnodes", "4", "--gpu-mem-gb", "80")
    assert code == 0, err
    assert "duration: about 69.4 h for 50000 steps at 5 s per step (the median of 4 logged windows" in out, out


def test_the_plans_step_time_never_reads_through_a_fifo_or_a_link(tmp_path):
    """make check / make submit DRY_RUN=1 read the run dir's metrics.jsonl for the expected
    duration: a FIFO planted there hung them, a link was followed. (signal.alarm: the old code
    blocks forever on the FIFO.)"""
    import os
    import signal

    from trainer.preflight.check import logged_step_time

    secret = tmp_path / "secret"
    secret.write_text('{"step": 1, "step_time_s": 1.0}\n{"step": 2, "step_time_s": 2.0}\n')
    (tmp_path / "a").mkdir()
    os.mkfifo(tmp_path / "a" / "metrics.jsonl")
    (tmp_path / "b").mkdir()
    os.symlink(secret, tmp_path / "b" / "metrics.jsonl")
    signal.alarm(10)
    try:
        assert logged_step_time(str(tmp_path / "a")) is None
        assert logged_step_time(str(tmp_path / "b")) is None
    finally:
        signal.alarm(0)


# ---------------------------------------------------------------------------------------------------
# #37 item 4: the memory estimate knows tensor parallelism; the batch is divided over the data-parallel
# ranks; make check and make submit refuse a tp that leaves a node


def test_the_activations_of_a_sample_are_not_hidden_by_the_gradients_of_the_whole_model():
    """A sample's activations were the difference of two batches' peaks; where the model's gradients
    outgrow its activations (70B with checkpointing; any model at a short sequence) both peaks were
    the end of backward: 3.9 GB a sample for 70B with 40 or 80 layers, 33 KB here with 2 or 8."""
    shape = ["model.size=small", "model.seq_len=32"]
    two, eight = (memory.measure(load(None, [*shape, f"model.n_layers={n}"])) for n in (2, 8))
    assert eight.activations_checkpointed > two.activations_checkpointed  # 8 saved block inputs, not 2
    assert two.activations >= 32 * 4096 * 4  # at least the float32 gradient of the logits (seq x vocab)


def test_tp_splits_the_state_and_the_blocks_activations_but_not_their_gathered_inputs():
    """tp=2 on 4 ranks against tp=1 on 2 (the same 2 data-parallel ranks): a rank keeps half the state,
    gathers half of each unit, and half of each sample's activations beyond the two sequences each block
    all-gathers for its attention and MLP (seq x dim, whole on every tp rank)."""
    cfg = load(None, ["model.seq_len=32"])
    pr = memory.measure(cfg)
    one = memory.estimate(cfg, 2, 2, profile=pr)
    two = memory.estimate(memory._with(cfg, parallel={"tp": 2}), 4, 2, profile=pr)
    n, b = pr.params, pr.compute_dtype.itemsize
    assert (one.parameters, one.optimizer, two.parameters, two.optimizer) == (4 * n // 2, 8 * n // 2, n, 2 * n)
    assert two.unsharded == (pr.root_params // 2 + 2 * (pr.largest_unit // 2)) * b < one.unsharded
    assert pr.block_input == 32 * 64 * b and pr.blocks == 2  # the tiny shape: seq_len x dim, 2 blocks
    gathered = 2 * pr.block_input * pr.blocks
    assert two.activations_per_sample == (one.activations_per_sample - gathered) // 2 + gathered
    assert "tp 2 (the gathered block inputs whole" in two.notes["activations"]


def test_the_global_batch_is_divided_over_the_data_parallel_ranks_not_the_world(tmp_path):
    """tp=2 on 4 ranks: 2 data-parallel ranks share the global batch (a tensor-parallel group's ranks read
    the same samples). A global batch of 2 was refused ('not divisible by 4 processes')."""
    from trainer.config import ConfigError, resolve_batch
    from trainer.preflight.check import plan_lines, validate

    cfg = load(None, ["parallel.tp=2", "train.global_batch_size=2", f"run_dir={tmp_path / 'run'}"])
    validate(cfg, 4)
    assert (
        "batch: global 2 / 2 data-parallel ranks (NPROC=4 x NODES=1 / parallel.tp=2) / micro-batch 1 = 1 "
        in (plan_lines(cfg, 4, 1)[0])
    )
    assert memory.accumulation(cfg, 2, 1) == 1 and memory.dp_size(cfg, 4) == 2
    with pytest.raises(ConfigError) as e:
        validate(memory._with(cfg, train={"global_batch_size": 3}), 4)
    assert str(e.value) == (
        "config: train.global_batch_size: 3 is not divisible by 2 data-parallel ranks (dp_size: 4 / tp 2); use a "
        "multiple of 2"
    )
    assert resolve_batch(memory._with(cfg, train={"rank_batch_size": 3}), 4).train.global_batch_size == 6
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("tp, code", [(3, 2), (4, 0)])
def test_check_for_2_nodes_of_8_gpus_refuses_a_tp_that_leaves_a_node(capsys, tmp_path, monkeypatch, tp, code):
    monkeypatch.setattr(check, "check_devices", lambda nproc: None)  # no 8 GPUs here
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = str(ROOT / "configs" / "default.yaml")
    argv = ["--nproc", "8", "--nnodes", "2", "--gpu-mem-gb", "80", f"parallel.tp={tp}"]
    got, out, err = run_check(capsys, tmp_path, *argv, config=config)
    assert got == code, (out, err)
    if code:
        assert err.splitlines() == [
            "error: override 'parallel.tp=3': parallel.tp: 3 does not divide the 8 processes (GPUs) of a node; tensor "
            "parallelism stays inside a node: choose a divisor of 8"
        ]
    else:
        assert "global 32 / 4 data-parallel ranks (NPROC=8 x NODES=2 / parallel.tp=4)" in out, out
    assert not (tmp_path / "run").exists()
