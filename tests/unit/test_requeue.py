"""The requeue check runs in the batch shell on the host: the system python3, standard library only,
Python 3.6 or later. Run here with this machine's system Python and no site-packages at all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.run import ROOT

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
HOST_MODULES = [
    "trainer/launchers/requeue.py",
    "trainer/resilience/outcomes.py",
    "trainer/rundir/layout.py",
    "trainer/rundir/files.py",
    "trainer/__init__.py",
    "trainer/cli.py",
    "trainer/version.py",
]


@pytest.fixture
def scontrol(tmp_path):
    """A stand-in for scontrol that records its calls (test_slurm_jobs.py runs the real cluster)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho JobState=RUNNING\n')
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir, calls


def requeue(run_dir: Path, exit_code: int, job: str, bin_dir: Path, *more: str) -> subprocess.CompletedProcess:
    # -S: no site-packages (so no PyYAML, nothing installed), -s: no user site, -E: no PYTHON* variables.
    cmd = [
        SYSTEM_PYTHON,
        "-S",
        "-s",
        "-E",
        "-m",
        "trainer.requeue",
        "--run-dir",
        str(run_dir),
        "--exit-code",
        str(exit_code),
        "--max-attempts-without-progress",
        "2",
        "--job-id",
        job,
        *more,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    )


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_requeue_check_with_the_standard_library_only(tmp_path, scontrol):
    bin_dir, calls = scontrol
    assert subprocess.run([SYSTEM_PYTHON, "-S", "-c", "import yaml"], capture_output=True).returncode != 0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps({"steps": 20, "state": "stopped"}))

    def save(step: int) -> None:
        ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / ".metadata").write_text("")
        (ckpt / "meta.json").write_text(
            json.dumps({"step": step, "samples": 0, "world_size": 1, "scheduler": {}, "shapes": {}})
        )

    assert requeue(run_dir, 1, "7", bin_dir).returncode == 0  # nothing saved yet: attempt 1 of 2
    save(5)
    assert requeue(run_dir, 0, "7", bin_dir).returncode == 0  # progress resets the count
    assert requeue(run_dir, 1, "7", bin_dir).returncode == 0  # attempt 1 without progress
    out = requeue(run_dir, 1, "7", bin_dir)  # attempt 2: gives up
    assert out.returncode == 1 and "NOT requeued: 2 attempts in a row saved no new checkpoint" in out.stderr
    assert calls.read_text().count("requeue 7") == 3
    out = requeue(run_dir, 2, "9", bin_dir)  # bad input: requeueing cannot help
    assert out.returncode == 2 and "stopped on bad input" in out.stderr
    out = requeue(run_dir, 3, "10", bin_dir)  # the run dir's lease was lost to another live run
    assert out.returncode == 3 and "NOT requeued: another run took over the run dir's lease" in out.stderr
    (run_dir / "checkpoints" / ".tmp_step_00000020").mkdir()  # a save in progress: not a checkpoint
    (run_dir / "checkpoints" / "step_00000015").mkdir()  # a step folder without its files: not either
    out = requeue(run_dir, 0, "8", bin_dir)
    assert "stopped at newest checkpoint: step 5" in out.stdout
    save(20)
    out = requeue(run_dir, 0, "8", bin_dir)
    assert out.returncode == 0 and "training finished at step 20" in out.stdout
    assert calls.read_text().count("requeue") == 4


