"""Issue #18: the memory preflight ("will it fit?") and checkpoint.interval=auto ("how often should it
save?"). The GPU's memory is the one thing mocked: no GPU here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT
from pages import section
from trainer.config import load
from trainer.preflight import check, memory

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


@pytest.mark.slow  # a memory estimate per suggested fix (about 7 s)
def test_a_job_that_cannot_fit_is_refused_with_what_would_fit(capsys, tmp_path):
    code, out, err = run_check(
        capsys,
        tmp_path,
        "--nproc",
        "8",
        "--nnodes",
        "4",
        "--gpu-mem-gb",
        "60",
        "parallel.sharding=full",
        "parallel.activation_checkpointing=none",
        "parallel.grad_sync=last_micro_batch",
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    m = re.fullmatch(
        r"error: .*llama-8b.yaml: memory: one GPU needs about ([\d.]+) GB \(estimated.*\), ([\d.]+) GB more "
        r"than the 60.0 GB of GPU_MEM_GB=60; it would fit with (.*)",
        lines[0],
    )
    assert m, lines[0]
    assert float(m[1]) - 60 == pytest.approx(float(m[2]), abs=0.11)
    fixes = m[3].split(", or ")
    assert any(f.startswith("parallel.activation_checkpointing=selective (") for f in fixes), fixes
    assert any(f.startswith("parallel.grad_sync=every_micro_batch (") for f in fixes), fixes  # 1/32 of the gradients
    assert not any("micro_batch_size" in f for f in fixes)  # already 1 sample: no smaller one to offer
    # every suggestion, applied, passes the same check
    for fix in fixes:
        option = fix.split(" (")[0]
        argv = [
            "--nproc",
            "8",
            "--nnodes",
            "4",
            "--gpu-mem-gb",
            "60",
            "parallel.sharding=full",
            "parallel.activation_checkpointing=none",
            "parallel.grad_sync=last_micro_batch",
        ]
        if option.startswith(("NODES=", "NPROC=")):  # make check's NODES= and NPROC=
            argv[3 if option.startswith("NODES=") else 1] = option.split("=")[1]
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


@pytest.mark.slow
def test_a_run_with_auto_interval_logs_its_choice_and_saves_at_it(tmp_path):
    from conftest import TINY, train

    steps = 16
    overrides = [o for o in TINY if not o.startswith(("checkpoint.interval", "train.steps"))]
    proc = train(
        tmp_path / "run",
        2,
        *overrides,
        f"train.steps={steps}",
        "checkpoint.interval=auto",
        "checkpoint.mtbf_hours=0.0001",
        "checkpoint.keep=0",
    )
    choices = [
        (int(m[1]), int(m[2]), int(m[3]))
        for m in re.finditer(
            r"checkpoint.interval=auto: every (\d+) steps \(~[\d.]+ s\) from step (\d+), next save at step (\d+): "
            r"sqrt\(2 x [\d.]+ s per save \((?:estimated|measured by the last save)\) x 0.0001 h between "
            r"interruptions\) "
            r"/ [\d.]+ s per step",
            proc.stdout + proc.stderr,
        )
    ]
    assert choices and choices[0][1] == 1, proc.stdout  # chosen after the first step
    by_step = {start: every for every, start, _ in choices}
    expected, every, at = [], choices[0][0], choices[0][2]
    while at < steps:  # the saves the logged choices promise
        expected.append(at)
        every = by_step.get(at, every)
        at += every
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == expected + [steps], (saved, choices)


# ---------------------------------------------------------------------------------------------------
# trainer.submit --dry-run: the partition's GPU type from gres (Slurm answered by two small scripts,
# as a partition of 8 x H100 nodes would: no cluster runs here)


def _fake_slurm(tmp_path: Path, gres: str) -> dict:
    import os
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "sinfo": f'if [ "$2" = "-N" ]; then echo "n[1-4] {gres} 96"; else echo "gpu*"; fi',
        "scontrol": 'echo "PartitionName=gpu PreemptMode=OFF GraceTime=0"',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT))


def _shared_run_dir() -> Path:
    """A run dir a 4-node job may use (not /tmp, where pytest's tmp_path and CI's clone may live): the
    repo's runs/, else one under the home; a dry run writes nothing."""
    import os

    from trainer.launchers import slurm

    run_dir = ROOT / "runs" / f"test-preflight-{os.getpid()}"
    try:
        slurm.check_shared(run_dir, nodes=4)
    except slurm.SubmitError:  # e.g. a CI clone in /tmp
        run_dir = Path.home() / ".cache" / "fsdp-trainer-tests" / f"preflight-{os.getpid()}"
    return run_dir


def submit_dry_run(tmp_path, environ, *args):
    import subprocess
    import sys

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.submit",
            "--nodes",
            "4",
            "--config",
            LLAMA_8B,
            "--run-dir",
            str(_shared_run_dir()),
            "--dry-run",
            *args,
            "--",
            *SYNTHETIC,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environ,
        timeout=120,
    )


