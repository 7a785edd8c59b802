"""Goodput on the local Slurm cluster (`make slurm-up`): a job under a failure schedule beside the
same job undisturbed, and each recovery's time in parts.

    .venv/bin/python -m bench.goodput --out goodput.json [--rounds 3] [--nodes 4] [--steps 60]

A round runs the job undisturbed (its wall time: the undisturbed time), then again under SCHEDULE:
each event strikes once the run has logged its step since the previous recovery. Events:

  crash       kill -9 of one rank: its node's launcher restarts every rank in the allocation
  hang        SIGSTOP of one rank: the others' collective times out after parallel.timeout_s, the
              hang is written down (trainer/resilience/hangs.py), the ranks are restarted in the allocation
  preemption  an exclusive job of the `urgent` partition on the job's nodes: SIGTERM, the ranks
              save, the job is requeued (Slurm's ~120 s hold cut to 2 s, as tests/system/test_slurm_failures.py
              does, and left out of the wall time) and resumes

  node_death  one node's slurmd and the job's processes on it killed (bench/nodes.py), as a power
              loss: the others see its heartbeat stop (10 s), end, and Slurm ends the job as
              NODE_FAIL once the node has not answered for SlurmdTimeout (10 s locally, slurm.conf.in;
              Slurm's default, and real clusters', 300 s) and requeues it (hold cut to 2 s as for the
              preemption) on the 3 nodes left: the job is submitted with --min-nodes 3 (make submit
              MIN_NODES=3) and global batch 36, which 4 and 3 ranks divide. The node is restored
              (slurmd started, resumed) at the end of the round, whatever happens.

Goodput = undisturbed wall time / disturbed wall time (from the job running to its end, the
requeue hold left out). Steps redone: training rows logged more than once (metrics.jsonl and
metrics.superseded.jsonl, log.interval=1). Each recovery's parts come from the times the run
writes itself: the restart row (`time`: the launcher saw the failure) and the resume row's `start`
(trainer/observe/metrics.py: launcher start, ranks stopped, rendezvous, rank start, imports, process group,
load start and end), the first training row after it, status.json, and the job's state polled here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.nodes import kill_node, restore_node
from bench.preemption import POLL_S, ROOT, cluster_up, job_info, wait_until
from trainer.launchers import slurm
from trainer.rundir import layout

# Llama 3 (Dubey et al. 2024, section 3.3.4): 466 job interruptions in 54 days on 16,384 GPUs.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16384
# Seconds Slurm waits for a silent slurmd before the node is DOWN and its jobs NODE_FAIL: the local
# cluster's (slurm/local/slurm.conf.in) and Slurm's default, which real clusters keep or raise.
LOCAL_SLURMD_TIMEOUT_S, REAL_SLURMD_TIMEOUT_S = 10, 300


def ranks_of(job: str) -> dict[int, int]:
    """{global rank: pid} of the job's ranks (this host's /proc: SLURM_JOB_ID and RANK in their environment)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        if env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"RANK", b"").isdigit():
            found[int(env[b"RANK"])] = int(entry)
    return found


def crash(job: str, run_dir: Path, nodes: str) -> dict:
    os.kill(ranks_of(job)[2 % len(ranks_of(job))], signal.SIGKILL)
    return {"caused": time.time()}


def hang(job: str, run_dir: Path, nodes: str) -> dict:
    os.kill(ranks_of(job)[1], signal.SIGSTOP)
    return {"caused": time.time()}


def preemption(job: str, run_dir: Path, nodes: str) -> dict:
    caused = time.time()
    n = len(ranks_of(job))
    subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "--exclusive", f"-N{n}", f"--nodelist={nodes}"]
        + ["-o", str(run_dir / "urgent-%j.out"), "--wrap", "sleep 1"],
        capture_output=True,
        text=True,
        check=True,
    )
    _, requeued = wait_until(lambda: job_info(job).get("JobState") == "PENDING", 120, "the requeue")
    status = layout.read_status(run_dir)
    time.sleep(2)  # slurmd refuses a launch whose credential is not newer, to the second, than the revocation
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True, capture_output=True)
    released = time.time()
    _, running = wait_until(lambda: job_info(job).get("JobState") == "RUNNING", 300, "the requeued job to run")
    mono_to_unix = time.time() - time.monotonic()
    return {
        "caused": caused,
        "saved": status.get("updated") if status.get("state") == "stopped" else None,
        "requeued": requeued + mono_to_unix,
        "released": released,
        "running": running + mono_to_unix,
    }


