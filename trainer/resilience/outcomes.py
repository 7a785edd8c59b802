"""What a failure is and what follows from it, in one table: exception -> exit code -> restart in the
allocation or not -> requeue or not -> the one line said.

A rank ends with an exception (trainer/__main__.py asks `of_exception` which outcome it is: the exit
code, and a mark that tells its launcher not to restart it); the launcher (trainer/launchers/torchrun.py) turns its
ranks' ends into its own exit code (`of_rank_codes`), restarting them in the allocation only where the
row says so; under Slurm the requeue check (trainer/launchers/requeue.py) reads that exit code (`by_code`) and
requeues the job or not. Each of the three reads this table; none defines an exit code of its own.

The requeue check runs on login nodes' and batch hosts' Python 3.6 with the standard library only:
so does this module (tests/{unit,system}/test_requeue.py, HOST_MODULES).
"""

import collections
import os

# What the requeue check (trainer/launchers/requeue.py) does after a training step that ended with this outcome
# and did not finish training (status.json says that, whatever the exit code).
REQUEUED = "requeued"  # while attempts leave newer checkpoints (--max-attempts-without-progress)
NOT_REQUEUED = "not requeued"  # the check says the row's line and exits with the row's code
WITHOUT_NODES = "requeued without the failed nodes"  # their health records name them; none: as REQUEUED
BY_SLURM = "requeued by Slurm"  # NODE_FAIL with --requeue; the check sees it and does not requeue again

Outcome = collections.namedtuple("Outcome", "name code restart requeue mark every_rank line")
Outcome.__doc__ = """One way a training step ends.

name: a few words, as said where it matters ("bad input").
code: the launcher's exit code; None for SIGNALLED, 128 + the signal's number (as a shell says it).
restart: whether the launcher restarts every rank of its node in the allocation (launch.max_restarts).
requeue: what the requeue check does: REQUEUED, NOT_REQUEUED, WITHOUT_NODES or BY_SLURM.
mark: the file a rank leaves in the launcher's marks folder (trainer/launchers/torchrun.py MARKS_ENV) before it
    exits, so that its launcher does not restart it (and, for bad input, still exits 2 when srun
    signals it meanwhile); None where the launcher decides alone.
every_rank: whether every rank says its error (the one at fault may not be rank 0), else rank 0 only.
line: the one line said of it (str.format with the named fields), by whoever knows what follows: the
    requeue check for what it decides alone, else the launcher, or the rank (RANK_ERROR) where the
    launcher has nothing to add."""

# What a rank says of an exception it stops on (trainer/__main__.py): the exception's own words.
RANK_ERROR = "error: {message}"

FINISHED = Outcome(
    name="finished",
    code=0,
    restart=False,
    requeue=NOT_REQUEUED,
    mark=None,
    every_rank=False,
    line="training finished at step {step}; {run_dir}",
)  # the requeue check's line: it tells FINISHED from STOPPED by status.json, not by the exit code
STOPPED = Outcome(
    name="stopped",
    code=0,
    restart=False,
    requeue=REQUEUED,
    mark=None,
    every_rank=False,
    line="stopped by {signal} after step {step}; the checkpoint is saved, a restart resumes there",
)
STOPPED_BEFORE_TRAINING = Outcome(
    name="stopped before training",
    code=0,
    restart=False,
    requeue=REQUEUED,
    mark=None,
    every_rank=False,
    line="received {signal} before training started; nothing to save",
)
SIGNALLED = Outcome(
    name="signalled",
    code=None,
    restart=False,
    requeue=REQUEUED,
    mark=None,
    every_rank=False,
    line="stopped by {signal}; no checkpoint was saved by this start (ranks get {shutdown_s} s after the signal)",
)
# srun stopped this node because another node of the job failed its health check: exit code
# 128 + the signal's number (signal_code), or 0 when the signal came before training started.
STOPPED_FOR_HEALTH = Outcome(
    name="stopped for another node's health",
    code=None,
    restart=False,
    requeue=REQUEUED,
    mark=None,
    every_rank=False,
    line="{node}: stopped by {signal}: {which} of this job failed the health check (said above); nothing to save",
)
FAILED = Outcome(
    name="failed", code=1, restart=True, requeue=REQUEUED, mark=None, every_rank=False, line="rank {rank} {cause}"
)
# A rank that stopped answering (trainer/train.py, trainer/resilience/hangs.py), said by every rank that saw it:
# the stuck one may be rank 0.
STUCK_RANK = Outcome(
    name="a stuck rank", code=1, restart=True, requeue=REQUEUED, mark=None, every_rank=True, line=RANK_ERROR
)
PEER_GONE = Outcome(
    name="a peer went away",
    code=1,
    restart=True,
    requeue=REQUEUED,
    mark=None,
    every_rank=True,
    line="error: rank {rank} on {node}: a peer went away during a collective ({gone}); the launcher says which rank "
    "or node failed first",
)
DIVERGED = Outcome(
    name="divergence", code=1, restart=False, requeue=REQUEUED, mark="diverged", every_rank=False, line=RANK_ERROR
)  # it would diverge again
TORCHRUN_FAILED = Outcome(
    name="torchrun failed",
    code=1,
    restart=False,
    requeue=REQUEUED,
    mark=None,
    every_rank=False,
    line="torchrun failed: {kind}: {first_line}",
)
# The rank said what is wrong in one line; neither a restart nor a requeue can help.
BAD_INPUT = Outcome(
    name="bad input",
    code=2,
    restart=False,
    requeue=NOT_REQUEUED,
    mark="bad-input",
    every_rank=False,
    line="NOT requeued: the training step stopped on bad input (exit code 2, the line above says what); fix it and "
    "submit again with the same RUN_DIR ({where})",
)
# Another run took over the run dir (trainer/rundir/lease.py) and goes on in it: a requeued attempt would be
# refused, or worse, start over its checkpoints.
LEASE_LOST = Outcome(
    name="a lost lease",
    code=3,
    restart=False,
    requeue=NOT_REQUEUED,
    mark="lease-lost",
    every_rank=False,
    line="NOT requeued: another run took over the run dir's lease (exit code 3, the line above says which); two runs "
    "must not share a RUN_DIR ({run_dir})",
)
# A node failed its health check (trainer/resilience/health.py; its launcher leaves a record the requeue check
# reads), or the all-reduce was below its floor (no record: requeued as any failure).
HEALTH_FAILED = Outcome(
    name="a failed health check",
    code=4,
    restart=False,
    requeue=WITHOUT_NODES,
    mark="health",
    every_rank=False,
    line="node(s) {names} failed the health check; requeueing without them (excluded: {excluded}; {count} of "
    "health.max_excluded={limit})",
)
# A node stopped answering (trainer/resilience/heartbeat.py): Slurm requeues the job itself (NODE_FAIL).
NODE_LOST = Outcome(
    name="a lost node",
    code=5,
    restart=False,
    requeue=BY_SLURM,
    mark=None,
    every_rank=False,
    line="{node}: {what} (no heartbeat for {silent_s:.0f} s); {after}",
)

