"""What goes wrong in a job on the real local cluster (make slurm-up), and what the launchers do
about it: preemption and the time-limit warning (requeue and resume), a killed rank (restart in the
allocation), a node that dies or fails the health check, a cancelled job, a job that makes no progress.

Stop signals are delivered as proctrack/cgroup does: to the job step's task alone (`signal_tasks`).
The cluster, its skip and the run dirs' root: tests/system/test_slurm_jobs.py, tests/helpers/slurm.py
and tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import torch

from bench.nodes import job_processes, kill_node, restore_node
from bench.nodes import parent_pid as _ppid
from tests.helpers.outputs import metrics
from tests.helpers.run import ROOT
from tests.helpers.slurm import COMMON, cluster, job_info, log_text, make_submit, submit_job, wait_job
from tests.helpers.slurm import wait_for_cluster as wait_for  # polls scontrol and sinfo 5 times a second
from trainer.rundir import layout


def signal_tasks(job_id: str, sig: str = "USR1") -> list[int]:
    """Signal the tasks of the job's step 0, and nothing else: what proctrack/cgroup does (Slurm
    signals the step's direct children; processes they started are left to them). Returns the pids."""
    stepds = [
        p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) == f"slurmstepd: [{job_id}.0]"
    ]
    tasks = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) in stepds]
    assert tasks, f"no task of step {job_id}.0 found"
    subprocess.run(["kill", f"-{sig}", *map(str, tasks)], check=True)
    return tasks


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint (model, optimizer), read in this one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = layout.latest_committed_step(run_dir)
    out = run_dir / "final.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}", out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)

    walk("", torch.load(out, weights_only=False))
    return flat


@cluster
def test_preempted_job_requeues_and_matches_uninterrupted_run(runs):
    # Long enough that the preemption lands mid-run also on a quiet machine (30 steps once ended first).
    steps = ["train.steps=60", *COMMON]
    reference, victim = runs / "reference", runs / "preempted"
    # Whole nodes (the default), so that preempting one job leaves the other alone.
    ref_job = submit_job("--nodes", "2", "--gpus-per-node", "1", "--run-dir", str(reference), *steps)
    job = submit_job("--nodes", "2", "--gpus-per-node", "1", "--run-dir", str(victim), *steps)
    wait_for(lambda: job_info(job).get("JobState") == "RUNNING", 60, "the job to start")
    nodes = job_info(job)["NodeList"]
    wait_for(lambda: layout.latest_committed_step(victim), 90, "the first checkpoint")
    # An exclusive job in the urgent partition needs the victim's nodes: Slurm preempts it.
    urgent = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "urgent",
            "--exclusive",
            "-N2",
            f"--nodelist={nodes}",
            "-o",
            str(runs / "urgent-%j.out"),
            "--wrap",
            "sleep 1",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wait_for(lambda: int(job_info(job).get("Restarts", 0)) >= 1, 60, "the preempted job to be requeued")
    stopped_at = layout.latest_committed_step(victim)
    assert stopped_at is not None and stopped_at < 60
    assert wait_job(urgent)["JobState"] == "COMPLETED"
    info = wait_job(job)
    assert info["JobState"] == "COMPLETED", log_text(victim, job)
    log = log_text(victim, job)
    assert "received SIGTERM" in log and "restart 1" in log and f"at step {stopped_at}" in log
    assert wait_job(ref_job)["JobState"] == "COMPLETED"
    assert int(job_info(ref_job).get("Restarts", 0)) == 0
    got, want = final_state(victim), final_state(reference)
    assert got.keys() == want.keys() and len(got) > 0
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs after preemption"