@pytest.mark.slow
def test_submit_dry_run_prints_the_estimate_beside_the_partitions_gpus(tmp_path):
    out = submit_dry_run(tmp_path, _fake_slurm(tmp_path, "gpu:h100:8(S:0-1)"))
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"GPU memory +about [\d.]+ GB per GPU estimated, of the 85.5 GB of h100 \(gres of partition gpu\)", out.stdout
    ), out.stdout
    assert re.search(
        r"^    activations +[\d.]+ GB  1 sample\(s\) x [\d.]+ GB, with selective activation checkpointing",
        out.stdout,
        re.M,
    )
    assert not _shared_run_dir().exists()


@pytest.mark.slow
def test_submit_refuses_a_job_that_cannot_fit_in_one_line(tmp_path):
    out = submit_dry_run(
        tmp_path,
        _fake_slurm(tmp_path, "gpu:a100:8"),
        "parallel.activation_checkpointing=none",
        "train.micro_batch_size=4",
        "train.global_batch_size=128",
    )
    lines = [
        line for line in out.stderr.strip().splitlines() if not line.startswith("submit: warning:")
    ]  # a /tmp clone
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert re.fullmatch(
        r"submit: error: .*llama-8b.yaml: memory: one GPU needs about [\d.]+ GB \(estimated.*\), [\d.]+ GB "
        r"more than the 42.9 GB of a100 \(gres of partition gpu\); it would fit with "
        r"(.*, or )?parallel.activation_checkpointing=(selective|full) \([\d.]+ GB\).*",
        lines[0],
    ), lines[0]


@pytest.mark.slow
def test_submit_checks_an_unknown_gpu_type_with_gpu_mem_gb(tmp_path):
    environ = _fake_slurm(tmp_path, "gpu:mi300x:8")
    out = submit_dry_run(tmp_path, environ)
    assert out.returncode == 0, out.stderr  # not refused: unchecked, and the dry run says how to check it
    assert re.search(
        r"GPU memory +not checked: partition gpu has GPUs of type mi300x \(gres\).*GPU_MEM_GB=80", out.stdout
    )
    out = submit_dry_run(tmp_path, environ, "--gpu-mem-gb", "192")
    assert out.returncode == 0 and "of the 192.0 GB of GPU_MEM_GB=192" in out.stdout, out.stderr
    out = submit_dry_run(tmp_path, environ, "--gpu-mem-gb", "20")
    assert out.returncode == 2 and "than the 20.0 GB of GPU_MEM_GB=20" in out.stderr, out.stderr


@pytest.mark.slow
def test_a_rank_refuses_a_batch_its_gpu_cannot_hold_before_anything_is_written(tmp_path):
    """`make run`, compose and sbatch have no `make check` before them: each rank checks its own
    GPU (the launcher must not create a CUDA context). The real entry point, in its own process,
    with the one thing not here mocked: a 40 GB GPU."""
    import subprocess
    import sys
    import textwrap

    gpu = textwrap.dedent("""
        import runpy, sys, types, torch
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda index: None
        torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(total_memory=40 * 10**9)
        torch.cuda.get_device_name = lambda index: "NVIDIA A100-SXM4-40GB"
        sys.argv[0] = "trainer"
        runpy.run_module("trainer", run_name="__main__", alter_sys=True)
    """)
    run_dir = tmp_path / "run"
    config = str(ROOT / "configs" / "default.yaml")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            gpu,
            "--config",
            config,
            f"run_dir={run_dir}",
            "model.size=1b",
            "model.seq_len=2048",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {config}: memory: one GPU needs about "), lines[0]
    assert "than the 40.0 GB of GPU 0 (NVIDIA A100-SXM4-40GB); it would fit with " in lines[0], lines[0]
    assert re.search(r"train.micro_batch_size=\d \(", lines[0]), lines[0]
    assert not run_dir.exists()


@pytest.mark.slow
def test_the_estimate_is_within_its_tolerance_of_measured_cpu_peaks():
    """bench/memory_calibration.py's CPU runs, for real: the trainer on 2 processes, 3 steps, peak RSS
    with glibc's allocator made to give freed blocks back (see there), less the process's own
    (a tiny model's run). Four configurations: FSDP full shard, with activation checkpointing, DDP,
    and grad_op on a wider model."""
    from bench import memory_calibration

    results, baseline = memory_calibration.calibrate("cpu")
    print({r["name"]: f"{r['error']:+.1%}" for r in results}, f"baseline {baseline / 1e9:.3f} GB")
    assert len(results) == 5 and 0.2e9 < baseline < 2e9
    off = {r["name"]: f"{r['error']:+.1%}" for r in results if abs(r["error"]) > memory_calibration.TOLERANCE}
    assert not off, f"outside +-{memory_calibration.TOLERANCE:.0%}: {off}"


# ---------------------------------------------------------------------------------------------------
# #33 item 4: the planning output says for how many ranks it plans, warns with headroom, and advises
# only what is not already set


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


