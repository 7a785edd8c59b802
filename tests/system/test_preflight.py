"""The system tier of tests/unit/test_preflight.py, whose docstring says what both halves test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.pages import section
from tests.helpers.run import ROOT
from tests.unit.test_preflight import LLAMA_8B, SYNTHETIC, run_check
from trainer.config import load
from trainer.preflight import memory


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


@pytest.mark.slow
def test_a_run_with_auto_interval_logs_its_choice_and_saves_at_it(tmp_path):
    from tests.helpers.run import TINY, train

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


LLAMA_405B = str(ROOT / "configs" / "llama-405b.yaml")


@pytest.mark.slow  # the 405B's profile on the meta device: about 25 s on 2 shared cores, measured once
def test_llama_405b_on_64_nodes_of_8_h100s_and_what_pp_and_cp_change():
    """docs/planning.md's 405B example: the block make check prints is the page's, line for line, and
    the page's table says the tool's totals: tp=8 34.0 GB; FSDP alone 107.0 GB (refused, tp=2 offered);
    pp=2 instead of tp 107.1 GB (no single change fits); cp=2 with tp 27.1 GB; cp=8 alone 65.4 GB."""
    from trainer.config import resolve
    from trainer.parallel import pp as pipeline
    from trainer.preflight import check

    def config(*over):
        return resolve(load(LLAMA_405B, [*SYNTHETIC, *over]), world_size=512)

    cfg = config()
    printed = check.plan_lines(cfg, 8, 64)[:1] + check.gpu_preflight(cfg, 512, 8, 64, "80").splitlines()
    example = section("docs/planning.md", "Worked example: Llama 405B on 64 nodes of 8 H100s")
    block = example.split("```\n")[1].splitlines()
    assert block == printed, "docs/planning.md's 405B block is not what make check prints"
    pr = memory.measure(cfg, gpu=True)  # measured once above, for the shipped config
    variants = {
        "tp=1": ("parallel.tp=1", "train.micro_batch_size=1"),
        "pp=2": ("parallel.tp=1", "parallel.pp=2", "train.micro_batch_size=1"),
        "cp=2": ("parallel.cp=2",),
        "cp=8": ("parallel.tp=1", "train.micro_batch_size=1", "parallel.cp=8"),
    }
    totals, fixes = {}, {}
    for name, over in variants.items():
        c = config(*over)
        micro = pipeline.micro_batch(c.parallel, 512 // memory.dp_size(c, 512), c.train.micro_batch_size)
        totals[name] = memory.gb(memory.estimate(c, 512, micro, 8, gpu=True, profile=pr).total)
        fixes[name] = memory.changes_that_fit(c, 512, 8, 80 * 10**9, 64, "NODES={}", "NPROC={}", profile=pr)
    assert totals == {"tp=1": "107.0 GB", "pp=2": "107.1 GB", "cp=2": "27.1 GB", "cp=8": "65.4 GB"}
    assert fixes["tp=1"] == ["parallel.tp=2 (62.8 GB)"] and fixes["pp=2"] == []
    assert 'it\nwould fit with parallel.tp=2 (62.8 GB)"' in example
    for total in ["34.0 GB", *totals.values()]:
        assert f"**{total}**" in example, f"docs/planning.md's 405B table does not say {total}"
    staged = config("parallel.tp=1", "parallel.pp=2", "train.micro_batch_size=1", "parallel.pp_microbatches=8")
    assert check.plan_lines(staged, 8, 64)[1].startswith(
        "pipeline: 2 stages, schedule 1f1b: bubble (pp-1)/(m+pp-1) = 1/9 = 11% of each forward/backward idle"
    )
