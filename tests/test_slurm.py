"""Slurm launchers against the real local cluster (make slurm-up), plus golden batch scripts.

The cluster looks like a GPU cluster (slurm/local/up.sh): the submit host (this machine) has no
GPU, each node declares 2 GPUs through gres, and has its own node-local disk at /nodelocal. Stop
signals are delivered as proctrack/cgroup does: to the job step's task alone (`signal_tasks`).
The cluster tests are skipped with one line when the cluster is not up. Every job is tiny: the
default config's tiny transformer, a few dozen steps.
Run directories live under runs/ (a path every node sees), or under ~/.cache when the repository
itself sits on a node-local path such as /tmp, which multi-node submissions rightly refuse.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.nodes import job_processes, kill_node, restore_node
from bench.nodes import parent_pid as _ppid
from trainer import files, layout, submit

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def _cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
    return out.returncode == 0 and len(re.findall(r" (idle|mix|alloc)", out.stdout)) >= 4


_no_cluster = pytest.mark.skipif(not _cluster_up(), reason="local Slurm cluster is not up (make slurm-up)")


def cluster(test):
    """Needs the local Slurm cluster (skipped without it); slow: each such test runs jobs or submits."""
    return pytest.mark.slow(_no_cluster(test))


@pytest.fixture(scope="module")
def runs():
    """A run dir root the nodes see and that only this user can swap: submitit refuses a run dir
    whose folders above let another user rename it (a CI clone owned by another uid than the one
    running the tests, or one in /tmp, falls back to a folder under home)."""
    root = REPO / "runs" / f"test-slurm-{os.getpid()}"
    try:
        submit.check_shared(root, nodes=4)
        root.mkdir(parents=True, exist_ok=True)
        safe = files.replaceable(root) is None
    except (submit.SubmitError, OSError):
        safe = False
    if not safe:
        shutil.rmtree(root, ignore_errors=True)
        root = Path.home() / ".cache" / "fsdp-trainer-tests" / f"slurm-{os.getpid()}"
        root.mkdir(parents=True, exist_ok=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ---- helpers ------------------------------------------------------------------------------------


def submit_job(*args: str, env: dict[str, str] | None = None) -> str:
    """Run python -m trainer.submit; return the job id it prints."""
    out = subprocess.run(
        [sys.executable, "-m", "trainer.submit", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def make_submit(*variables: str) -> str:
    """`make submit VAR=...` as a user types it; return the job id it prints."""
    out = subprocess.run(["make", "submit", *variables], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


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


def on_node(node: str, *cmd: str) -> subprocess.CompletedProcess:
    """Run cmd in an emulated node's mount namespace (it sees that node's /nodelocal)."""
    pid = Path(f"/run/slurm-local/slurmd-{node}.pid").read_text().strip()
    return subprocess.run(["nsenter", "-t", pid, "-m", "--", *cmd], capture_output=True, text=True)


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_job(job_id: str, timeout: float = 240, release: bool = True) -> dict[str, str]:
    """Wait until job_id ends; a requeued job is released after 2 s instead of Slurm's ~120 s.

    Not at once: slurmd refuses a launch whose credential is not newer, to the second, than the
    requeue's revocation ("Job credential revoked"), and Slurm then fails the job for good."""
    deadline, released = time.time() + timeout, None  # the restart count last released
    while time.time() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in FINAL_STATES:
            return info
        if (
            release
            and info.get("JobState") == "PENDING"
            and info.get("Reason") == "BeginTime"
            and info.get("Restarts") != released
        ):
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now+2"], check=True)
            released = info.get("Restarts")
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not end within {timeout} s: {job_info(job_id)}")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metrics(run_dir: Path) -> list[dict]:
    """The rows of metrics.jsonl, without event rows (resume, restart: trainer/metrics.py)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if "event" not in row]


def log_text(run_dir: Path, job_id: str) -> str:
    return (run_dir / "slurm" / f"{job_id}.out").read_text()


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


COMMON = ["checkpoint.interval=5", "log.interval=5"]


# ---- jobs on the local cluster ------------------------------------------------------------------


@cluster
def test_make_submit_uses_the_partitions_gpus_then_continues_on_fewer(runs):
    """`make submit NODES=2` from a host without GPUs: GPUS_PER_NODE comes from the partition's gres
    (2), so 4 ranks train; the nodes say they fall back to the CPU. Then 1 node resumes the run."""
    run_dir = runs / "make-submit"
    job = make_submit("NODES=2", f"RUN_DIR={run_dir}", "ARGS=train.steps=10 " + " ".join(COMMON))
    info = wait_job(job)
    assert info["JobState"] == "COMPLETED", log_text(run_dir, job)
    assert {row["world_size"] for row in metrics(run_dir)} == {4}
    assert layout.latest_committed_step(run_dir) == 10
    log = log_text(run_dir, job)
    for label in ("0", "1"):  # srun --label: each line says its node
        assert re.search(
            rf"^{label}: launch: n\d: 2 rank\(s\) on the CPU with gloo: GPUs 0,1 are assigned", log, re.M
        ), log
    # Same run directory, one node, more steps: resumes at step 10 with 2 ranks.
    job2 = submit_job("--nodes", "1", "--run-dir", str(run_dir), "train.steps=20", *COMMON)
    info = wait_job(job2)
    assert info["JobState"] == "COMPLETED", log_text(run_dir, job2)
    rows = metrics(run_dir)
    assert [r["world_size"] for r in rows if r["step"] > 10] and all(
        r["world_size"] == 2 for r in rows if r["step"] > 10
    )
    assert "resumed from" in log_text(run_dir, job2) and "at step 10" in log_text(run_dir, job2)
    assert layout.latest_committed_step(run_dir) == 20


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
def test_job_without_progress_is_not_requeued_forever(runs):
    run_dir = runs / "no-progress"
    run_dir.mkdir(parents=True)
    (run_dir / "trace").write_text("")  # a file where the debugging trace folder goes: the ranks crash at start
    job = submit_job(
        "--nodes",
        "1",
        "--run-dir",
        str(run_dir),
        "--max-attempts",
        "2",
        "train.steps=10",
        "log.interval=1",
        "data.trace=true",
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
def test_a_node_that_cannot_see_the_run_dir_is_named_before_training():
    """/nodelocal is each node's own disk: rank 0 on n1 writes there, n2 sees nothing. The job stops
    before training with one line naming n2, and is not requeued (bad input)."""
    run_dir = Path("/nodelocal") / f"run-{os.getpid()}"
    for node in ("n1", "n2"):  # the folder exists on both nodes, as a per-user scratch folder would
        assert on_node(node, "mkdir", "-p", str(run_dir / "slurm")).returncode == 0
    try:
        job = submit_job("--nodes", "2", "--gpus-per-node", "1", "--run-dir", str(run_dir), "train.steps=10")
        info = wait_job(job)
        log = on_node("n1", "cat", str(run_dir / "slurm" / f"{job}.out")).stdout
        assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log
        errors = [
            line for line in log.splitlines() if re.match(r"\d+: error: ", line)
        ]  # ours, not srun's or slurmstepd's
        assert len(errors) == 1, log  # one line, from one rank; torchrun's rendezvous orders the nodes
        assert re.search(
            rf"run_dir {run_dir} is not shared: node (n[12]) \(rank 1\) cannot see the file rank 0 wrote "
            rf"there on (?!\1)n[12]; put run_dir on a filesystem every node mounts",
            errors[0],
        ), errors[0]
        assert "NOT requeued: the training step stopped on bad input" in log
        assert on_node("n1", "ls", str(run_dir / "checkpoints")).returncode != 0, "nothing trained"
    finally:
        for node in ("n1", "n2"):
            on_node(node, "rm", "-rf", str(run_dir))


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


@cluster
def test_dry_run_prints_resources_with_reasons_and_the_script_and_submits_nothing(runs):
    run_dir = runs / "dry-run"
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    out = subprocess.run(
        ["make", "submit", "NODES=2", f"RUN_DIR={run_dir}", "DRY_RUN=1"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"GPUs per node +2 +\[every GPU of a node of partition main \(gres gpu:2\)\]", out.stdout), (
        out.stdout
    )
    assert re.search(r"ranks +4 \(2 x 2\)", out.stdout)
    assert re.search(r"CPUs per node +2 +\[all CPUs of a node of partition main", out.stdout)
    assert "#SBATCH --gpus-per-node=2" in out.stdout and "#SBATCH --exclusive" in out.stdout
    assert "srun --label --kill-on-bad-exit=1 --cpus-per-task=2" in out.stdout
    assert "preemption        GraceTime 15 s" in out.stdout or re.search(r"preemption +GraceTime 15 s", out.stdout)
    assert not run_dir.exists(), "a dry run writes nothing"
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


@cluster
@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0"], "NODES='0'"),
        (["--nodes", "four"], "NODES='four'"),
        (["--config", "configs/missing.yaml"], "CONFIG=configs/missing.yaml: no such file"),
        (["--partition", "nosuch"], "PARTITION=nosuch: unknown partition"),
        (["--nodes", "2", "--run-dir", "/dev/shm/run"], "node-local"),
        (["--nodes", "2", "--run-dir", "/tmp/run"], "node-local"),
        (["train.steps=-3"], "train.steps"),
        (["--gpus-per-node", "3"], "GPUS_PER_NODE=3 but the nodes of partition main have 2 GPU(s) each (gres)"),
        (["--cpus-per-node", "4"], "CPUS_PER_NODE=4 but the nodes of partition main have 2 CPUs each"),
        (["--container", "/no/such/image.sqsh"], "CONTAINER=/no/such/image.sqsh: no such file"),
        (["--container", "nvcr.io#nvidia/pytorch:25.01-py3"], "this cluster's srun has no Pyxis plugin"),
        (["--warn-seconds", "21", "model.size=1b"], "WARN=21 leaves the ranks 1 s to save, but one save takes about"),
    ],
)
def test_bad_input_is_one_line_before_submitting(args, message):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    out = subprocess.run([sys.executable, "-m", "trainer.submit", *args], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("submit: error:") and message in lines[0], out.stderr
    assert "error: error" not in lines[0]
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


# ---- rendered batch scripts for what cannot run here (GPUs, containers) -------------------------


def _gpu_job(
    container: str | None, runtime: str | None = None, net_if: str | None = None, min_nodes: int | None = None
) -> submit.Job:
    return submit.Job(
        nodes=4,
        gpus_per_node=8,
        cpus_per_node=96,
        config=Path("/shared/fsdp-trainer/configs/llama.yaml"),
        run_dir=Path("/shared/runs/llama-8b"),
        overrides=["train.steps=10000"],
        time="1-00:00:00",
        partition="gpu",
        container=container,
        runtime=runtime,
        net_if=net_if,
        warn_seconds=300,
        max_attempts=3,
        min_nodes=min_nodes,
        max_excluded=2,
    )


@pytest.mark.parametrize(
    "name, job",
    [
        ("gpu-8x4.sbatch", _gpu_job(None, net_if="ib0")),
        ("gpu-8x4-pyxis.sbatch", _gpu_job("/shared/images/trainer.sqsh", "pyxis")),
        ("gpu-8x4-pyxis-registry.sbatch", _gpu_job("nvcr.io#nvidia/pytorch:25.01-py3", "pyxis")),
        ("gpu-8x4-apptainer.sbatch", _gpu_job("/shared/images/trainer.sif", "apptainer")),
        ("gpu-8x3-4.sbatch", _gpu_job(None, min_nodes=3)),
    ],
)
def test_rendered_batch_script_matches_golden(name, job):
    text = submit.render_sbatch(
        job,
        repo_dir=Path("/shared/fsdp-trainer"),
        python="/shared/fsdp-trainer/.venv/bin/python",
        host_python="python3",
    )
    if os.environ.get("UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(text)
    assert text == (GOLDEN / name).read_text(), f"rendered script differs from tests/golden/{name}"
    assert "{{" not in text and "--node-rank=\\$SLURM_NODEID" in text and "srun --label --kill-on-bad-exit=1" in text
    assert "--cpus-per-task=96" in text.split("srun", 1)[1], "srun passes the CPUs on (Slurm 22.05-23.02 do not)"


@pytest.mark.parametrize(
    "given, runtime, image",
    [
        ("nvcr.io#nvidia/pytorch:25.01-py3", "pyxis", "nvcr.io#nvidia/pytorch:25.01-py3"),
        ("docker://nvcr.io/nvidia/pytorch:25.01-py3", "pyxis", "nvcr.io#nvidia/pytorch:25.01-py3"),
        ("docker://ubuntu:24.04", "pyxis", "ubuntu:24.04"),
        ("ubuntu:24.04", "pyxis", "ubuntu:24.04"),
        ("nvcr.io#nvidia/pytorch:25.01-py3", "apptainer", "docker://nvcr.io/nvidia/pytorch:25.01-py3"),
    ],
)
def test_registry_images_in_each_runtimes_form(given, runtime, image):
    forced = runtime if runtime == "apptainer" else None
    assert submit.container_image(given, forced) == (image, runtime)


def test_gres_gpu_counts():
    assert submit.gres_gpus("gpu:8") == 8
    assert submit.gres_gpus("gpu:a100:4(S:0-1),gpu:h100:4") == 8
    assert submit.gres_gpus("gpu:2,mps:100") == 2
    assert submit.gres_gpus("(null)") == 0


# ---- the local cluster's configuration for N nodes (slurm/local/up.sh --render) -----------------


def _render(folder: Path, *count: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "slurm" / "local" / "up.sh"), "--render", str(folder), *count],
        capture_output=True,
        text=True,
    )


def _node_lines(folder: Path) -> list[str]:
    text = (folder / "slurm.conf").read_text() + (folder / "gres.conf").read_text()
    return [line.split(" CPUs=")[0] for line in text.splitlines() if line.startswith(("NodeName=", "PartitionName="))]


@pytest.mark.parametrize(
    "count, nodes, ports",
    [([], "n[1-4]", "17001-17004"), (["8"], "n[1-8]", "17001-17008"), (["1"], "n1", "17001")],
)
def test_local_cluster_renders_its_node_count(tmp_path, count, nodes, ports):
    """4 nodes unless given (the lines main always had), 8 for the rehearsal of a bigger cluster:
    each node keeps its own slurmd port and 2 GPUs (gres), both partitions span all of them."""
    out = _render(tmp_path, *count)
    assert out.returncode == 0, out.stderr
    host = socket.gethostname()
    assert _node_lines(tmp_path) == [
        f"NodeName={nodes} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports}",
        f"PartitionName=main Nodes={nodes} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=15 "
        "MaxTime=INFINITE State=UP",
        f"PartitionName=urgent Nodes={nodes} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP",
        f"NodeName={nodes} Name=gpu File=/dev/fakegpu[0-1]",
    ]
    assert "Gres=gpu:2 " in (tmp_path / "slurm.conf").read_text()
    assert "@" not in (tmp_path / "slurm.conf").read_text() + (tmp_path / "gres.conf").read_text()


@pytest.mark.parametrize("count", ["0", "eight", "100", "8 9"])
def test_local_cluster_refuses_a_bad_node_count_in_one_line(tmp_path, count):
    out = _render(tmp_path, count)
    assert out.returncode == 2
    assert out.stderr == (
        f"slurm/local/up.sh: NODES='{count}' is not a node count from 1 to 99; e.g. make slurm-up NODES=8\n"
    )
    assert list(tmp_path.iterdir()) == []


# ---- values reach the batch script's shell as data, never as code ------------------------------


def _sbatch_argument(line: str) -> str:
    """The first argument of an #SBATCH line as sbatch reads it (Slurm's _get_argument): blanks end
    it unless inside double quotes, an unescaped '#' ends the line, a backslash escapes what follows."""
    text, out, quoted, escaped = line.split("#SBATCH", 1)[1].lstrip(), [], False, False
    for ch in text:
        if escaped:
            out.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "#" or (ch.isspace() and not quoted):
            break
        else:
            out.append(ch)
    return "".join(out)


def _stub(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f"#!{sys.executable}\nimport json, os, sys\n{body}")
    (folder / name).chmod(0o755)


def test_rendered_script_passes_odd_paths_as_data(tmp_path):
    """A run dir, repository and Python with blanks, quotes and $(...) in their names: the rendered
    script runs (stub srun/scontrol/python that record their argv) without running any of it, the
    trainer and the requeue check get the same run dir, and sbatch reads the log path whole."""
    marker = tmp_path / "INJECTED"
    run_dir = tmp_path / f"run $(touch {marker}) `touch {marker}` \"q\" 'q' #x"
    repo = tmp_path / "repo $(touch INJECTED)"
    repo.mkdir()
    record = tmp_path / "argv.jsonl"
    bin_dir = tmp_path / "bin"
    pybin = tmp_path / "py $(touch INJECTED)"
    log = f"open({str(record)!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
    _stub(pybin, "python", "if sys.argv[1] == '-c':\n    print(29500)\n    sys.exit(0)\n" + log)
    _stub(bin_dir, "scontrol", log + "print('n1')\n")
    _stub(
        bin_dir,
        "srun",
        log + "cmd = sys.argv[1:]\nwhile cmd[0].startswith('--'):\n    cmd.pop(0)\n"
        "os.execvpe(cmd[0], cmd, {**os.environ, 'SLURM_NODEID': '0'})\n",
    )
    job = submit.Job(
        nodes=1,
        gpus_per_node=0,
        cpus_per_node=2,
        config=tmp_path / "cfg $(touch INJECTED).yaml",
        run_dir=run_dir,
        overrides=["train.steps=3", "data.path=/d/$HOME/`x`"],
        time=None,
        partition=None,
        container=None,
        runtime=None,
        net_if=None,
        warn_seconds=120,
        max_attempts=3,
    )
    script = tmp_path / "train.sbatch"
    script.write_text(submit.render_sbatch(job, repo_dir=repo, python=str(pybin / "python")))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "n1",
    }
    out = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert not marker.exists() and not (repo / "INJECTED").exists() and not (tmp_path / "INJECTED").exists()
    assert out.returncode == 0, out.stdout + out.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    launch = next(c for c in calls if c[1:3] == ["-m", "trainer.launch"])
    requeue = next(c for c in calls if c[1:3] == ["-m", "trainer.requeue"])
    assert f"run_dir={run_dir}" in launch and launch.count(f"run_dir={run_dir}") == 1, launch
    assert requeue[requeue.index("--run-dir") + 1] == str(run_dir), requeue
    assert launch[launch.index("--config") + 1] == str(job.config)
    assert "data.path=/d/$HOME/`x`" in launch and "--node-rank=0" in launch, launch
    sbatch = dict(
        _sbatch_argument(line).partition("=")[::2]
        for line in script.read_text().splitlines()
        if line.startswith("#SBATCH")
    )
    assert sbatch["--output"] == f"{run_dir}/slurm/%j.out"
    assert sbatch["--job-name"] == f"train-{run_dir.name}"


# ---- `python -m trainer.submit --dry-run` against a stub cluster --------------------------------


@pytest.fixture
def stub_cluster(tmp_path, monkeypatch):
    """sinfo and scontrol on PATH that describe one partition `main` of CPU nodes (2 CPUs each)."""
    bin_dir = tmp_path / "stub-bin"
    _stub(bin_dir, "sinfo", "print('main*' if '%P' in sys.argv else 'n1 (null) 2\\nn2 (null) 2')\n")
    _stub(bin_dir, "scontrol", "print('PartitionName=main PreemptMode=OFF')\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path


def _dry_run(capsys, *args: str) -> tuple[int, str, str]:
    code = submit.main(["--dry-run", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _run_dir_of(script: str) -> str:
    """The run dir the dry run's trainer and requeue check get, which must be one."""
    script = script[script.index("#!/bin/bash") :]
    requeue = re.search(r"-m trainer\.requeue --run-dir (\S+)", script).group(1)
    given = re.findall(r"run_dir=(\S+)", script)
    assert given == [requeue], (given, requeue)
    return requeue


