"""One rank's peak resident memory under the memory modes of #44: gradients reduced at the last
micro-batch or at every one (parallel.grad_sync), activations kept, recomputed in full or by
operator (parallel.activation_checkpointing). The trainer, unchanged, run under torchrun in its place:

    torchrun ... -m bench.memory_modes --out PEAKS.json --config ... key=value ...

Every rank writes its own peak RSS (VmHWM, the kernel's high-water mark of the process) as the
run's final save begins (training's peak, not the save's buffers) to PEAKS.json.rank<r>; rank 0 adds
the estimate's terms for the same config (trainer.preflight.memory on the CPU: gradients, activations, total).
bench/run.py's `memory_modes` measurement launches it for each mode, in interleaved rounds.

On one GPU (`make gpu-check`'s step, the machine's own python3 and torch):

    PYTHONPATH=. python3 bench/memory_modes.py --gpu --out DIR

runs each mode once on one GPU (the same 4 micro-batches a step, bfloat16, eager) and prints a line
as each is measured: torch.cuda.max_memory_allocated (the trainer's peak_mem_gb on a GPU) against
the estimate without the allocator's overhead and the CUDA context, which it does not see (as
bench/memory_calibration.py compares them), and the median step time; then DIR/memory-modes-gpu.json.
One GPU shards nothing, so the gradients are the same in both grad_sync modes there; what it shows is
the activations' trade-off: memory against step time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The modes compared, in a round's order: (name, overrides). The baseline of each ratio is "last".
MODES = [
    ("last", ["parallel.grad_sync=last_micro_batch", "parallel.activation_checkpointing=none"]),
    ("every", ["parallel.grad_sync=every_micro_batch", "parallel.activation_checkpointing=none"]),
    ("every+full", ["parallel.grad_sync=every_micro_batch", "parallel.activation_checkpointing=full"]),
    ("every+selective", ["parallel.grad_sync=every_micro_batch", "parallel.activation_checkpointing=selective"]),
]
# Each ratio: (key, numerator mode, denominator mode, what it says)
RATIOS = [
    ("every_vs_last_peak_rss", "every", "last", "grad_sync every_micro_batch / last_micro_batch, no checkpointing"),
    ("full_ac_vs_none_peak_rss", "every+full", "every", "full activation checkpointing / none (every_micro_batch)"),
    (
        "selective_ac_vs_none_peak_rss",
        "every+selective",
        "every",
        "selective activation checkpointing / none (every_micro_batch)",
    ),
]


def peak_rss() -> int:
    """This process's peak resident set (VmHWM of /proc/self/status), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def estimate_terms(argv: list[str], world_size: int) -> dict:
    """The CPU estimate's terms for the config the trainer ran (trainer.preflight.memory.estimate)."""
    from trainer.config import load_run, resolve
    from trainer.preflight import memory

    config = argv[argv.index("--config") + 1]
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    cfg, _, _ = load_run(config, overrides)
    cfg = resolve(cfg, world_size=world_size)
    micro = cfg.train.micro_batch_size or cfg.train.global_batch_size // memory.dp_size(cfg, world_size)
    e = memory.estimate(cfg, world_size, micro)
    return {"gradients": e.gradients, "activations": e.activations, "total": e.total, "notes": e.notes}


# The GPU comparison: 125m, bfloat16, eager, 4 micro-batches of 4 sequences of 2048 tokens a step on one GPU.
GPU_RUN = [
    "model.size=125m",
    "model.seq_len=2048",
    "parallel.param_dtype=bfloat16",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "train.steps=6",
    "log.interval=1",
    "log.progress=false",
    "checkpoint.interval=0",
    "optim.warmup_steps=1",
]
# The estimate's stated tolerance against the measured peak (tests/unit/test_memory_calibration.py's).
TOLERANCE = 0.10


