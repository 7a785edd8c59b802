"""The GPU check anyone with one GPU can run in one go (#33): `make gpu-check`, or

    PYTHONPATH=. python3 bench/gpu_check.py [--dry-run]

With nothing but the repository and the machine's own torch (no venv, no network), in at most
8 minutes on one H100/H200: the front door (launch, resume, generate, evaluate, metrics),
tests/system/test_gpu.py, activation checkpointing in bfloat16 compiled, the memory modes (#44: gradients
reduced at the last or every micro-batch, activations kept, recomputed in full or by operator, each
in bfloat16 eager: max_memory_allocated and step time against the estimate), the memory calibration
and the 1b MFU (compiled and eager). Each step runs in a subprocess with its own time box; a step
that fails or runs out of time is reported and the others go on. One results file,
bench/results/<date>-<gpu>-gpu-check.json and .md, names the GPU, driver, torch and commit.

Without a GPU it says so in one line and exits 1 (after building its plan); --dry-run prints the
plan, each step with its time box, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOTAL_S = 480  # the whole check's promise: 8 minutes
PY = sys.executable  # the machine's own python3, run with PYTHONPATH=. (no venv)
TINY = ["model.size=tiny", "model.seq_len=64", "log.progress=false", "log.interval=5"]


@dataclass(frozen=True)
class Step:
    name: str  # what it checks, as the report names it
    argv: tuple  # the command, from the repository root
    timeout_s: int  # its time box


def plan(scratch: Path) -> list[Step]:
    """The steps in order, their time boxes adding up to at most TOTAL_S."""
    run = str(scratch / "front-door")
    launch = (PY, "-m", "trainer.launch", "--nproc-per-node=1", "--config", "configs/default.yaml", f"run_dir={run}")
    trainer = (PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "trainer")
    ac_bf16 = ("parallel.activation_checkpointing=full", "parallel.param_dtype=bfloat16", "train.steps=6")
    return [
        Step("launch", (*launch, *TINY, "train.steps=20", "checkpoint.interval=10"), 35),
        Step("resume", (*launch, *TINY, "train.steps=30", "checkpoint.interval=10"), 25),
        Step(
            "generate", (PY, "-m", "trainer.generate", run, "--prompt", "1 2 3", "--ids", "--max-new-tokens", "8"), 15
        ),
        Step("evaluate", (PY, "-m", "trainer.evaluate", run), 15),
        Step("metrics", (PY, "-m", "trainer.metrics", run, "--json"), 10),
        Step(
            "tests/system/test_gpu.py",
            (PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/system/test_gpu.py"),
            130,
        ),
        Step(
            "activation checkpointing, bf16, compiled",
            (
                *trainer,
                "--config",
                "configs/default.yaml",
                f"run_dir={scratch / 'ac-compiled'}",
                *TINY,
                *ac_bf16,
                "parallel.compile=true",
            ),
            45,
        ),
        # Each configuration's line is printed as it is measured: a time-out keeps those.
        # Each mode's line is printed as it is measured (bf16 eager, full and selective checkpointing among them).
        Step(
            "memory modes: grad_sync and activation checkpointing",
            (PY, "bench/memory_modes.py", "--gpu", "--out", str(scratch)),
            70,
        ),
        Step("memory calibration", (PY, "bench/memory_calibration.py", "--device", "cuda", "--out", str(scratch)), 45),
        # The bench reports each run that finished: the compiled one first, then the eager one if time is left.
        Step(
            "1b MFU, compiled and eager",
            (PY, "bench/run.py", "--only", "gpu", "--budget", "85", "--gpu-steps", "10", "--scratch", str(scratch)),
            90,
        ),
    ]


def describe(steps: list[Step]) -> str:
    lines = [f"  {s.timeout_s:>4} s  {s.name}" for s in steps]
    lines.append(f"  {sum(s.timeout_s for s in steps):>4} s  in all (at most {TOTAL_S} s)")
    return "\n".join(lines)


def run_step(step: Step, env: dict) -> dict:
    """Run one step in its time box: its outcome, seconds and the tail of its output."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            step.argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.timeout_s, start_new_session=True
        )
        outcome = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        outcome = f"timed out after {step.timeout_s} s"
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    return {
        "name": step.name,
        "command": " ".join(step.argv),
        "timeout_s": step.timeout_s,
        "outcome": outcome,
        "seconds": round(time.perf_counter() - started, 1),
        "output_tail": output[-2000:],
    }


def machine() -> dict:
    """GPU, driver, torch and commit: what the results file is named for."""
    import torch

    def ask(*argv: str) -> str:
        try:
            return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "driver": ask("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").split("\n")[0] or None,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "commit": ask("git", "rev-parse", "--short", "HEAD") or None,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def write(results: list[dict], info: dict, out: Path) -> Path:
    words = (info["gpu"] or "no-gpu").split()  # "NVIDIA H100 80GB HBM3": h100
    gpu = (words[1] if len(words) > 1 and words[0] == "NVIDIA" else words[-1]).lower()
    path = out / f"{time.strftime('%Y-%m-%d')}-{gpu}-gpu-check.md"
    lines = [
        f"# GPU check ({info['date']})",
        "",
        f"`make gpu-check`: {info['gpu']}, driver {info['driver']}, torch {info['torch']}, Python {info['python']}, "
        f"commit {info['commit']}.",
        "",
        "| step | outcome | seconds | time box |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['name']} | {r['outcome']} | {r['seconds']} | {r['timeout_s']} |" for r in results]
    for r in results:
        lines += ["", f"## {r['name']}", "", f"`{r['command']}`", "", "```", r["output_tail"].rstrip(), "```"]
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({**info, "steps": results}, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the steps and their time boxes; run nothing")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the results file")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    steps = plan(scratch)
    if sum(s.timeout_s for s in steps) > TOTAL_S:  # a plan that breaks its promise is a bug here
        print(f"gpu-check: the plan's time boxes exceed {TOTAL_S} s:\n{describe(steps)}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"gpu-check: {len(steps)} steps, each in its time box:\n{describe(steps)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no GPU here (torch.cuda.is_available() is False); run it on a machine with one "
            f"({len(steps)} steps, {sum(s.timeout_s for s in steps)} s at most)",
            file=sys.stderr,
        )
        return 1
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    results = []
    for step in steps:
        print(f"gpu-check: {step.name} (at most {step.timeout_s} s) ...", flush=True)
        results.append(run_step(step, env))
        print(f"gpu-check: {step.name}: {results[-1]['outcome']} in {results[-1]['seconds']} s", flush=True)
    path = write(results, machine(), Path(args.out))
    failed = [r["name"] for r in results if r["outcome"] != "passed"]
    print(f"gpu-check: wrote {path}; {len(results) - len(failed)} of {len(results)} steps passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