def test_dry_run_run_dir_from_run_dir_args_or_config_else_dated(stub_cluster, capsys, monkeypatch):
    """RUN_DIR, ARGS run_dir= or the config's run_dir names the run dir, so the same command again
    resumes the same run; only a config that names none gets a dated folder."""
    monkeypatch.chdir(REPO)
    config = stub_cluster / "named.yaml"
    named = stub_cluster / "named-run"
    config.write_text((REPO / "configs/default.yaml").read_text().replace("run_dir: runs/default", f"run_dir: {named}"))
    for _ in range(2):  # the same command twice: the same run
        code, out, err = _dry_run(capsys, "--config", str(config))
        assert code == 0, err
        assert _run_dir_of(out) == str(named) and re.search(rf"run dir +{re.escape(str(named))} ", out)
    other = stub_cluster / "from-args"
    code, out, err = _dry_run(capsys, "--config", str(config), "--", f"run_dir={other}", "train.steps=5")
    assert code == 0, err
    assert _run_dir_of(out) == str(other) and "train.steps=5" in out
    code, out, err = _dry_run(capsys, "--config", str(config), "--run-dir", str(named), "--", f"run_dir={other}")
    assert code == 2 and err == (
        f"submit: error: RUN_DIR={named} and ARGS run_dir={other} name different run directories; give one of them\n"
    )
    unnamed = stub_cluster / "unnamed.yaml"
    unnamed.write_text((REPO / "configs/default.yaml").read_text().replace("run_dir: runs/default\n", ""))
    code, out, err = _dry_run(capsys, "--config", str(unnamed))
    assert code == 0, err
    assert re.fullmatch(rf"{re.escape(str(REPO))}/runs/unnamed-\d{{8}}-\d{{6}}", _run_dir_of(out))


