"""The memory estimate (trainer.preflight.memory) against measured peaks: runs the trainer a few steps per
configuration and writes bench/results/<date>-memory-calibration.md.

    python bench/memory_calibration.py                 # CPU: 2 processes, gloo, peak RSS (~3 min)
    python bench/memory_calibration.py --device cuda   # 1 GPU: 125m and 1b, with and without AC

On the CPU the trainer's peak_mem_gb is rank 0's peak RSS: the process itself (Python, torch, gloo)
plus what the estimate counts. The process's share is measured by a baseline run of the tiny model
(its estimate subtracted); each configuration's error is that of the estimate against peak RSS minus
that baseline. On a GPU peak_mem_gb is torch.cuda.max_memory_allocated: compared with the estimate
without the allocator's overhead and the CUDA context, which it does not see.

On the CPU the runs set MALLOC_MMAP_THRESHOLD_: glibc then maps every block above it on its own
and unmaps it when freed, so peak RSS follows what is allocated (the CPU's max_memory_allocated).
With glibc's default, a dynamic threshold, freed blocks stay in its heap and peak RSS is 20-25%
higher than the same run's with it (measured 2026-11-24: 2.42 against 1.95 GB): memory the
allocator keeps, which the estimate counts in its overhead (trainer.preflight.memory.CPU_ALLOCATOR_OVERHEAD).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.config import load
from trainer.preflight import memory

MMAP_THRESHOLD = 128 * 1024  # bytes: glibc's default starting threshold, fixed
# The stated tolerance of the estimate against the measured peak (CPU: beyond the process baseline).
TOLERANCE = 0.10
BASE = ["log.interval=1", "log.progress=false", "checkpoint.interval=0", "train.steps=3", "optim.warmup_steps=1"]
# name, overrides: sizes, strategies and activation checkpointing where the model's part of the RSS
# is large enough to be seen beside the process's few hundred MB.
CPU_CONFIGS = [
    ("baseline: tiny", ["model.size=tiny", "model.seq_len=32", "train.global_batch_size=4"]),
    ("small, fsdp full, seq 512, 16/rank", ["model.size=small", "model.seq_len=512", "train.global_batch_size=32"]),
    (
        "small, fsdp full + AC",
        [
            "model.size=small",
            "model.seq_len=512",
            "train.global_batch_size=32",
            "parallel.activation_checkpointing=full",
        ],
    ),
    ("small, ddp", ["model.size=small", "model.seq_len=512", "train.global_batch_size=32", "parallel.strategy=ddp"]),
    (
        "small x2 wide (dim 512), fsdp grad_op, 8/rank",
        [
            "model.size=small",
            "model.dim=512",
            "model.ffn_dim=1536",
            "model.seq_len=512",
            "train.global_batch_size=16",
            "parallel.sharding=grad_op",
        ],
    ),
]
# The H100 calibration's configurations (bench/results/2026-11-26-h100-memory-calibration.json, checked
# by tests/unit/test_memory_calibration.py), then bf16 with activation checkpointing, eager and compiled.
CALIBRATION = ROOT / "bench" / "results" / "2026-11-26-h100-memory-calibration.json"
GPU_CONFIGS = [(r["name"], r["overrides"]) for r in json.loads(CALIBRATION.read_text())["results"]] + [
    (
        f"1b, bf16, seq 2048, 8/GPU, AC, {'compiled' if compiled else 'eager'}",
        [
            "model.size=1b",
            "model.seq_len=2048",
            "train.global_batch_size=8",
            "parallel.param_dtype=bfloat16",
            "parallel.activation_checkpointing=full",
            f"parallel.compile={str(compiled).lower()}",
        ],
    )
    for compiled in (False, True)
]


class RunFailed(Exception):
    """A configuration's trainer run failed; the message is its last lines."""