def test_host_modules_run_on_python_3_6():
    """vermin reads the code and names the oldest Python that runs it (syntax and standard library)."""
    vermin = shutil.which("vermin", path=str(Path(os.sys.executable).parent))
    assert vermin, "vermin is in the test extras (pyproject.toml)"
    out = subprocess.run(
        [vermin, "--target=3.6-", "--no-tips", "--violations", "--eval-annotations", *HOST_MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_a_node_that_failed_the_health_check_is_excluded_up_to_max_excluded(tmp_path):
    """The failing node's launcher left a record (trainer/resilience/health.py): the job is requeued, then the
    node added to the job's ExcNodeList, keeping the node excluded already; status.json lists it.
    One node more than health.max_excluded over the job's life: not requeued, one line, exit 4."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\necho "JobId=7 JobState=RUNNING ExcNodeList=n1 NodeList=n[2-3]"\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    run_dir = tmp_path / "run"
    records = run_dir / "slurm" / "health"
    records.mkdir(parents=True)

    def failed(job: str, node: str) -> None:
        reason = f'health.command `test "$HEALTH_NODE" != {node}` exited 1 (no output)'
        record = {"job": job, "node": node, "reason": reason, "max_excluded": 2, "time": 1.0}
        (records / f"{job}.{node}.json").write_text(json.dumps(record))

    failed("7", "n3")
    failed("8", "n4")  # another job's: not this one's business
    out = requeue(
        run_dir, 143, "7", bin_dir, "--max-excluded", "2"
    )  # the other nodes were stopped by srun: any exit code
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "requeue-check: job 7: node(s) n3 failed the health check; requeueing without them (excluded: n1,n3; "
        "1 of health.max_excluded=2)"
    )
    assert calls.read_text().splitlines() == [
        "show job -o 7",  # cancelled?
        "show job -o 7",  # the nodes excluded already
        "requeue 7",
        "update jobid=7 ExcNodeList=n1,n3",  # pending again: Slurm takes it now
    ]
    status = json.loads((run_dir / "status.json").read_text())
    assert [(e["node"], e["job"], e["reason"]) for e in status["excluded_nodes"]] == [
        ("n3", "7", 'health.command `test "$HEALTH_NODE" != n3` exited 1 (no output)')
    ]
    assert sorted(p.name for p in records.iterdir()) == ["8.n4.json"]  # each record is read once
    assert not (run_dir / "slurm" / "requeue.json").exists()  # not an attempt without progress

    failed("7", "n2")
    assert requeue(run_dir, 4, "7", bin_dir, "--max-excluded", "2").returncode == 0  # 2 of 2
    failed("7", "n4")
    calls.write_text("")
    out = requeue(run_dir, 4, "7", bin_dir, "--max-excluded", "2")
    assert out.returncode == 4 and out.stdout == ""
    assert out.stderr.strip() == (
        "requeue-check: job 7: NOT requeued: node(s) n4 failed the health check, and excluding them would make 3 "
        "excluded node(s) over the job's life, more than health.max_excluded=2 (excluded already: n3, n2). See the "
        "'health:' lines above; repair the nodes or raise health.max_excluded, then submit again with the same "
        "RUN_DIR"
    )
    assert "requeue" not in calls.read_text()
    assert [e["node"] for e in json.loads((run_dir / "status.json").read_text())["excluded_nodes"]] == ["n3", "n2"]


def test_a_job_slurm_requeues_for_a_failed_node_is_not_requeued_twice(tmp_path):
    """A node died: Slurm ends the attempt as NODE_FAIL and queues the next itself (--requeue); the
    batch shell's check, if it still runs, says so and asks for no second requeue."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho JobState=NODE_FAIL Restarts=0\n')
    (bin_dir / "scontrol").chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps({"steps": 20, "state": "running"}))
    out = requeue(run_dir, 5, "7", bin_dir)  # the launchers ended on a lost node
    assert out.returncode == 0 and out.stdout == (
        "requeue-check: job 7: a node failed and Slurm requeues the job itself (no checkpoint yet)\n"
    ), out.stdout + out.stderr
    assert "requeue 7" not in calls.read_text()