@pytest.mark.parametrize(
    "run_dir, launcher, message",
    [
        ("/shared/run\nrm -rf ~", "sbatch", "RUN_DIR='/shared/run\\nrm -rf ~': a control character ('\\n')"),
        ("/shared/100%x", "sbatch", "RUN_DIR='/shared/100%x': a '%', which Slurm's log file name"),
        ("/shared/a\\b", "sbatch", "RUN_DIR='/shared/a\\\\b': a backslash, which Slurm's log file name"),
        ("/shared/my run", "submitit", "RUN_DIR='/shared/my run': submitit writes it into #SBATCH lines"),
    ],
)
def test_a_run_dir_the_script_cannot_hold_is_one_line(stub_cluster, capsys, run_dir, launcher, message):
    code, out, err = _dry_run(capsys, "--run-dir", run_dir, "--launcher", launcher)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("submit: error: "), err
    assert message in err, err


def test_a_run_dir_that_would_split_the_container_mounts_is_one_line(stub_cluster, capsys):
    image = stub_cluster / "trainer.sif"
    image.write_text("")
    code, out, err = _dry_run(capsys, "--run-dir", "/shared/a,b", "--container", str(image))
    assert code == 2 and err == (
        "submit: error: RUN_DIR /shared/a,b: ',' and ':' separate the container's mounts "
        "(--container-mounts, --bind); choose a folder without them\n"
    ), err