def run(overrides: list[str], nproc: int, gpu: bool) -> float:
    """rank 0's peak_mem_gb after the last step."""
    with tempfile.TemporaryDirectory() as run_dir:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        if not gpu:
            env.update(CUDA_VISIBLE_DEVICES="", MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
        cmd = [  # torchrun as a module: the machine's own python3 may have no torchrun on its PATH
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "trainer",
            "--config",
            str(ROOT / "configs" / "default.yaml"),
            f"run_dir={run_dir}",
            *BASE,
            *overrides,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RunFailed(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
        rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        return max(r["peak_mem_gb"] for r in rows if "peak_mem_gb" in r) * 1e9


def calibrate(device: str) -> tuple[list[dict], float]:
    """Each configuration's estimate and measurement, and the process baseline in bytes (CPU). A
    configuration whose run fails is reported (its row has "failed") and the others still run."""
    gpu = device == "cuda"
    nproc = 1 if gpu else 2
    results, baseline = [], 0.0
    for name, overrides in GPU_CONFIGS if gpu else CPU_CONFIGS:
        cfg = load(str(ROOT / "configs" / "default.yaml"), overrides)
        micro = cfg.train.global_batch_size // nproc
        e = memory.estimate(cfg, nproc, micro, ranks_per_node=nproc, gpu=gpu)
        allocated = e.total - e.overhead  # what the runs' allocator hands out: without its own overhead
        started = time.perf_counter()
        try:
            measured = run(overrides, nproc, gpu)
        except (RunFailed, subprocess.TimeoutExpired, OSError, ValueError) as err:
            results.append({"name": name, "overrides": overrides, "estimate": allocated, "failed": str(err)[-500:]})
            print(f"{name}: estimate {allocated / 1e9:.3f} GB, FAILED: {results[-1]['failed']}", flush=True)
            continue
        if name.startswith("baseline"):
            baseline = measured - allocated
        model_part = measured - baseline
        results.append(
            {
                "name": name,
                "overrides": overrides,
                "estimate": allocated,
                "measured": measured,
                "model_part": model_part,
                "error": allocated / model_part - 1,
                "seconds": time.perf_counter() - started,
            }
        )
        print(
            f"{name}: estimate {allocated / 1e9:.3f} GB, measured {measured / 1e9:.3f} GB "
            f"({'minus baseline ' + format(model_part / 1e9, '.3f') + ' GB, ' if not gpu else ''}"
            f"error {results[-1]['error']:+.1%})",
            flush=True,
        )
    return results, baseline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    results, baseline = calibrate(args.device)
    day = time.strftime("%Y-%m-%d")
    path = Path(args.out) / f"{day}-memory-calibration{'-gpu' if args.device == 'cuda' else ''}.md"
    lines = [
        f"# Memory estimate against measured peaks ({args.device}, {day})",
        "",
        f"`python bench/memory_calibration.py{' --device cuda' if args.device == 'cuda' else ''}`; torch "
        f"{__import__('torch').__version__}; 3 steps each.",
        "",
    ]
    if args.device == "cpu":
        lines += [
            f"2 processes (gloo). Process baseline (tiny run's peak RSS minus its estimate): {baseline / 1e9:.3f} GB.",
            "The error is the estimate's against peak RSS minus that baseline.",
            "",
        ]
    lines += ["| config | estimate GB | measured GB | model part GB | error |", "|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['name']} | {r['estimate'] / 1e9:.3f} | failed: {r['failed']} | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['estimate'] / 1e9:.3f} | {r['measured'] / 1e9:.3f} | "
            f"{r['model_part'] / 1e9:.3f} | {r['error']:+.1%} |"
        )
    path.write_text("\n".join(lines) + "\n")
    (path.with_suffix(".json")).write_text(
        json.dumps({"device": args.device, "baseline": baseline, "results": results}, indent=1)
    )
    print(f"wrote {path}")
    failed = [r["name"] for r in results if "failed" in r]
    if failed:
        print(f"{len(failed)} of {len(results)} configuration(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