def victim(nodes: str) -> str:
    """The node a node death kills: the job's third (not the first, which runs the batch script)."""
    names = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=True)
    return names.stdout.split()[2]


def node_down(node: str) -> bool:
    out = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True)
    return out.stdout.strip().startswith("down")


def node_death(job: str, run_dir: Path, nodes: str) -> dict:
    node = victim(nodes)
    caused = time.time()
    kill_node(job, node)
    down, deadline = None, time.monotonic() + 300  # when Slurm marks the node DOWN, while waiting the requeue
    while job_info(job).get("JobState") != "PENDING":
        if down is None and node_down(node):
            down = time.time()
        if time.monotonic() > deadline:
            raise TimeoutError("the requeue after the node death: not within 300s")
        time.sleep(POLL_S)
    requeued = time.time()
    time.sleep(2)  # as for the preemption: a credential newer, to the second, than the revocation
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True, capture_output=True)
    released = time.time()
    _, running = wait_until(lambda: job_info(job).get("JobState") == "RUNNING", 300, "the requeued job to run")
    return {
        "node": node,
        "caused": caused,
        "down": down or requeued,
        "requeued": requeued,
        "released": released,
        "running": running + time.time() - time.monotonic(),
    }


# (name, the step it strikes after (counted from the previous recovery's step), what it does).
SCHEDULE = [
    ("crash", 12, crash),
    ("hang", 12, hang),
    ("preemption", 12, preemption),
    ("node_death", 12, node_death),  # last: the job ends on 3 nodes
]
MIN_NODES_LEFT = 1  # the job is submitted with --min-nodes nodes - 1: one node death
GLOBAL_BATCH = 36  # samples a step: 9 a rank on 4 ranks, 12 on the 3 left


# ---------------------------------------------------------------------------------------------------
# Arithmetic on what the run wrote (unit-tested: tests/unit/test_bench_goodput.py)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def recovered(rows: list[dict], caused: float) -> bool:
    """Whether the run has resumed after `caused` and written its first step after that resume: a loss
    row of a later step than the resume row's. Rows of steps the run took between `caused` and its
    stop are later in time than `caused` but not in step: they do not count (#33 item 5: they did, and
    `recovery` then found no step after the resume)."""
    resume = next((r for r in rows if r.get("event") == "resume" and r["time"] >= caused), None)
    return resume is not None and any(
        "loss" in r and r["step"] > resume["step"] and r["time"] >= resume["time"] for r in rows
    )