def _forged_cluster(tmp_path: Path) -> tuple[Path, Path, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "JobId=7 JobState=RUNNING"\n')
    (bin_dir / "scontrol").chmod(0o755)
    calls.write_text("")
    records = tmp_path / "run" / "slurm" / "health"
    records.mkdir(parents=True)
    return bin_dir, calls, records


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_a_forged_health_record_excludes_nothing(tmp_path):
    """#32 item 7: anyone who can write the run dir can write a record. Its max_excluded is not
    believed (the job's own submission gives it: --max-excluded), and a node list ('n[1-4]', 'n1,n2')
    is not a node name: the record is ignored with one line naming it, and no node is excluded."""
    bin_dir, calls, records = _forged_cluster(tmp_path)
    forged = records / "7.x.json"
    forged.write_text(json.dumps({"job": "7", "node": "n[1-4]", "max_excluded": 99, "time": 1.0}))
    out = requeue(tmp_path / "run", 4, "7", bin_dir, "--max-excluded", "2")
    assert "ExcNodeList" not in calls.read_text(), calls.read_text()
    assert f"ignored {forged}: 'node' is not a node name" in out.stderr, out.stderr
    plain = records / "7.n5.json"  # a plain name, but more nodes than the submission allows: 0
    plain.write_text(json.dumps({"job": "7", "node": "n5", "max_excluded": 99, "time": 1.0}))
    out = requeue(tmp_path / "run", 4, "7", bin_dir)  # no --max-excluded (a script rendered before it): 0
    assert out.returncode == 4 and "more than health.max_excluded=0" in out.stderr, out.stderr
    assert "ExcNodeList" not in calls.read_text()


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
@pytest.mark.parametrize(
    "record",
    [
        {"job": "7", "node": 5, "time": 1.0},
        {"job": "7", "node": "n1", "time": "soon"},
        {"job": "7", "node": "n1", "reason": ["x"], "time": 1.0},
        ["7", "n1"],
    ],
)
def test_a_record_of_the_wrong_types_is_ignored_naming_it(tmp_path, record):
    """#32 item 7: wrong value types in a record, requeue.json or status.json crashed the check."""
    bin_dir, calls, records = _forged_cluster(tmp_path)
    (records / "7.n1.json").write_text(json.dumps(record))
    (records.parent / "requeue.json").write_text(
        json.dumps({"job_id": "7", "step": "x", "attempts_without_progress": []})
    )
    (records.parent.parent / "status.json").write_text(json.dumps({"excluded_nodes": [{"job": "7"}, 3]}))
    out = requeue(tmp_path / "run", 4, "7", bin_dir, "--max-excluded", "2")
    assert "Traceback" not in out.stderr, out.stderr
    assert f"ignored {records / '7.n1.json'}" in out.stderr
    assert "ExcNodeList" not in calls.read_text()
    assert out.returncode == 0 and "requeue 7" in calls.read_text()  # an attempt as any other


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_records_and_requeue_json_are_never_followed_or_blocked_on(tmp_path):
    """A link or FIFO planted at a record or at slurm/requeue.json: nothing read through it, no hang."""
    bin_dir, calls, records = _forged_cluster(tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"job": "7", "node": "n1", "time": 1.0}))
    (records / "7.n1.json").symlink_to(secret)
    os.mkfifo(records / "7.n2.json")
    (records.parent / "requeue.json").symlink_to(secret)
    out = requeue(tmp_path / "run", 4, "7", bin_dir, "--max-excluded", "2")
    assert "ExcNodeList" not in calls.read_text(), out.stdout + out.stderr
    assert f"ignored {records / '7.n1.json'}" in out.stderr and f"ignored {records / '7.n2.json'}" in out.stderr
    assert secret.is_file() and json.loads(secret.read_text())["node"] == "n1"  # never written through
    assert not (records.parent / "requeue.json").is_symlink()


def _committed(run_dir: Path, step: int, meta: dict) -> Path:
    """A step folder with the files a commit leaves (trainer/rundir/layout.py files_problem)."""
    from trainer.rundir import layout

    folder = Path(layout.step_path(run_dir, step))
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"x")
    (folder / "meta.json").write_text(
        json.dumps({"samples": 0, "world_size": 1, "scheduler": {}, "shapes": {}, **meta})
    )
    return folder


def test_the_standard_library_listing_skips_a_copy_under_another_step_or_another_runs_checkpoint(tmp_path):
    """What the launcher's 'nothing to do' and the requeue check read (layout.latest_committed_step)
    took a copy of step 2 planted as step_00000009, or another run's checkpoint, for the run's
    newest: a finished-looking run that never ran its steps. It now asks what trainer/checkpoint/manager.py
    asks: meta.json's step is the folder's, and its run id (where both have one) is this run's."""
    from trainer.rundir import layout

    run = tmp_path / "run"
    _with_manifest(run, 2, "a" * 32, 20)
    (run / "run_id").write_text("a" * 32 + "\n")
    _with_manifest(run, 9, "a" * 32, 20, step=2)  # a copy under a higher step
    _with_manifest(run, 11, "b" * 32, 20)  # another run's
    assert layout.latest_committed_step(run) == 2
    _committed(run, 12, {"step": 12})  # saved before run ids: its step alone is checked
    assert layout.latest_committed_step(run) == 12


