"""After a Slurm job's training step ends: requeue it, unless it finished or stopped making progress.

    python3 -m trainer.requeue --run-dir D [--exit-code N] [--max-attempts-without-progress K]

Runs in the batch shell on the host after `srun` returns (slurm/train.sbatch.in), and in task 0
of a submitit job. In container jobs the host's python3 is often the system one with nothing
installed, so this module, like trainer/rundir/layout.py which it reads the run directory with, needs
only the standard library and Python 3.6 or later.
"""

import datetime
import os
import re
import signal
import subprocess
import sys
import time

from trainer import cli
from trainer.resilience import outcomes
from trainer.rundir import files, layout

# The training step's exit codes this check tells apart (trainer/resilience/outcomes.py says what each means and
# what follows; health.py, submit.py and the tests import them from here too).
BAD_INPUT = outcomes.BAD_INPUT.code
LEASE_LOST = outcomes.LEASE_LOST.code
HEALTH_FAILED = outcomes.HEALTH_FAILED.code
NODE_LOST = outcomes.NODE_LOST.code
# A node name as Slurm's hostnames are: one name, never a hostlist ('n[1-4]') or a list ('n1,n2').
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")


def cancelled(job_id):
    """Whether the job is ending for good: cancelled (scancel) or at its time limit.

    While such a job completes, Slurm (22.05) still shows JobState=COMPLETING, not CANCELLED; what
    tells it apart is an EndTime already passed with no PreemptTime. A preempted job has a
    PreemptTime, and a job warned before its time limit an EndTime still ahead: those are requeued."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job_id)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
    )
    fields = dict(re.findall(r"(\w+)=(\S*)", out.stdout))
    state = fields.get("JobState", "")
    if state.startswith(("CANCELLED", "TIMEOUT")):
        return True
    if state != "COMPLETING" or fields.get("PreemptTime", "None") != "None":
        return False
    try:
        end = datetime.datetime.strptime(fields.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return False
    return end <= datetime.datetime.now()


def requeued_by_slurm(job_id):
    """Whether Slurm requeues the job already: a node of it failed (NODE_FAIL, --requeue), and the
    controller ends this attempt and queues the next itself. A second requeue must not follow."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job_id)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
    )
    state = dict(re.findall(r"(\w+)=(\S*)", out.stdout)).get("JobState", "")
    return state.startswith(("NODE_FAIL", "REQUEUE", "PENDING"))