def recovery(rows: list[dict], event: dict) -> dict:
    """The parts, in seconds, of the recovery from `event` (the bench's times: `caused`, for a
    preemption `saved`, `requeued`, `released`, `running`, for a node death `down` and the same
    three), from the run's rows: the first restart (node_lost) row and the first resume row after
    `caused`, and the first training row after that resume."""
    caused = event["caused"]
    resume = next(r for r in rows if r.get("event") == "resume" and r["time"] >= caused)
    first = next(r for r in rows if "loss" in r and r["step"] > resume["step"] and r["time"] >= resume["time"])
    s = resume["start"]
    parts = {}
    lost = [r["time"] for r in rows if r.get("event") == "node_lost" and r["time"] >= caused]
    if "down" in event:  # a node death: the survivors' heartbeat silence, then Slurm's NODE_FAIL requeue
        detected = min(lost) if lost else event["requeued"]  # the job ended by Slurm before any survivor named it
        parts["detection"] = detected - caused
        down = max(event["down"], detected)
        parts["node_fail"] = down - detected  # Slurm marks the node DOWN (SlurmdTimeout and its ping)
        parts["requeue"] = event["requeued"] - down  # the job ends as NODE_FAIL and is requeued
        parts["held"] = event["released"] - event["requeued"]
        parts["schedule"] = event["running"] - event["released"]
        parts["batch_and_srun"] = s["launcher"] - event["running"]
        parts["launcher_and_rendezvous"] = s["rendezvous"] - s["launcher"]
    elif "requeued" in event:  # a preemption: the stop and save, the requeue, then a new launcher
        saved = event.get("saved") or event["requeued"]
        parts["stop_and_save"] = saved - caused
        parts["requeue"] = event["requeued"] - saved
        parts["held"] = event["released"] - event["requeued"]  # Slurm's hold, cut to 2 s: left out
        parts["schedule"] = event["running"] - event["released"]
        parts["batch_and_srun"] = s["launcher"] - event["running"]
        parts["launcher_and_rendezvous"] = s["rendezvous"] - s["launcher"]
        detected = event["running"]
    else:  # a restart in the allocation
        detected = min(r["time"] for r in rows if r.get("event") == "restart" and r["time"] >= caused)
        parts["detection"] = detected - caused
        parts["exit"] = s["stopped"] - detected
        parts["rendezvous"] = s["rendezvous"] - s["stopped"]
    parts["start_up"] = s["imported"] - s["rendezvous"]  # process, imports, config check
    parts["process_group"] = s["process_group"] - s["imported"]
    parts["build"] = s["load_start"] - s["process_group"]  # data, lease, model, optimizer
    parts["load"] = s["loaded"] - s["load_start"]
    parts["first_step"] = first["time"] - s["loaded"]
    rendezvous = parts.get("rendezvous", parts.get("launcher_and_rendezvous", 0.0)) + parts["process_group"]
    return {
        "parts": parts,
        "total_s": first["time"] - caused - parts.get("held", 0.0),
        "detection_to_first_step_s": first["time"] - detected - (parts["held"] if "down" in event else 0.0),
        "goal_s": 3 * parts["load"] + rendezvous,  # the issue's: 3 x the load plus the rendezvous
        "resumed_at": resume["step"],
        **({"down_s": event["down"] - caused} if "down" in event else {}),  # Slurm's SlurmdTimeout, as seen
    }


def steps_redone(run_dir: Path) -> int:
    """Training rows logged more than once: steps trained again after a failure (log.interval=1)."""
    rows = read_rows(run_dir / "metrics.jsonl") + read_rows(run_dir / "metrics.superseded.jsonl")
    steps = [r["step"] for r in rows if "loss" in r]
    return len(steps) - len(set(steps))


def at_scale(recovery_s: float, save_s: float, step_s: float, gpus: int = 1024) -> dict:
    """Expected goodput of a `gpus`-GPU job at Llama 3's interruption rate (interruptions scale with
    the GPUs), saving at the Young-Daly interval tau = sqrt(2 C M) (trainer/checkpoint/manager.py):

        goodput = (1 - C / tau) * (1 - (tau / 2 + R) / M)

    C: seconds one save blocks training, M: mean seconds between interruptions of the job, R: one
    recovery (failure to the first step again), tau / 2: the work lost, on average, since the last
    save. A first-order model (one failure per interval at most), as Young's and Daly's."""
    mtbf_s = LLAMA3_DAYS * 86400 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS / gpus
    tau = math.sqrt(2 * save_s * mtbf_s)
    goodput = (1 - save_s / tau) * (1 - (tau / 2 + recovery_s) / mtbf_s)
    return {
        "gpus": gpus,
        "mtbf_s": mtbf_s,
        "save_s": save_s,
        "interval_s": tau,
        "interval_steps": max(1, round(tau / step_s)),
        "recovery_s": recovery_s,
        "goodput": goodput,
        "recovery_share": recovery_s / mtbf_s,
    }


