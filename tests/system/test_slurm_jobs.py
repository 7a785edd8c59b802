"""Jobs on the real local cluster (make slurm-up) that run as asked: make submit and its dry run,
refusals before anything is submitted, and a run dir one node cannot see.

The cluster looks like a GPU cluster (slurm/local/up.sh): the submit host (this machine) has no
GPU, each node declares 2 GPUs through gres, and has its own node-local disk at /nodelocal.
The cluster tests are skipped with one line when the cluster is not up (tests/helpers/slurm.py:
cluster). Every job is tiny: the default config's tiny transformer, a few dozen steps. Run directories
live under runs/ (a path every node sees), or under ~/.cache when the repository itself sits on a
node-local path such as /tmp, which multi-node submissions rightly refuse (the `runs` fixture,
tests/conftest.py). What goes wrong in a job (node death, preemption, requeues):
tests/system/test_slurm_failures.py; what is rendered without a cluster: tests/unit/test_slurm_submit.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.outputs import metrics
from tests.helpers.run import ROOT as REPO
from tests.helpers.slurm import COMMON, cluster, log_text, make_submit, submit_job, wait_job
from trainer.rundir import layout


def on_node(node: str, *cmd: str) -> subprocess.CompletedProcess:
    """Run cmd in an emulated node's mount namespace (it sees that node's /nodelocal)."""
    pid = Path(f"/run/slurm-local/slurmd-{node}.pid").read_text().strip()
    return subprocess.run(["nsenter", "-t", pid, "-m", "--", *cmd], capture_output=True, text=True)


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