# Every outcome, in the order of their exit codes. A code that two rows share means one requeue
# decision (the requeue check sees only the code), FINISHED apart.
OUTCOMES = (
    FINISHED,
    STOPPED,
    STOPPED_BEFORE_TRAINING,
    FAILED,
    STUCK_RANK,
    PEER_GONE,
    DIVERGED,
    TORCHRUN_FAILED,
    BAD_INPUT,
    LEASE_LOST,
    HEALTH_FAILED,
    NODE_LOST,
    SIGNALLED,
    STOPPED_FOR_HEALTH,
)

# The exceptions the trainer raises on purpose in a rank, (module, class name): their outcome in
# `python -m trainer`. By name, as this module imports nothing that needs torch; tests/unit/test_outcomes.py
# imports each. A peer that went away is a RuntimeError only torch's words tell (trainer.dist.peer_gone).
RAISED = {
    ("trainer.config", "ConfigError"): BAD_INPUT,
    ("trainer.checkpoint.manager", "CheckpointError"): BAD_INPUT,
    ("trainer.data", "DataError"): BAD_INPUT,
    ("trainer.dist", "NodeError"): BAD_INPUT,
    ("trainer.rundir.lease", "LeaseError"): BAD_INPUT,
    # A link, FIFO or device put where the run keeps a file, met while it runs (a neighbour's, issue 41):
    # its own words name the file; a restart would refuse it at the start all the same.
    ("trainer.rundir.files", "UnsafeFile"): BAD_INPUT,
    ("trainer.models", "FamilyError"): BAD_INPUT,  # model.family names no usable module (on this node)
    ("trainer.rundir.lease", "LeaseLost"): LEASE_LOST,
    # An s3:// run dir's store failed while the run started or saved (trainer/rundir/objects.py): its
    # line names the cause; bad credentials or a missing bucket are refused earlier, as bad input.
    ("trainer.rundir.objects", "StoreError"): FAILED,
    ("trainer.resilience.health", "HealthError"): HEALTH_FAILED,
    ("trainer.train", "Diverged"): DIVERGED,
    ("trainer.train", "StuckRank"): STUCK_RANK,
}

# The outcomes a launcher passes on as its own when its failed ranks all exited with that code.
PASSED_ON = (BAD_INPUT, LEASE_LOST, HEALTH_FAILED)


def of_exception(error):
    """The outcome of `error`, raised in a rank, or None for one the trainer does not raise on
    purpose (its traceback says where)."""
    for cls in type(error).__mro__:
        found = RAISED.get((cls.__module__, cls.__name__))
        if found is not None:
            return found
    return None


def of_rank_codes(codes):
    """The outcome a launcher exits with when its failed ranks exited with `codes` (negative: killed by
    that signal, as torchrun says it), when that is one of PASSED_ON; else None."""
    for outcome in PASSED_ON:
        if outcome.code in codes and all(c == outcome.code or c < 0 for c in codes):
            return outcome
    return None


def by_code(code):
    """The outcome the requeue check reads from a training step's exit code: the row with that code
    (FINISHED apart: status.json tells it), or FAILED for any other (a kill from outside: 137)."""
    for outcome in OUTCOMES:
        if outcome.code == code and outcome is not FINISHED:
            return outcome
    return FAILED


def signal_code(signum):
    """The exit code of SIGNALLED and STOPPED_FOR_HEALTH: 128 + the signal's number, as a shell says it."""
    return 128 + int(signum)


def marked(folder):
    """The outcome a rank marked in the launcher's marks `folder` (see Outcome.mark), or None."""
    for outcome in OUTCOMES:
        if outcome.mark and os.path.exists(os.path.join(folder, outcome.mark)):
            return outcome
    return None