@pytest.mark.slow
def test_a_dry_run_from_a_node_local_folder_warns_and_shows_the_plan_with_its_headroom(tmp_path):
    """`make submit DRY_RUN=1 NODES=4` from a clone under /var/tmp was refused (the run dir is
    node-local); a dry run warns and shows the plan. Slurm answered by the two small scripts. 36 GB:
    the 8B example's 33.7 GB since #44 is 94% of it (it was 59.7 GB of 64 before)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "trainer.submit", "--nodes", "4", "--config", LLAMA_8B, "--gpu-mem-gb", "36"]
        + ["--run-dir", "/var/tmp/fsdp-trainer-test-dry-run/run", "--dry-run", "--", *SYNTHETIC],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_fake_slurm(tmp_path, "gpu:h100:8(S:0-1)"),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"submit: warning: RUN_DIR /var/tmp/\S+ is node-local .*the dry run goes on", out.stderr)
    assert re.search(r"GPU memory .*\(9\d%\); warning: less than 10% headroom", out.stdout), out.stdout
    assert "batch: global 256 / 32 ranks (GPUS_PER_NODE=8 x NODES=4) / micro-batch 1 = 8 accumulation" in out.stdout
    assert not Path("/var/tmp/fsdp-trainer-test-dry-run").exists()


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


@pytest.mark.slow
def test_submit_refuses_a_tp_that_does_not_divide_the_gpus_of_a_node(tmp_path):
    out = submit_dry_run(tmp_path, _fake_slurm(tmp_path, "gpu:h100:8(S:0-1)"), "parallel.tp=3")
    lines = [line for line in out.stderr.strip().splitlines() if not line.startswith("submit: warning:")]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].endswith(
        "parallel.tp: 3 does not divide the 8 processes (GPUs) of a node; tensor parallelism stays inside a "
        "node: choose a divisor of 8"
    ), lines[0]
    assert not _shared_run_dir().exists()


LLAMA_70B = str(ROOT / "configs" / "llama-70b.yaml")


@pytest.mark.slow  # the 70B's profile on the meta device: 6 s
def test_llama_70b_on_8_nodes_of_8_h100s_with_and_without_tp():
    """docs/planning.md's worked example, its numbers, and the page's table says them. As shipped (64
    sequences a step, tp=8): 44.9 GB of 80; FSDP alone, 1 sequence a rank: 55.1 GB. At 128 sequences
    tp=8 still fits (72.9 GB) and FSDP alone does not (81.1 GB, 2 sequences a rank); FSDP alone fits
    with 1 sequence a micro-batch, 2 accumulated, when the gradients are reduce-scattered every
    micro-batch (59.9 GB; at the last one: 365.5 GB, 282.2 of them gradients), which the planner offers
    (grad_sync=auto decides so), and where the family has a tp plan tp is offered (#44: tp=2 now, its
    accumulation sharded too)."""
    from trainer import models
    from trainer.config import ConfigError

    cfg = load(LLAMA_70B, SYNTHETIC)
    pr = memory.measure(cfg, gpu=True)
    alone = memory._with(cfg, parallel={"tp": 1}, train={"micro_batch_size": 1})
    big = memory._with(cfg, train={"global_batch_size": 128, "micro_batch_size": 16})
    big_alone = memory._with(cfg, parallel={"tp": 1}, train={"global_batch_size": 128, "micro_batch_size": 2})
    totals = [
        memory.gb(memory.estimate(c, 64, c.train.micro_batch_size, 8, gpu=True, profile=pr).total)
        for c in (cfg, alone, big, big_alone)
    ]
    assert totals == ["44.9 GB", "55.1 GB", "72.9 GB", "81.1 GB"]
    accumulated = {
        mode: memory.estimate(
            memory._with(big_alone, parallel={"grad_sync": mode}, train={"micro_batch_size": 1}),
            64,
            1,
            8,
            gpu=True,
            profile=pr,
        )
        for mode in ("every_micro_batch", "last_micro_batch")
    }
    assert [memory.gb(e.total) for e in accumulated.values()] == ["59.9 GB", "365.5 GB"]
    assert memory.gb(accumulated["last_micro_batch"].gradients) == "282.2 GB"
    with pytest.raises(ConfigError) as e:
        memory.preflight(big_alone, 64, 8, 80 * 10**9, "GPU_MEM_GB=80", nodes=8, nodes_option="NODES={}")
    assert "one GPU needs about 81.1 GB" in str(e.value) and "NODES=16 (" in str(e.value)
    assert models.spec(cfg.model).tp_plan is not None  # the transformer's (transformer_tp.py): tp is offered
    fixes = memory.changes_that_fit(big_alone, 64, 8, 80 * 10**9, 8, "NODES={}", profile=pr)
    assert "train.micro_batch_size=1 (59.9 GB)" in fixes, fixes  # 2 accumulated, reduce-scattered every one
    assert "parallel.tp=2 (53.2 GB)" in fixes, fixes  # the micro-batch kept: tp=2 accumulates 2, sharded
    example = section("docs/planning.md", "Worked example: Llama 70B on 8 nodes of 8 H100s")
    for total in [*totals, *(memory.gb(e.total) for e in accumulated.values())]:
        assert f"**{total}**" in example, f"docs/planning.md's 70B table does not say {total}"
