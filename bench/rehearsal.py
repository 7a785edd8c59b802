"""Rehearse a bigger cluster on the local one: 8 emulated nodes, a 16-rank job, preempted, resumed on 12.

    sudo .venv/bin/python -m bench.rehearsal [--steps 40] [--out bench/results/<date>-vm-rehearsal.json]

It brings the local cluster up with 8 nodes (slurm/local/up.sh 8; each node 2 fake GPUs through
gres) and submits the job as `make submit NODES=8 MIN_NODES=6` does (trainer.submit's own functions,
the rendered batch script as it is: `--nodes=6-8`, which Slurm fills to 8 when they are free; the
default config's tiny transformer, CPU and gloo, global batch 336, the one trainer.submit proposes
so that 12, 14 and 16 ranks all divide it). It lets the job train a few steps, then submits an
exclusive job to the `urgent` partition on 2 of its nodes, as tests/system/test_slurm_failures.py does: Slurm
preempts the training job (SIGTERM, GraceTime 15 s, it saves at the step boundary, the requeue check
requeues it). The requeued job is released from Slurm's ~120 s hold (`scontrol update jobid=J
StartTime=now`, as the tests do; nothing else of the job is changed), starts again on the 6 nodes
left (the urgent job keeps the other 2) and resumes from the checkpoint with 12 ranks. Checked:
every step's metrics row appears exactly once, 16 ranks before the preemption and 12 after, and
the resumed log says so. Timed: each phase, from this process's view (every 20 ms). At the end,
whatever happened (also on SIGINT), the cluster is brought back to its 4 nodes (slurm/local/up.sh),
the layout the tests expect.

Not a test: it needs 8 nodes (the tests run on 4, the CI cluster too) and takes about 2.5 minutes on the
2-core VM, most of it 16 and then 12 Python processes importing torch and stepping on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.preemption import job_info, rows, submit_urgent, wait_preempted, wait_until
from trainer.launchers import slurm

ROOT = Path(__file__).resolve().parent.parent
UP = ["bash", str(ROOT / "slurm" / "local" / "up.sh")]


def timed(cmd: list[str]) -> float:
    began = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - began


def training_rows(run_dir: Path) -> list[dict]:
    return [r for r in rows(run_dir) if "step_time_s" in r]


def submit_range(run_dir: Path, steps: int) -> str:
    """Submit as `make submit NODES=8 MIN_NODES=6 RUN_DIR=run_dir ARGS=...` does (trainer.launchers.slurm.main's
    steps, with the job id back): the batch script is rendered and submitted unchanged."""
    overrides = ["train.global_batch_size=336", f"train.steps={steps}", "checkpoint.interval=0", "log.interval=1"]
    argv = ["--nodes", "8", "--min-nodes", "6", "--run-dir", str(run_dir), *overrides, "log.progress=false"]
    args = slurm._parser().parse_args(argv)
    partition = slurm.query_partition(None)
    job = slurm.parse_job(args, partition)
    slurm.check_config(job, partition, planning=False)
    return slurm.submit_sbatch(job)


def rehearse(run_dir: Path, steps: int, before: int) -> dict:
    """Submit, preempt once, resume on 6 nodes, wait for the end; times and what was seen."""
    t: dict[str, float] = {"submit": time.monotonic()}
    job = submit_range(run_dir, steps)
    urgent = None
    try:
        _, t["running"] = wait_until(lambda: job_info(job).get("JobState") == "RUNNING", 120, "the job to run")
        nodes = job_info(job)["NodeList"]
        _, t["first_step"] = wait_until(lambda: training_rows(run_dir), 300, "the first step on 16 ranks")
        wait_until(lambda: len(training_rows(run_dir)) >= before, 300, f"{before} steps")
        hostnames = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True)
        taken = ",".join(hostnames.stdout.split()[-2:])  # the last 2 of the job's 8 nodes
        t["request"] = time.monotonic()
        urgent = submit_urgent(taken, run_dir, hold_s=900)
        stopped_at = wait_preempted(job, run_dir, t)
        # Out of Slurm's hold, not before the second after the requeue: slurmd refuses a credential
        # not newer than the revocation. Its --nodes=6-8 lets it start on the 6 left.
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True, capture_output=True)
        t["released"] = time.monotonic()
        _, t["running_again"] = wait_until(lambda: job_info(job).get("JobState") == "RUNNING", 120, "the restart")
        resumed_nodes = job_info(job)["NodeList"]
        _, t["resumed_step"] = wait_until(
            lambda: any(r["step"] > stopped_at for r in training_rows(run_dir)), 300, "the first step on 12 ranks"
        )
        state, t["end"] = wait_until(
            lambda: (
                job_info(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
                and job_info(job)["JobState"]
            ),
            600,
            "the end of the job",
        )
    finally:
        subprocess.run(["scancel", job, *([urgent] if urgent else [])], capture_output=True)
    log = (run_dir / "slurm" / f"{job}.out").read_text(errors="replace")
    trained = training_rows(run_dir)
    seen = [r["step"] for r in trained]
    resumed = re.search(r"resumed from \S+ at step (\d+) \(saved by (\d+) processes, loaded in ([0-9.]+)s", log)
    step_s = lambda world: [r["step_time_s"] for r in trained if r["world_size"] == world][1:]  # 1st: warm-up
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
    result = {
        "job": job,
        "state": state,
        "nodes_before": nodes,
        "nodes_after": resumed_nodes,
        "stopped_at": stopped_at,
        "every_step_once": seen == list(range(1, steps + 1)),
        "world_sizes": sorted({(r["world_size"], r["step"] <= stopped_at) for r in trained}),
        "resumed_line": resumed.group(0) if resumed else None,
        "load_s": float(resumed.group(3)) if resumed else None,
        "step_s_16_ranks": median(step_s(16)),
        "step_s_12_ranks": median(step_s(12)),
        "submit_to_running_s": t["running"] - t["submit"],
        "running_to_first_step_16_s": t["first_step"] - t["running"],
        "request_to_committed_s": t["committed"] - t["request"],
        "committed_to_requeued_s": t["requeued"] - t["committed"],
        "released_to_running_s": t["running_again"] - t["released"],
        "running_to_first_step_12_s": t["resumed_step"] - t["running_again"],
        "submit_to_end_s": t["end"] - t["submit"],
    }
    result["world_sizes"] = [list(x) for x in result["world_sizes"]]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of the job")
    parser.add_argument("--before", type=int, default=8, help="steps trained before the preemption")
    results = ROOT / "bench" / "results"
    parser.add_argument("--out", default=str(results / f"{time.strftime('%Y-%m-%d')}-vm-rehearsal.json"))
    parser.add_argument("--run-dir", default=str(ROOT / "runs" / "rehearsal"), help="a folder every node sees")
    args = parser.parse_args()
    run_dir = Path(args.run_dir).resolve()
    slurm.check_shared(run_dir, nodes=8)
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    result = {"up_8_nodes_s": timed([*UP, "8"])}
    try:
        result.update(rehearse(run_dir, args.steps, args.before))
    finally:
        result["back_to_4_nodes_s"] = timed(UP)  # whatever happened: the layout every test expects
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    ok = (
        result["state"] == "COMPLETED"
        and result["every_step_once"]
        and result["world_sizes"] == [[12, False], [16, True]]  # (ranks, step <= the preempted step)
        and result["resumed_line"]
    )
    print(f"bench.rehearsal: {'passed' if ok else 'FAILED'}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