def test_a_dry_run_plans_with_data_this_machine_cannot_see(stub_cluster, capsys, monkeypatch):
    """DRY_RUN=1 from a login node: a data file only the cluster has is a warning, not a refusal."""
    monkeypatch.chdir(REPO)
    code, out, err = _dry_run(
        capsys,
        "--config",
        str(REPO / "configs/default.yaml"),
        "--run-dir",
        str(stub_cluster / "r"),
        "--",
        "data.name=tokens",
        "data.path=/cluster/only/train.bin",
    )
    assert code == 0, err
    assert (
        "warning: override 'data.path=/cluster/only/train.bin': data.path: token file /cluster/only/train.bin "
        "does not exist" in out
    )
    code, out, err = (
        submit.main(
            [
                "--config",
                str(REPO / "configs/default.yaml"),
                "--run-dir",
                str(stub_cluster / "r"),
                "--",
                "data.name=tokens",
                "data.path=/cluster/only/train.bin",
            ]
        ),
        *capsys.readouterr(),
    )
    assert code == 2 and "data.path: token file /cluster/only/train.bin does not exist" in err  # a real submit refuses


def test_min_nodes_asks_slurm_for_a_node_range(stub_cluster, capsys, monkeypatch):
    """MIN_NODES=3 NODES=4: sbatch gets --nodes=3-4, the dry run says why and what the ranks are."""
    monkeypatch.chdir(REPO)
    code, out, err = _dry_run(
        capsys,
        "--nodes",
        "4",
        "--min-nodes",
        "3",
        "--run-dir",
        "/shared/runs/range",
        "--",
        "train.global_batch_size=12",
    )
    assert code == 0, err
    assert "#SBATCH --nodes=3-4\n" in out
    assert re.search(r"nodes +3-4 +\[MIN_NODES-NODES: Slurm starts it on as many as it can give", out), out
    assert re.search(r"ranks +4 \(4 x 1\), 3 on 3 nodes ", out), out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--nodes", "4", "--min-nodes", "3", "--", "train.global_batch_size=32"],
            "MIN_NODES=3 NODES=4: train.global_batch_size 32 cannot be shared by the ranks of 3 (3 ranks); node "
            "counts that work: 4; narrow the range, or use a train.global_batch_size every count divides, e.g. 12",
        ),
        (
            ["--nodes", "4", "--min-nodes", "2", "--", "train.global_batch_size=8", "train.micro_batch_size=2"],
            "MIN_NODES=2 NODES=4: train.global_batch_size 8 cannot be shared by the ranks of 3 (3 ranks) x "
            "train.micro_batch_size 2; node counts that work: 2, 4; narrow the range, or use a "
            "train.global_batch_size every count divides, e.g. 24",
        ),
        (
            ["--nodes", "2", "--min-nodes", "3"],
            "MIN_NODES=3 is more than NODES=2; the job runs on MIN_NODES..NODES nodes",
        ),
        (["--nodes", "2", "--min-nodes", "0"], "MIN_NODES='0': expected a whole number >= 1"),
    ],
)
def test_a_node_range_the_batch_cannot_divide_is_one_line(stub_cluster, capsys, monkeypatch, args, message):
    """Every node count of MIN_NODES..NODES must share train.global_batch_size: a job resumed on the
    nodes left keeps it. Refused before anything is submitted, naming the counts and what works."""
    monkeypatch.chdir(REPO)
    code, out, err = _dry_run(capsys, "--run-dir", "/shared/runs/range", *args)
    # A clone and venv on a node-local path (/tmp) are warned about first: those lines are other tests' business.
    lines = [
        line
        for line in err.splitlines()
        if not re.match(r"submit: warning: the (repository|Python environment) ", line)
    ]
    assert code == 2 and out == "" and lines == [f"submit: error: {message}"], err