@cluster
def test_a_killed_rank_restarts_every_rank_in_the_allocation(runs):
    """kill -9 of rank 1 (the second node's) mid-run in a 2-node job: every rank restarts from the
    newest checkpoint in the same allocation (not requeued: Restarts stays 0), said in one line and a
    restart row; every step once, and the weights of the uninterrupted run of the same shape."""
    steps = ["train.steps=60", *COMMON]  # the preemption test's run: its reference is reused
    run_dir, reference = runs / "restarted", runs / "reference"
    job = submit_job("--nodes", "2", "--gpus-per-node", "1", "--run-dir", str(run_dir), *steps)
    wait_for(lambda: layout.latest_committed_step(run_dir), 120, "the first checkpoint")
    workers = [p for p in job_processes(job, RANK="1") if "trainer.launch" not in _cmdline(Path(f"/proc/{p}"))]
    assert len(workers) == 1, workers
    os.kill(workers[0], 9)
    info = wait_job(job)
    log = log_text(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log
    found = re.findall(
        r"^\d: launch: rank 1 on (n\d) failed with exit code -9 \(SIGKILL\); restart 1 of 3: every rank starts "
        r"again from step (\d+), the newest checkpoint$",
        log,
        re.M,
    )
    assert len(found) == 1 and len(re.findall(r"launch: .*restart \d of", log)) == 1, log
    node, resumed = found[0][0], int(found[0][1])
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [(r["event"], r["step"], r.get("node")) for r in logged if "event" in r]
    assert events == [("restart", resumed, node), ("resume", resumed, None)], events
    assert [r["step"] for r in metrics(run_dir)] == list(range(5, 61, 5))
    if layout.latest_committed_step(reference) != 60:  # run alone: the reference made here
        reference = runs / "restart-reference"
        assert (
            wait_job(submit_job("--nodes", "2", "--gpus-per-node", "1", "--run-dir", str(reference), *steps))[
                "JobState"
            ]
            == "COMPLETED"
        )
    ours, theirs = final_state(run_dir), final_state(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@cluster
def test_a_node_that_dies_is_named_and_the_job_resumes_on_the_nodes_left(runs):
    """NODES=4 MIN_NODES=3, one rank per node: after the first checkpoint n3 dies (its slurmd and the
    job's processes killed). Each surviving node says in one line that n3 stopped answering and what
    happens next, with no TCPStore stack; the job runs again on the 3 nodes left (3 ranks, the same
    global batch: 4 micro-batches per rank instead of 3), from the newest checkpoint, to the end with
    every step once. The node is brought back afterwards."""
    run_dir = runs / "dead-node"
    batch = ["train.global_batch_size=12", "train.micro_batch_size=1"]
    idle = ["sinfo", "-h", "-N", "-p", "main", "-t", "idle", "-o", "%N"]
    wait_for(lambda: len(subprocess.run(idle, capture_output=True, text=True).stdout.split()) == 4, 60, "4 idle nodes")
    job = make_submit(
        "NODES=4",
        "MIN_NODES=3",
        "GPUS_PER_NODE=1",
        f"RUN_DIR={run_dir}",
        "ARGS=" + " ".join(["train.steps=60", *batch, *COMMON]),
    )
    try:
        wait_for(lambda: layout.latest_committed_step(run_dir), 120, "the first checkpoint")
        assert job_info(job)["NodeList"] == "n[1-4]"
        kill_node(job, "n3")
        info = wait_job(job, timeout=240)
        log = log_text(run_dir, job)
        assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log  # requeued once, by Slurm
    finally:
        subprocess.run(["scancel", job])
        restore_node("n3")
    saved = re.findall(r"node n3 stopped answering .*resumes from step (\d+), the newest checkpoint$", log, re.M)
    lines = re.findall(
        r"^(\d): launch: (n\d): node n3 stopped answering \(no heartbeat for 10 s\); the job ends, "
        r"Slurm requeues it on the nodes left \(--nodes=3-4\) and it resumes from step \d+, the newest checkpoint$",
        log,
        re.M,
    )
    # Each survivor says it once; srun's kill after the first exit may still cut one short (see the
    # report of #28): at least two of the three, and no line names another node.
    named = [n for _, n in lines]
    assert len(named) == len(set(named)) >= 2 and set(named) <= {"n1", "n2", "n4"}, log
    assert len(re.findall(r"stopped answering", log)) == len(named), log
    assert "TCPStore" not in log and "RendezvousConnectionError" not in log, log
    # The survivors' ranks, whose collectives lost n3's rank, say so in a line each, not a traceback.
    assert "Traceback" not in log, log
    gone = re.compile(r"\d: error: rank \d on n[124]: a peer went away during a collective \(.*by peer.*\); the ")
    assert all(gone.match(line) for line in log.splitlines() if "went away" in line), log
    resumed = int(saved[0])
    assert {int(n) for n in saved} == {resumed} and "requeue failed" not in log, log  # Restarts 1: once
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(5, 61, 5)), rows
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [(r["event"], r["step"], r.get("nodes")) for r in logged if "event" in r]
    assert events == [("node_lost", resumed, ["n3"]), ("resume", resumed, None)], events
    assert [r["node"] for r in logged if r.get("event") == "node_lost"][0] in {"n1", "n2", "n4"}
    assert {r["world_size"] for r in rows if r["step"] <= resumed} == {4}
    assert {r["world_size"] for r in rows if r["step"] > resumed} == {3}
    # The same global batch of 12: 1 sample x 3 micro-batches on each of 4 ranks, then x 4 on 3.
    assert re.search(r"on 4 x cpu, .*, 1 samples x 3 micro-batches per rank, steps 0->60$", log, re.M), log
    assert re.search(rf"on 3 x cpu, .*, 1 samples x 4 micro-batches per rank, steps {resumed}->60$", log, re.M), log
    assert f"resumed from {run_dir}/checkpoints/step_{resumed:08d} at step {resumed} (saved by 4 processes" in log
    assert layout.latest_committed_step(run_dir) == 60


@cluster
def test_sbatch_job_warned_the_cgroup_way_saves_requeues_and_resumes(runs):
    """The time-limit warning (#SBATCH --signal=USR1@N) as proctrack/cgroup delivers it: SIGUSR1 to
    the step's tasks only (the launchers), not to the ranks they started. The launchers forward it,
    the ranks save, the batch script requeues, and the requeued job resumes and finishes."""
    run_dir = runs / "time-limit"
    job = submit_job(
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--run-dir",
        str(run_dir),
        "--time",
        "30",
        "train.steps=300",
        "checkpoint.interval=1000",
        "log.interval=1",
    )
    wait_for(lambda: run_dir.joinpath("metrics.jsonl").is_file(), 90, "training to start")
    tasks = signal_tasks(job)
    assert len(tasks) == 2  # one launcher per node
    info = wait_job(job)
    log = log_text(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "received SIGUSR1" in log and "requeueing" in log and "launch: stopped by SIGUSR1 after step" in log
    steps = [row["step"] for row in metrics(run_dir)]
    assert steps == list(range(1, 301)), "every step logged once: resumed, not restarted"


@cluster
def test_a_cancelled_job_is_not_requeued(runs):
    """scancel signals the batch shell too, and the requeue check then runs while the job is still
    COMPLETING: it must see that the job was cancelled, not requeue it."""
    run_dir = runs / "cancelled"
    job = submit_job(
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--run-dir",
        str(run_dir),
        "train.steps=100000",
        "checkpoint.interval=1000000",
        "log.interval=5",
    )
    wait_for(lambda: run_dir.joinpath("metrics.jsonl").is_file(), 90, "training to start")
    subprocess.run(["scancel", job], check=True)
    info = wait_job(job, release=False, timeout=90)
    log = log_text(run_dir, job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log
    assert "cancelled or at its time limit; not requeued" in log


@cluster
def test_job_without_progress_is_not_requeued_forever(runs, tmp_path):
    """Ranks that crash at start (exit 1: a failure that may pass, not bad input) are restarted and
    requeued until two attempts in a row saved no new checkpoint. (A file where the trace folder goes
    used to crash them; it is bad input now, one line and no requeue, since #41.)"""
    run_dir = runs / "no-progress"
    run_dir.mkdir(parents=True)
    crash = tmp_path / "crash"
    crash.mkdir()
    (crash / "sitecustomize.py").write_text(  # imported by every Python; exits in torchrun's workers only
        "import os\nif 'TORCHELASTIC_RUN_ID' in os.environ and 'LOCAL_RANK' in os.environ:\n    os._exit(1)\n"
    )
    job = submit_job(
        "--nodes",
        "1",
        "--run-dir",
        str(run_dir),
        "--max-attempts",
        "2",
        "train.steps=10",
        "log.interval=1",
        env={"PYTHONPATH": f"{crash}{os.pathsep}{ROOT}"},
    )
    info = wait_job(job)
    assert info["JobState"] == "FAILED"
    assert info["Restarts"] == "1"
    assert "NOT requeued: 2 attempts in a row saved no new checkpoint" in log_text(run_dir, job)


@cluster
def test_submitit_job_warned_the_cgroup_way_saves_requeues_and_finishes(runs):
    """submitit: Slurm signals its Python task on each node (the step's task), never torchrun's
    ranks; the task runs the launcher in-process, which forwards to the ranks. Task 0 requeues."""
    run_dir = runs / "submitit"
    job = submit_job(
        "--launcher",
        "submitit",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--run-dir",
        str(run_dir),
        "--time",
        "10",
        "train.steps=100",
        "checkpoint.interval=100",
        "log.interval=5",
    )
    wait_for(lambda: run_dir.joinpath("metrics.jsonl").is_file(), 90, "training to start")
    assert len(signal_tasks(job)) == 2
    info = wait_job(job)
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "slurm" / "submitit").glob(f"{job}_*_log.*")))
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", logs
    assert "launch: stopped by SIGUSR1 after step" in logs
    # Resumed, not restarted: every step was logged once (submitit may rewrite its log on requeue).
    steps = [row["step"] for row in metrics(run_dir)]
    assert steps == sorted(set(steps)) and steps[-1] == 100, (steps, logs)
    assert {row["world_size"] for row in metrics(run_dir)} == {2}
    assert layout.latest_committed_step(run_dir) == 100