def _with_manifest(run_dir: Path, number: int, run_id: str, steps: int, **meta) -> Path:
    """Step folder `number` as a commit leaves it, its manifest listing each file's size (the checksums are
    trainer/checkpoint/checksums.py's to check), saved under train.steps=`steps`; `meta`: more of meta.json."""
    meta = {
        "step": number,
        "run_id": run_id,
        "manifest": "manifest.json",
        "config": {"train": {"steps": steps}},
        **meta,
    }
    folder = _committed(run_dir, number, meta)
    (folder / "__0_0.distcp").write_bytes(b"w" * 64)
    listed = {p.name: {"size": p.stat().st_size, "xxh3_64": 0} for p in folder.iterdir()}
    (folder / "manifest.json").write_text(json.dumps({"files": listed, "xxh3_64": 0, "run_id": run_id}))
    return folder


def _forged_step_9(run: Path, good: Path) -> Path:
    """Issue 41 item 5: step 4 copied as step_00000009, meta.json's step set to 9, manifest.json a
    link to /dev/zero."""
    forged = run / "checkpoints" / "step_00000009"
    shutil.copytree(good, forged)
    meta = json.loads((forged / "meta.json").read_text())
    (forged / "meta.json").write_text(json.dumps({**meta, "step": 9}))
    (forged / "manifest.json").unlink()
    (forged / "manifest.json").symlink_to("/dev/zero")
    return forged


def test_one_answer_to_which_checkpoint_is_the_newest_good_one(tmp_path):
    """Issue 41 item 5: the launcher's and the requeue check's listing took the forged step 9 (its
    manifest never read) for the newest: 'nothing to do: step 9 reached train.steps=6'. Now the
    listing they share with the trainer (layout.checkpoint_problem) checks the manifest: a regular
    file that parses, listing files that are there, as regular files, at their sizes."""
    from trainer.checkpoint import manager
    from trainer.rundir import layout

    run = tmp_path / "run"
    ours = "a" * 32
    (run / "checkpoints").mkdir(parents=True)
    (run / "run_id").write_text(ours + "\n")
    good = _with_manifest(run, 4, ours, 6)
    forged = _forged_step_9(run, good)
    assert layout.latest_committed_step(run) == 4
    assert layout.checkpoint_problem(str(forged), 9, ours) == (
        "manifest.json is a symbolic link; the project never follows one here"
    )
    (forged / "manifest.json").unlink()
    shutil.copy(good / "manifest.json", forged / "manifest.json")  # the real manifest: meta.json's size differs
    (forged / "meta.json").write_text(json.dumps({**json.loads((good / "meta.json").read_text()), "step": 9}, indent=1))
    assert layout.checkpoint_problem(str(forged), 9, ours).startswith("meta.json is damaged: ")
    shard = forged / "__0_0.distcp"
    shard.unlink()
    os.mkfifo(shard)
    assert layout.checkpoint_problem(str(forged), 9, ours).startswith("__0_0.distcp is a FIFO, not a regular file")
    assert layout.latest_committed_step(run) == 4
    # The trainer's listing gives the same answer, with its own checks after.
    assert [step for step, _ in manager.complete(str(run))] == []  # step 4's checksums (0) are not its files'
    assert manager.complete.__doc__ and layout.checkpoint_problem(str(good), 4, ours) is None


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_a_forged_checkpoint_or_status_never_stops_the_requeues(tmp_path, scontrol):
    """Issue 41 item 5: the forged step 9, or a status.json saying 'finished', made the requeue
    check stop requeueing a run whose newest checkpoint is step 4 of 6. Finished is what the newest
    good checkpoint proves: its step reached the train.steps it was saved under."""
    bin_dir, calls = scontrol
    run = tmp_path / "run"
    ours = "a" * 32
    (run / "checkpoints").mkdir(parents=True)
    (run / "run_id").write_text(ours + "\n")
    good = _with_manifest(run, 4, ours, 6)
    _forged_step_9(run, good)
    (run / "status.json").write_text(json.dumps({"steps": 6, "state": "finished", "step": 9}))
    out = requeue(run, 0, "7", bin_dir)
    assert out.returncode == 0 and "stopped at newest checkpoint: step 4 (exit code 0); requeueing" in out.stdout, (
        out.stdout + out.stderr
    )
    assert calls.read_text().count("requeue 7") == 1
    _with_manifest(run, 6, ours, 6)
    (run / "status.json").write_text(json.dumps({"steps": 60, "state": "running"}))  # forged the other way
    out = requeue(run, 0, "7", bin_dir)
    assert out.returncode == 0 and "training finished at step 6" in out.stdout, out.stdout + out.stderr
    assert calls.read_text().count("requeue 7") == 1