# ---- what is written into the run dir's slurm/ (#32 item 3) ------------------------------------

_needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another uid: needs root")


def _local_job(run_dir: Path) -> submit.Job:
    return submit.Job(
        nodes=1,
        gpus_per_node=0,
        cpus_per_node=1,
        config=REPO / "configs" / "default.yaml",
        run_dir=run_dir,
        overrides=[],
        time="10",
        partition=None,
        container=None,
        runtime=None,
        net_if=None,
        warn_seconds=120,
        max_attempts=3,
    )


@pytest.fixture
def stub_sbatch(tmp_path, monkeypatch):
    """An sbatch on PATH that records its arguments and standard input, and accepts the job as 42."""
    record = tmp_path / "sbatch-calls"
    _stub(
        tmp_path / "sbatch-bin",
        "sbatch",
        f"open({str(record)!r}, 'a').write(json.dumps([sys.argv[1:], sys.stdin.read()]) + '\\n')\n"
        "print('42' if '--parsable' in sys.argv else 'Submitted batch job 42')\n",
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'sbatch-bin'}:{os.environ['PATH']}")
    return record


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_sbatch_gets_the_script_rendered_not_a_file_planted_in_the_run_dir(tmp_path, stub_sbatch, kind):
    """A FIFO or link planted at slurm/train.sbatch: the copy saved there replaces it (nothing is
    written through it), and sbatch reads the script from its standard input, never from the run dir."""
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    target = tmp_path / "victim-file"
    target.write_text("mine\n")
    planted = run_dir / "slurm" / "train.sbatch"
    os.mkfifo(planted) if kind == "fifo" else planted.symlink_to(target)
    job = _local_job(run_dir)
    assert submit.submit_sbatch(job) == "42"
    argv, stdin = json.loads(stub_sbatch.read_text())
    assert argv == ["--parsable"] and stdin == submit.render_sbatch(job)
    assert not planted.is_symlink() and planted.is_file() and planted.read_text() == stdin
    assert target.read_text() == "mine\n"