def summarise(result: dict) -> dict:
    """Per figure, one value a round (bench/run.py makes them figures), a table of the recovery
    parts (medians over the rounds) for the report, and the Llama 3 estimate."""
    import statistics

    rounds = result["rounds"]
    events = [e for r in rounds for e in r["disturbed"]["events"]]
    names = list(dict.fromkeys(e["name"] for e in events))
    med = lambda values: statistics.median(values) if values else float("nan")
    restarts = [e for e in events if "exit" in e["parts"]]  # in the allocation: crash, hang
    crash_total = med([e["total_s"] for e in events if e["name"] == "crash"])
    save_s = med([r["disturbed"]["save_s"] for r in rounds if r["disturbed"].get("save_s")])
    step_s = med([r["disturbed"]["step_s"] for r in rounds])
    llama = [at_scale(e["total_s"], save_s, step_s) for e in events if e["name"] == "crash"]
    deaths = [e for e in events if e["name"] == "node_death"]
    # A node death on a real cluster: Slurm's NODE_FAIL comes SlurmdTimeout (300 s, its default) after
    # the death instead of the 10 s here; the rest of the recovery as measured.
    real = lambda e: e["total_s"] + (REAL_SLURMD_TIMEOUT_S - LOCAL_SLURMD_TIMEOUT_S)
    llama_death = [at_scale(e["total_s"], save_s, step_s) for e in deaths]
    llama_death_real = [at_scale(real(e), save_s, step_s) for e in deaths]
    parts = list(dict.fromkeys(p for e in events for p in e["parts"]))
    table = [
        "",
        f"Recoveries on {result['nodes']} nodes x 1 rank, {result['steps']} steps, parallel.timeout_s="
        f"{result['timeout_s']} (seconds, medians of {len(rounds)} round(s); held: Slurm's requeue hold, cut "
        "to 2 s by the bench and left out of the totals):",
        "",
        "| event | " + " | ".join(parts) + " | total | detection to first step | goal (3 x load + rendezvous) |",
        "|---" * (len(parts) + 4) + "|",
    ]
    for name in names:
        mine = [e for e in events if e["name"] == name]
        cells = [f"{med([e['parts'][p] for e in mine if p in e['parts']]):.2f}" for p in parts]
        table.append(
            f"| {name} | "
            + " | ".join(c.replace("nan", "-") for c in cells)
            + f" | {med([e['total_s'] for e in mine]):.1f} | {med([e['detection_to_first_step_s'] for e in mine]):.1f}"
            f" | {med([e['goal_s'] for e in mine]):.2f} |"
        )
    est = llama[0] if llama else None
    if est:
        table += [
            "",
            f"At Llama 3's rate (466 interruptions in 54 days on 16,384 GPUs), a 1024-GPU job is interrupted every "
            f"{est['mtbf_s'] / 3600:.1f} h (M); with a blocking save of C = {save_s:.2f} s the Young-Daly interval is "
            f"tau = sqrt(2 C M) = {est['interval_s'] / 60:.1f} min, and a recovery of R = {crash_total:.1f} s "
            f"(the crash's, median) gives goodput (1 - C/tau)(1 - (tau/2 + R)/M) = "
            f"{med([x['goodput'] for x in llama]):.4f}.",
        ]
    if est and deaths:
        r_death = med([e["total_s"] for e in deaths])
        table += [
            "",
            f"Most of Llama 3's interruptions were hardware (78% of the unexpected ones), which can take the node: "
            f"taken as node deaths, R = {r_death:.1f} s (the node death's, median: the job continues on the nodes "
            f"left) gives {med([x['goodput'] for x in llama_death]):.4f}; on a real cluster Slurm requeues a job "
            f"after SlurmdTimeout = {REAL_SLURMD_TIMEOUT_S} s, not {LOCAL_SLURMD_TIMEOUT_S} s, so "
            f"R = {r_death + REAL_SLURMD_TIMEOUT_S - LOCAL_SLURMD_TIMEOUT_S:.0f} s and goodput "
            f"{med([x['goodput'] for x in llama_death_real]):.4f}.",
        ]
    note = (
        f"{result['nodes']} nodes of the local cluster x 1 rank (gloo, the default config's tiny transformer), "
        f"{result['steps']} steps, checkpoint.interval=5, parallel.timeout_s={result['timeout_s']}, "
        f"{len(rounds)} round(s) of the job undisturbed then under the schedule {', '.join(names)}"
    )
    return {
        "goodput": [r["goodput"] for r in rounds],
        "steps_redone": [r["disturbed"]["steps_redone"] for r in rounds],
        "total_s": {
            n: [e["total_s"] for e in events if e["name"] == n] for n in ("crash", "hang", "preemption", "node_death")
        },
        "node_down_s": [e["down_s"] for e in deaths],
        "restart_vs_goal": [e["detection_to_first_step_s"] / e["goal_s"] for e in restarts],
        "llama3": [x["goodput"] for x in llama],
        "llama3_detail": llama,
        "llama3_node_death": [x["goodput"] for x in llama_death],
        "llama3_node_death_real_slurm": [x["goodput"] for x in llama_death_real],
        "table": table,
        "note": note,
    }