def gpu_line(name: str, rows: list[dict], allocated: int) -> dict:
    """One mode's result from its metrics rows (peak_mem_gb: max_memory_allocated on a GPU; step_time_s,
    the first row's left out: warm-up) and the estimate's `allocated` bytes."""
    measured = max(r["peak_mem_gb"] for r in rows if "peak_mem_gb" in r) * 1e9
    times = [r["step_time_s"] for r in rows[1:] if isinstance(r.get("step_time_s"), (int, float))]
    error = allocated / measured - 1
    return {
        "mode": name,
        "measured": measured,
        "estimate": allocated,
        "error": error,
        "within_tolerance": abs(error) <= TOLERANCE,
        "step_time_s": statistics.median(times) if times else None,
    }


def say(r: dict, base: dict | None) -> str:
    """The line of one mode, beside the first mode's (`base`) where given."""
    step = f"{r['step_time_s']:.3f} s a step" if r["step_time_s"] is not None else "no step time"
    versus = ""
    if base and base["measured"] and base.get("step_time_s") and r["step_time_s"]:
        versus = (
            f" ({r['measured'] / base['measured']:.2f}x the memory, {r['step_time_s'] / base['step_time_s']:.2f}x "
            f"the step time of {base['mode']})"
        )
    return (
        f"{r['mode']}: max_memory_allocated {r['measured'] / 1e9:.2f} GB, estimate {r['estimate'] / 1e9:.2f} GB "
        f"({r['error']:+.1%}{'' if r['within_tolerance'] else ', outside +-10%'}), {step}{versus}"
    )


def gpu_comparison(out: Path) -> int:
    """Each mode once on this machine's GPU (see the module's docstring); 1 if a run failed or an
    estimate is outside TOLERANCE."""
    from trainer.config import load
    from trainer.preflight import memory

    results, failed = [], []
    for name, overrides in MODES:
        cfg = load(str(ROOT / "configs" / "default.yaml"), [*GPU_RUN, *overrides])
        e = memory.estimate(cfg, 1, cfg.train.micro_batch_size, ranks_per_node=1, gpu=True)
        with tempfile.TemporaryDirectory() as run_dir:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "trainer"]
            cmd += ["--config", "configs/default.yaml", f"run_dir={run_dir}", *GPU_RUN, *overrides]
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                failed.append(name)
                print(f"{name}: FAILED: {(proc.stderr.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1]}")
                continue
            rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        results.append(gpu_line(name, [r for r in rows if "loss" in r], e.total - e.overhead))
        print(say(results[-1], results[0] if len(results) > 1 else None), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "memory-modes-gpu.json"
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "overrides": GPU_RUN}
    path.write_text(json.dumps({**info, "results": results, "failed": failed}, indent=1) + "\n")
    print(f"wrote {path}")
    return 1 if failed or not all(r["within_tolerance"] for r in results) else 0


def main() -> int:
    out = sys.argv[sys.argv.index("--out") + 1]
    if "--gpu" in sys.argv:
        return gpu_comparison(Path(out))
    argv = [a for i, a in enumerate(sys.argv[1:], 1) if a != "--out" and sys.argv[i - 1] != "--out"]
    import trainer.__main__ as entry
    from trainer import dist as distributed
    from trainer.checkpoint import manager

    # The training's peak: noted before the run's final save, whose buffers are no mode's (the
    # trainer is not modified: the checkpointer's save is wrapped from outside, as bench/timed_trainer.py does)
    noted, save = {}, manager.Checkpointer.save_due

    def save_due(self, *args, **kwargs):
        noted.setdefault("peak_rss", peak_rss())
        return save(self, *args, **kwargs)

    manager.Checkpointer.save_due = save_due
    env = distributed.read_env()
    rc = entry.main(argv)
    if rc:
        return rc
    result = {"peak_rss": noted.get("peak_rss") or peak_rss(), "peak_rss_with_the_save": peak_rss()}
    if env.rank == 0:
        result["estimate"] = estimate_terms(argv, env.world_size)
    with open(f"{out}.rank{env.rank}", "w") as f:  # bench/run.py gathers the ranks' files
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    if "--gpu" in sys.argv:
        sys.exit(main())
    from trainer.dist import exit_process

    exit_process(main())