@pytest.mark.parametrize("kind", ["link", "fifo", "foreign"])
def test_a_planted_slurm_folder_is_refused_in_one_line(tmp_path, stub_sbatch, kind):
    """run_dir/slurm/ a link to elsewhere, a FIFO, or another user's folder: one line, nothing submitted."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if kind == "link":
        (run_dir / "slurm").symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(run_dir / "slurm")
    else:
        if os.geteuid() != 0:
            pytest.skip("gives a folder to another uid: needs root")
        (run_dir / "slurm").mkdir()
        os.chown(run_dir / "slurm", 12345, 12345)
    for launcher in (submit.submit_sbatch, submit.submit_submitit):
        with pytest.raises(submit.SubmitError) as e:
            launcher(_local_job(run_dir))
        assert str(e.value).startswith(f"{run_dir / 'slurm'} is ") and "\n" not in str(e.value), e.value
    assert not stub_sbatch.exists() and list(elsewhere.iterdir()) == []


def test_submitit_refuses_a_run_dir_others_can_write(tmp_path, stub_sbatch):
    """Another user who can write the run dir could rename slurm/ away and plant a pickle the nodes
    run: LAUNCHER=submitit needs a run dir (and folders above it) only the user can write."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o775)
    run_dir.chmod(0o775)
    with pytest.raises(submit.SubmitError) as e:
        submit.submit_submitit(_local_job(run_dir))
    assert str(e.value).startswith(f"LAUNCHER=submitit: {run_dir} (owner uid {os.geteuid()}, mode 775) lets another")
    assert not stub_sbatch.exists()