def requeue_check(run_dir, exit_code, max_attempts, job_id, max_excluded=0):
    """Requeue job_id unless training finished or stopped making progress; return an exit code.

    An attempt makes progress when it leaves a newer checkpoint than the previous attempt of the
    same job. After max_attempts attempts in a row without progress the job is not requeued and
    fails with a message, so that a broken run does not loop forever. `max_excluded` is the job's
    health.max_excluded, from its submission (never from the run dir, which others may write)."""
    run_dir = str(run_dir)
    latest = layout.latest_committed_step(run_dir)  # the trainer's own answer (layout.checkpoint_problem)
    # Finished is what the newest checkpoint proves: its step reached the train.steps it was saved
    # under. status.json's state is never read for it (anyone who can write the run dir can forge
    # "finished"); its steps only for a checkpoint whose meta.json does not say (an older trainer's).
    total = layout.steps_saved_for(run_dir, latest)
    if total is None:
        steps = layout.read_status(run_dir).get("steps")
        total = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    prefix = "requeue-check: job {}:".format(job_id)
    where = "newest checkpoint: step {}".format(latest) if latest is not None else "no checkpoint yet"
    # Not a duplicate of status.json's "finished" (which the trainer writes for an early stop too):
    # that file is never trusted here, and without this the stopped run is requeued (its checkpoint
    # is short of train.steps; test_early_stop's restart test then fails on the scontrol requeue).
    stopped = layout.early_stop_record(run_dir, latest)  # the newest checkpoint says the run stopped early
    if stopped and exit_code == 0:  # else (a start that trains on, killed before its first save) requeued
        print(
            "{} stopped early at step {} (train.early_stop_patience); not requeued: {}".format(
                prefix, stopped[0], run_dir
            ),
            flush=True,
        )
        return 0
    if latest is not None and total is not None and latest >= total:
        print("{} {}".format(prefix, outcomes.FINISHED.line.format(step=latest, run_dir=run_dir)), flush=True)
        return outcomes.FINISHED.code
    outcome = outcomes.by_code(exit_code)
    if outcome.requeue == outcomes.NOT_REQUEUED:  # bad input, a lost lease: the line above says what
        print("{} {}".format(prefix, outcome.line.format(where=where, run_dir=run_dir)), file=sys.stderr, flush=True)
        return outcome.code

    failed = health_records(run_dir, job_id, prefix)
    if failed:
        return requeue_without(run_dir, job_id, failed, prefix, max_excluded)

    state_file = os.path.join(run_dir, "slurm", "requeue.json")
    state = read_attempts(state_file, job_id, prefix)
    progressed = latest is not None and (state["step"] is None or latest > state["step"])
    attempts = 0 if progressed else state["attempts_without_progress"] + 1
    files.make_folder(os.path.dirname(state_file))
    files.write_json(state_file, {"job_id": job_id, "step": latest, "attempts_without_progress": attempts})

    if attempts >= max_attempts:
        print(
            "{} NOT requeued: {} attempts in a row saved no new checkpoint ({}, last exit code {}). Read "
            "the log above, fix the cause, then submit again with the same RUN_DIR to resume.".format(
                prefix, attempts, where, exit_code
            ),
            file=sys.stderr,
            flush=True,
        )
        return 1
    if cancelled(job_id):
        print("{} cancelled or at its time limit; not requeued ({})".format(prefix, where), flush=True)
        return 0
    if requeued_by_slurm(job_id):
        print("{} a node failed and Slurm requeues the job itself ({})".format(prefix, where), flush=True)
        return 0
    print("{} stopped at {} (exit code {}); requeueing".format(prefix, where, exit_code), flush=True)
    result = subprocess.run(
        ["scontrol", "requeue", str(job_id)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True
    )
    if result.returncode != 0 and "pending" in result.stderr:  # Slurm's NODE_FAIL requeue came first
        print("{} a node failed and Slurm requeued the job itself ({})".format(prefix, where), flush=True)
        return 0
    if result.returncode != 0:
        print("{} scontrol requeue failed: {}".format(prefix, result.stderr.strip()), file=sys.stderr, flush=True)
        return 1
    return 0


def _ignored(prefix, path, why):
    print("{} ignored {}: {}".format(prefix, path, why), file=sys.stderr, flush=True)


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_attempts(path, job_id, prefix):
    """requeue.json of this job ({job_id, step, attempts_without_progress}), or a fresh count: for
    another job's, a missing file, or one that is not what this check writes (said, naming it)."""
    fresh = {"job_id": job_id, "step": None, "attempts_without_progress": 0}
    try:
        state = files.read_json(path)
    except FileNotFoundError:
        return fresh
    except (OSError, ValueError) as e:
        _ignored(prefix, path, "unreadable ({}); counting attempts from 0".format(e))
        return fresh
    if not isinstance(state, dict) or state.get("job_id") != job_id:
        return fresh
    step, attempts = state.get("step"), state.get("attempts_without_progress")
    if not (step is None or (isinstance(step, int) and not isinstance(step, bool))) or not (
        isinstance(attempts, int) and not isinstance(attempts, bool) and attempts >= 0
    ):
        _ignored(prefix, path, "not a count of attempts as this check writes it; counting attempts from 0")
        return fresh
    return state


def record_problem(found, job_id):
    """Why `found` (a record's JSON) is not a health record of job_id's, or None."""
    if not isinstance(found, dict):
        return "not a JSON object"
    if found.get("job") != job_id:
        return "'job' is not {!r}".format(job_id)
    node = found.get("node")
    if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
        return "'node' is not a node name (letters, digits, '-', '_', '.'): {!r}".format(node)[:200]
    if not isinstance(found.get("reason", ""), str):
        return "'reason' is not text"
    if not _number(found.get("time", 0)):
        return "'time' is not a number"
    return None


def health_records(run_dir, job_id, prefix="requeue-check:"):
    """The health check's records of job_id's nodes that failed it (trainer/resilience/health.py), oldest first.

    Anyone who can write the run dir can write one: a record is read only from a regular file (no
    link, no FIFO, bounded), and one that is not exactly what trainer/resilience/health.py writes is ignored
    with a line naming it. What a record can do is limited to naming one node of the job."""
    folder = os.path.join(run_dir, *layout.HEALTH_RECORDS)
    try:
        if os.path.islink(folder):
            _ignored(prefix, folder, "is a symbolic link, not the health check's folder")
            return []
        names = sorted(n for n in os.listdir(folder) if n.startswith("{}.".format(job_id)) and n.endswith(".json"))
    except OSError:
        return []
    records = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            found = files.read_json(path, limit=1 << 20)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            _ignored(prefix, path, "unreadable ({})".format(e))
            continue
        why = record_problem(found, job_id)
        if why:
            _ignored(prefix, path, why)
            continue
        records.append(
            {"node": found["node"], "reason": found.get("reason", ""), "time": found.get("time", 0), "path": path}
        )
    return sorted(records, key=lambda r: r["time"])


def _scontrol(*args):
    return subprocess.run(
        ["scontrol"] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True
    )


def requeue_without(run_dir, job_id, failed, prefix, limit):
    """Requeue job_id with the nodes that failed the health check added to its excluded nodes (those
    excluded already are kept), unless that would exclude more than `limit` (the submission's
    health.max_excluded) nodes over the job's life; status.json lists every excluded node with the
    reason. Returns an exit code."""
    status = layout.read_status(run_dir)
    listed = status.get("excluded_nodes") if isinstance(status, dict) else None
    excluded = [
        e
        for e in (listed if isinstance(listed, list) else [])
        if isinstance(e, dict) and isinstance(e.get("node"), str) and NODE_NAME.fullmatch(e["node"])
    ]
    mine = [e["node"] for e in excluded if e.get("job") == job_id]
    new = [r for r in failed if r["node"] not in mine]
    names = ", ".join(r["node"] for r in new) or ", ".join(r["node"] for r in failed)
    for r in failed:
        try:
            os.remove(r["path"])  # read once: a later attempt's failure is a new record
        except FileNotFoundError:
            pass
    if cancelled(job_id):
        print("{} cancelled or at its time limit; not requeued".format(prefix), flush=True)
        return 0
    if len(mine) + len(new) > limit:
        print(
            "{} NOT requeued: node(s) {} failed the health check, and excluding them would make {} excluded "
            "node(s) over the job's life, more than health.max_excluded={} (excluded already: {}). See the "
            "'health:' lines above; repair the nodes or raise health.max_excluded, then submit again with "
            "the same RUN_DIR".format(prefix, names, len(mine) + len(new), limit, ", ".join(mine) or "none"),
            file=sys.stderr,
            flush=True,
        )
        return HEALTH_FAILED
    before = dict(re.findall(r"(\w+)=(\S*)", _scontrol("show", "job", "-o", str(job_id)).stdout)).get("ExcNodeList")
    exclude = ",".join([n for n in [before] if n and n != "(null)"] + [r["node"] for r in new])
    # The requeue ends this job's processes, this one among them (SIGTERM; SIGKILL after KillWait):
    # it must live on to set the excluded nodes, which Slurm takes only once the job is pending again.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    line = outcomes.HEALTH_FAILED.line.format(names=names, excluded=exclude, count=len(mine) + len(new), limit=limit)
    print("{} {}".format(prefix, line), flush=True)
    result = _scontrol("requeue", str(job_id))
    if result.returncode != 0:
        print("{} scontrol requeue failed: {}".format(prefix, result.stderr.strip()), file=sys.stderr, flush=True)
        return 1
    result = _scontrol("update", "jobid={}".format(job_id), "ExcNodeList={}".format(exclude))
    if result.returncode != 0:
        print(
            "{} could not exclude {}: scontrol update failed: {}".format(prefix, exclude, result.stderr.strip()),
            file=sys.stderr,
            flush=True,
        )
    now = time.time()
    added = [{"node": r["node"], "job": job_id, "reason": r.get("reason", ""), "time": now} for r in new]
    layout.write_status(run_dir, excluded_nodes=excluded + added)
    return 0


def main(argv=None):
    p = cli.parser("requeue", __doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--exit-code", type=int, default=0, help="exit code of the training step")
    p.add_argument("--max-attempts-without-progress", type=int, default=3)
    p.add_argument(
        "--max-excluded",
        type=int,
        default=0,
        help="the job's health.max_excluded (trainer.submit renders it); 0: a node failing its check is never excluded",
    )
    p.add_argument("--job-id", default=os.environ.get("SLURM_JOB_ID", ""))
    a = p.parse_args(argv)
    return requeue_check(a.run_dir, a.exit_code, a.max_attempts_without_progress, a.job_id, a.max_excluded)


if __name__ == "__main__":
    sys.exit(main())
