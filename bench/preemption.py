"""What a preemption costs on the local Slurm cluster (`make slurm-up`), from the outside, in parts.

    .venv/bin/python -m bench.preemption --out preemption.json [--rounds 5] [--size small]

Each round submits a 2-node job (`python -m trainer.submit`, 1 rank per node), lets it train, then
submits an exclusive job to the `urgent` partition on the same nodes: Slurm preempts the training
job as a real cluster does (SIGTERM, GraceTime, requeue; slurm/local/slurm.conf.in). This process
watches the run dir, the job's state and the metrics file every 20 ms and takes the times of:

  request    the urgent job is submitted
  committed  the preempted job's checkpoint is committed (a new step folder in the run dir)
  requeued   the job is back in the queue (PENDING, Restarts=1)
  released   Slurm's hold on a requeued job ends (BeginTime: Slurm holds it about 120 s; the bench
             releases it 2 s after the requeue, as tests/system/test_slurm_failures.py does, and reports the hold apart)
  running    the job runs again
  stepped    the resumed run writes its first metrics row

The parts: request -> committed (Slurm's decision and signal, the step in flight, the save),
committed -> requeued (the launcher's exit, the requeue check, Slurm's requeue), running -> stepped
(batch script, srun, launcher, rendezvous, checkpoint load, first step), the load itself from the
resumed run's log ("loaded in Xs") and its first step's step_time_s. Compared with the load alone:
restart_vs_load = (running -> stepped) / load.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from trainer.launchers import slurm
from trainer.rundir import layout

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.02


def cluster_up() -> bool:
    """Whether the local cluster answers with its 4 nodes."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and len(re.findall(r" (idle|mix|alloc)", out.stdout)) >= 4


def job_info(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_until(predicate, timeout: float, what: str):
    """Poll `predicate` every POLL_S; (its value, the time it first held)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value, time.monotonic()
        time.sleep(POLL_S)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s")


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def submit_urgent(nodes: str, run_dir: Path, hold_s: int) -> str:
    """Submit an exclusive job to the `urgent` partition on 2 of `nodes`, holding them `hold_s`
    seconds: Slurm preempts the training job there. Returns its job id (to cancel it afterwards)."""
    return subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-N2", f"--nodelist={nodes}"]
        + ["-o", str(run_dir / "urgent-%j.out"), "--wrap", f"sleep {hold_s}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def wait_preempted(job: str, run_dir: Path, t: dict) -> int:
    """Wait for the preempted job's checkpoint and its requeue (times into t["committed"] and
    t["requeued"]); returns the step the checkpoint holds."""
    stopped_at, t["committed"] = wait_until(
        lambda: layout.latest_committed_step(run_dir), 120, "the preemption's checkpoint"
    )
    _, t["requeued"] = wait_until(
        lambda: job_info(job).get("JobState") == "PENDING" and job_info(job).get("Restarts") == "1",
        120,
        "the requeue",
    )
    return stopped_at


def one_round(run_dir: Path, size: str, steps: int) -> dict:
    """Submit, preempt once, wait for the resumed run's first step; the times of each event."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.submit",
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--run-dir",
            str(run_dir),
            f"model.size={size}",
            "model.seq_len=64",
            "train.global_batch_size=8",
            f"train.steps={steps}",
            "checkpoint.interval=0",
            "log.interval=1",
            "log.progress=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"submit failed: {out.stderr.strip()[-300:]}")
    job = re.search(r"submitted job (\d+)", out.stdout).group(1)
    urgent = None
    try:
        wait_until(lambda: len(rows(run_dir)) >= 3, 300, "three training steps")
        nodes = job_info(job)["NodeList"]
        before = len(rows(run_dir))
        t = {"request": time.monotonic()}
        urgent = submit_urgent(nodes, run_dir, hold_s=1)
        stopped_at = wait_preempted(job, run_dir, t)
        save_s = layout.read_status(run_dir).get("save_s")  # the stopped run's last save, before the resumed one writes
        time.sleep(2)  # slurmd refuses a launch whose credential is not newer, to the second, than the revocation
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True, capture_output=True)
        t["released"] = time.monotonic()
        _, t["running"] = wait_until(lambda: job_info(job).get("JobState") == "RUNNING", 300, "the requeued job to run")
        _, t["stepped"] = wait_until(
            lambda: any(r.get("step", 0) > stopped_at and "step_time_s" in r for r in rows(run_dir)),
            300,
            "the resumed run's first step",
        )
        log = (run_dir / "slurm" / f"{job}.out").read_text(errors="replace")
        loaded = re.findall(r"loaded in ([0-9.]+)s", log)
        first = next(r for r in rows(run_dir) if r.get("step", 0) > stopped_at and "step_time_s" in r)
        if not loaded:
            raise RuntimeError(f"the requeued job did not log 'loaded in ...s' ({run_dir}/slurm/{job}.out)")
        return {
            "job": job,
            "steps_before": before,
            "stopped_at": stopped_at,
            "save_s": save_s,
            "request_to_committed_s": t["committed"] - t["request"],
            "committed_to_requeued_s": t["requeued"] - t["committed"],
            "held_s": t["released"] - t["requeued"],
            "running_to_first_step_s": t["stepped"] - t["running"],
            "load_s": float(loaded[-1]),
            "first_step_s": first["step_time_s"],
            "step_s": rows(run_dir)[before - 1].get("step_time_s"),
        }
    finally:
        subprocess.run(["scancel", job, *([urgent] if urgent else [])], capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="result JSON, rewritten after every round")
    parser.add_argument(
        "--scratch",
        default=str(ROOT / "runs" / "bench-preemption"),
        help="run dirs: a folder every node sees (not /tmp)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", default="small", help="transformer size of the preempted job")
    parser.add_argument("--steps", type=int, default=400, help="steps the job would train without preemption")
    args = parser.parse_args()
    if not cluster_up():
        print("bench.preemption: the local Slurm cluster is not up (make slurm-up)", file=sys.stderr)
        return 3
    scratch = Path(args.scratch).resolve()
    slurm.check_shared(scratch, nodes=2)  # the nodes must see the run dirs
    result = {"size": args.size, "nodes": 2, "rounds": []}
    for i in range(args.rounds):
        run_dir = scratch / f"round-{i}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        result["rounds"].append(one_round(run_dir, args.size, args.steps))
        print(f"bench.preemption: round {i + 1}: {result['rounds'][-1]}", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