def test_submitit_folder_is_private_and_the_nodes_run_the_guard(tmp_path, stub_sbatch):
    """The submitit folder is 0700, its pickle 0600, and the nodes' command is the guard's."""
    run_dir = tmp_path / "run"
    job_id = submit.submit_submitit(_local_job(run_dir))
    assert job_id == "42"
    folder = run_dir / "slurm" / "submitit"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "42_submitted.pkl").stat().st_mode) == 0o600
    argv, _ = json.loads(stub_sbatch.read_text())
    script = Path(argv[-1]).read_text()
    assert f"-u -m trainer.submitit_guard -u -m submitit.core._submit {folder}" in script, script


class _Marker:
    """Unpickling it creates the file `path`: proof that a pickle was (or was not) unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _guard(folder: Path, monkeypatch) -> int:
    from trainer import submitit_guard

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return submitit_guard.main(["-u", "-m", "submitit.core._submit", str(folder)])


@pytest.mark.parametrize("attack", ["group-writable folder", "foreign pickle", "group-writable run dir", "link"])
def test_the_node_refuses_a_pickle_it_did_not_write_without_unpickling_it(tmp_path, monkeypatch, capsys, attack):
    import pickle

    run_dir = tmp_path / "run"
    folder = run_dir / "slurm" / "submitit"
    folder.mkdir(parents=True, mode=0o700)
    marker = tmp_path / "UNPICKLED"
    pickled = folder / "42_submitted.pkl"
    pickled.write_bytes(pickle.dumps(_Marker(str(marker))))
    pickled.chmod(0o600)
    if attack == "group-writable folder":
        folder.chmod(0o770)
    elif attack == "foreign pickle":
        if os.geteuid() != 0:
            pytest.skip("gives a file to another uid: needs root")
        os.chown(pickled, 12345, 12345)
    elif attack == "group-writable run dir":
        run_dir.chmod(0o775)
    else:
        pickled.rename(tmp_path / "elsewhere.pkl")
        pickled.symlink_to(tmp_path / "elsewhere.pkl")
    assert _guard(folder, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"submitit-guard: refusing to unpickle {pickled}: ") and err.count("\n") == 1, err
    assert not marker.exists()


def test_the_node_hands_a_pickle_of_the_users_over_to_submitit(tmp_path, monkeypatch):
    """The control: the same pickle, in order, is unpickled (so the refusals above are the guard's)."""
    import pickle

    folder = tmp_path / "run" / "slurm" / "submitit"
    folder.mkdir(parents=True, mode=0o700)
    marker = tmp_path / "UNPICKLED"
    (folder / "42_submitted.pkl").write_bytes(pickle.dumps(_Marker(str(marker))))
    (folder / "42_submitted.pkl").chmod(0o600)
    with pytest.raises(AssertionError):  # submitit's own check: not a DelayedSubmission
        _guard(folder, monkeypatch)
    assert marker.exists()