# ---------------------------------------------------------------------------------------------------
# Jobs


def run_job(run_dir: Path, nodes: int, steps: int, timeout_s: int, schedule: list) -> dict:
    """Submit the job, strike `schedule` at its steps, wait for the end; the times of each part."""
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    out = subprocess.run(
        [sys.executable, "-m", "trainer.submit", "--nodes", str(nodes), "--gpus-per-node", "1"]
        + ["--min-nodes", str(nodes - MIN_NODES_LEFT), "--run-dir", str(run_dir), f"train.steps={steps}"]
        + [f"train.global_batch_size={GLOBAL_BATCH}", "checkpoint.interval=5", "log.interval=1"]
        + ["log.progress=false", f"parallel.timeout_s={timeout_s}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"submit failed: {out.stderr.strip()[-300:]}")
    job = re.search(r"submitted job (\d+)", out.stdout).group(1)
    metrics = run_dir / "metrics.jsonl"
    dead = None  # the node a node death kills, restored whatever happens
    try:
        _, began = wait_until(lambda: job_info(job).get("JobState") == "RUNNING", 120, "the job to run")
        nodes_list = job_info(job)["NodeList"]
        if any(cause is node_death for _, _, cause in schedule):
            dead = victim(nodes_list)
        events, base = [], 0
        for name, after, cause in schedule:
            wait_until(
                lambda: any("loss" in r and r["step"] >= base + after for r in read_rows(metrics)),
                300,
                f"step {base + after} before the {name}",
            )
            event = {"name": name, **cause(job, run_dir, nodes_list)}
            wait_until(lambda: recovered(read_rows(metrics), event["caused"]), 300, f"the first step after the {name}")
            rows = read_rows(metrics)
            event.update(recovery(rows, event))
            base = event["resumed_at"]
            events.append(event)
        info, ended = wait_until(
            lambda: (i := job_info(job)).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") and i, 600, "the end"
        )
        if info["JobState"] != "COMPLETED":
            raise RuntimeError(f"job {job} ended {info['JobState']} ({run_dir}/slurm/{job}.out)")
        held = sum(e["parts"].get("held", 0.0) for e in events)
        return {"job": job, "wall_s": ended - began - held, "held_s": held, "events": events}
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        for pid in ranks_of(job).values():  # a rank left stopped by a failed round
            with_signal(pid, signal.SIGKILL)
        if dead:
            restore_node(dead)


def with_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="result JSON, rewritten after every round")
    parser.add_argument("--scratch", default=str(ROOT / "runs" / "bench-goodput"), help="run dirs every node sees")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="steps of the job")
    parser.add_argument("--timeout-s", type=int, default=10, help="parallel.timeout_s: how long a hang goes unseen")
    args = parser.parse_args()
    if not cluster_up():
        print("bench.goodput: the local Slurm cluster is not up (make slurm-up)", file=sys.stderr)
        return 3
    scratch = Path(args.scratch).resolve()
    slurm.check_shared(scratch, nodes=args.nodes)
    result = {"nodes": args.nodes, "steps": args.steps, "timeout_s": args.timeout_s, "rounds": []}
    for i in range(args.rounds):
        calm = run_job(scratch / f"calm-{i}", args.nodes, args.steps, args.timeout_s, [])
        hit = run_job(scratch / f"hit-{i}", args.nodes, args.steps, args.timeout_s, SCHEDULE)
        hit["steps_redone"] = steps_redone(scratch / f"hit-{i}")
        hit["save_s"] = layout.read_status(scratch / f"hit-{i}").get("save_s")
        steps = [r for r in read_rows(scratch / f"calm-{i}" / "metrics.jsonl") if "step_time_s" in r]
        hit["step_s"] = sorted(r["step_time_s"] for r in steps)[len(steps) // 2]
        result["rounds"].append({"undisturbed": calm, "disturbed": hit, "goodput": calm["wall_s"] / hit["wall_s"]})
        print(f"bench.goodput: round {i + 1}: goodput {calm['wall_s'] / hit['wall_s']:.3f}", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        subprocess.run(["rm", "-rf", str(scratch / f"calm-{i}"), str(scratch / f"hit-{i}")], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