@cluster
def test_a_node_that_fails_the_health_check_is_named_excluded_and_the_job_runs_without_it(runs):
    """health.command fails on n2 alone: n2 says so in one line, the job is requeued with n2 in its
    ExcNodeList, the next attempt trains on two other nodes and finishes, and status.json lists n2.
    The health lines of the nodes that passed and of the ranks' all-reduce (gloo, 2 nodes) are there."""
    run_dir = runs / "health"
    job = submit_job(
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--run-dir",
        str(run_dir),
        "train.steps=4",
        "log.interval=2",
        'health.command=test "$HEALTH_NODE" != n2',
    )
    info = wait_job(job, timeout=150)
    log = log_text(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    failed = [line for line in log.splitlines() if re.match(r"\d+: health: n2: ", line)]
    assert [line.split(": ", 1)[1] for line in failed] == [
        'health: n2: health.command `test "$HEALTH_NODE" != n2` exited 1 (no output)'
    ], log
    requeued = f"requeue-check: job {job}: node(s) n2 failed the health check; requeueing without them (excluded: n2; "
    assert requeued in log
    assert (
        info["ExcNodeList"] == "n2"
        and "n2"
        not in subprocess.run(
            ["scontrol", "show", "hostnames", info["NodeList"]], capture_output=True, text=True
        ).stdout.split()
    ), info
    assert re.search(r"^\d+: health: n[134]: passed in [\d.]+ s: no GPU used .*health\.command passed", log, re.M), log
    assert re.search(
        r"^\d: health: all-reduce of 4\.2 MB across 2 ranks on 2 node\(s\) \(gloo\): [\d.]+ GB/s bus bandwidth",
        log,
        re.M,
    ), log
    assert [row["step"] for row in metrics(run_dir)] == [2, 4]
    excluded = layout.read_status(run_dir)["excluded_nodes"]
    assert [(e["node"], e["job"]) for e in excluded] == [("n2", job)], excluded
    assert excluded[0]["reason"].startswith("health.command `test"), excluded
    assert not list((run_dir / "slurm" / "health").iterdir()), "each record is read once"
    # The node that passed, stopped by srun after n2's exit, names n2 rather than only the signal.
    assert "before training started" not in log and "no checkpoint was saved by this start" not in log, log
    stopped = [line for line in log.splitlines() if re.match(r"\d+: launch: .*(stopped|received)", line)]
    assert all(
        re.fullmatch(
            r"\d+: launch: n[134]: stopped by SIGTERM: node n2 of this job failed the health check \(said above\); "
            r"nothing to save",
            line,
        )
        for line in stopped
    ), log
