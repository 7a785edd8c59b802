"""The one way training starts: validate, then torchrun in this process, then one line and an exit code.

    python -m trainer.launch [--nproc-per-node N] [--grace-seconds S]
                             [--nnodes K --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID
                              [--local-addr ADDR]]
                             --config configs/X.yaml [key=value ...]

`make run`, compose, the sbatch script, the submitit task and the pods of a Kubernetes job
(trainer/launchers/k8s.py) all start training through this. It

* checks the config and this node's devices and memory before anything starts (the preflight,
  trainer/preflight/startup.py), so bad input is one line, and tells its ranks what it checked on
  their command line (--memory-checked: they do not trace the model on the meta device again;
  --weights-checked: they read model.init_from's config.json alone, not every safetensors header);
* checks this node's health (trainer/resilience/health.py: its GPUs, the run dir's write speed, the site's
  health.command), in one line; a failing node exits 4 and, under Slurm, is excluded at the requeue;
* says which device the ranks will use: NCCL + cuda where torch sees GPUs, else gloo + CPU, and
  says so explicitly when Slurm assigned GPUs that torch cannot use;
* runs torchrun's agent in this process (one rank per process it starts), with the stop signals
  forwarded to every rank and a shutdown budget derived from the grace time (signals.shutdown_budget):
  under Slurm this process is the job step's task, the process a proctrack/cgroup site signals;
* restarts every rank of this node from the newest checkpoint when one of them fails (killed,
  crashed), up to `launch.max_restarts` times, without going back to the queue: torchrun's own
  restarts, each said in one line and a metrics.jsonl row. Bad input, divergence and stop signals
  never restart;
* on a pod of a Kubernetes job, takes the rendezvous from what its operator set (Kubeflow Trainer's
  PET_* variables, a JobSet's JOB_COMPLETION_INDEX: apply_rendezvous) where the command line gives none,
  and exits as a SIGTERM'd process when it stopped cleanly before the run finished (operator_exit);
* maps the outcome to exit codes, as trainer/resilience/outcomes.py's table says: 0 finished or stopped cleanly
  (the checkpoint is saved), 2 bad input (the rank's one line is above), 3 the run dir's lease was
  lost to another run (not requeued), 4 a failed health check (trainer/resilience/health.py: this node's, or
  the all-reduce's), 5 a node stopped answering, anything else a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time

from trainer import cli, torch_compat
from trainer.resilience import hangs, heartbeat, outcomes, signals
from trainer.rundir import files, layout, objects

# A signal before torchrun's agent takes over (imports, validation, rendezvous) ends the launch
# cleanly instead of killing it: remembered here (main() listens first thing), acted on once the
# agent can forward it.
_early: list[int] = []


def _remember(signum, frame) -> None:
    _early.append(signum)


def node_name() -> str:
    from trainer.dist import node_name  # imports torch: not before main() listens for signals

    return node_name()


# The job's --nodes as Slurm was asked (4, or a range 3-4): set by the batch script and the submitit
# task, said when a node dies.
NODES_ENV = "TRAINER_SLURM_NODES"
# The rendezvous round of the ranks' start, the same on every node (set for the ranks by the agent).
ROUND_ENV = "TRAINER_RDZV_ROUND"
# A rank that stops on an outcome that is not restarted (bad input, divergence, a lost lease, a failed
# health check: trainer/resilience/outcomes.py, Outcome.mark) marks it in this node-local folder (named by the
# launcher) before it exits. Under Slurm, `srun --kill-on-bad-exit=1` terminates every node's task
# as soon as the first one exits: a launcher whose own ranks stopped on the same input may be
# signalled before it has seen their exit codes, and must still exit 2 (not 143), or the requeue
# check requeues bad input.
MARKS_ENV = signals.MARKS_ENV


def mark(name: str) -> None:
    """Called by a rank that is about to exit on an outcome with a mark (trainer/__main__.py)."""
    folder = os.environ.get(MARKS_ENV)
    if folder:
        with files.open_append(os.path.join(folder, name)):
            pass


# torchrun's own default when nothing is said (and the only value before torch 2.12).
TORCHRUN_DEFAULT_SHUTDOWN_S = 30


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("train", __doc__.split("\n\n")[0])
    p.add_argument(
        "--nproc-per-node",
        default=None,
        help="ranks on this node: a number, or auto (one per visible GPU, else 1); default: Kubeflow Trainer's "
        "PET_NPROC_PER_NODE, else auto",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="nodes of the job (more than 1 needs the rdzv options); default: what a Kubernetes operator set "
        "(operator_rendezvous), else 1",
    )
    p.add_argument("--node-rank", type=int, default=None, help="this node's index, 0..nnodes-1")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous on the first node")
    p.add_argument("--rdzv-id", default="", help="an id shared by the nodes of one job (the Slurm job id)")
    p.add_argument("--local-addr", default="", help="this node's address for the rendezvous (multi-homed nodes)")
    p.add_argument(
        "--grace-seconds",
        type=int,
        default=signals.DEFAULT_GRACE_S,
        help="seconds between a stop signal and the hard kill; the ranks get this minus "
        f"{signals.EXIT_MARGIN_S} s to save",
    )
    p.add_argument("--config", required=True, help="YAML config file (see configs/)")
    p.add_argument(
        "--config-default",
        action="store_true",
        help="the --config file is a default the user did not choose (make run without CONFIG=): a resumed "
        "run's differences from it are not worth a line",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100")
    return p


def _say(message: str) -> None:
    print(f"launch: {message}", file=sys.stderr, flush=True)


def device_line(nproc: int) -> str:
    """Which device the ranks of this node use, and why."""
    import torch

    host = node_name()
    if torch.cuda.is_available():  # counted without a CUDA context: the launcher must not hold GPU memory
        return f"{host}: {nproc} rank(s) on {torch.cuda.device_count()} GPU(s), NCCL"
    assigned = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if assigned:
        return (
            f"{host}: {nproc} rank(s) on the CPU with gloo: GPUs {assigned} are assigned "
            f"(CUDA_VISIBLE_DEVICES) but torch {torch.__version__} finds no usable CUDA device "
            f"(no driver, or a CPU build of torch)"
        )
    return f"{host}: {nproc} rank(s) on the CPU with gloo (no GPU visible)"


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (Linux), e.g. ib0 -> 10.1.2.3."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        except OSError as e:
            raise OSError(
                f"network interface {name!r} (GLOO_SOCKET_IFNAME) has no IPv4 address on this node: {e.strerror}"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def _threads_per_rank(nproc: int) -> str:
    """OMP_NUM_THREADS for each rank: this task's CPUs shared out (torchrun would say 1)."""
    return str(max(1, len(os.sched_getaffinity(0)) // nproc))


def torchrun_args(
    a: argparse.Namespace,
    nproc: int,
    shutdown_s: int,
    max_restarts: int = 0,
    memory_checked: bool = False,
    weights_checked: bool = False,
) -> list[str]:
    """torchrun's command line for this node's ranks; `memory_checked`: the preflight checked this
    node's memory for them (trainer/preflight/startup.py), `weights_checked`: it read model.init_from's
    weights, both of which they are told on their command line."""
    args = [
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        f"--signals-to-handle={signals.TORCHRUN_SIGNALS}",
        f"--shutdown-timeout={shutdown_s}",
    ]
    if a.nnodes == 1 and not a.rdzv_endpoint:
        args.append("--standalone")
    else:
        args += [
            f"--nnodes={a.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={a.rdzv_endpoint}",
            f"--rdzv-id={a.rdzv_id or 'fsdp-trainer'}",
        ]
        if getattr(a, "rdzv_conf", ""):  # set by operator_rendezvous: which pod hosts the store, how long to wait
            args.append(f"--rdzv-conf={a.rdzv_conf}")
    # On nodes with several networks, the rendezvous and gloo use the address of the interface the
    # site chose (GLOO_SOCKET_IFNAME, set with NCCL's by make submit NET_IF=), not the hostname's.
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    local_addr = a.local_addr or (interface_address(interface) if interface and "," not in interface else "")
    if local_addr:
        args.append(f"--local-addr={local_addr}")
    default = ["--config-default"] if a.config_default else []
    checked = ["--memory-checked"] * memory_checked + ["--weights-checked"] * weights_checked
    return [*args, "-m", "trainer", "--config", a.config, *default, *checked, *a.overrides]


def _supported(args: list[str]) -> list[str]:
    """Drop the torchrun options this torch does not know (signals: 2.10+, shutdown timeout: 2.12+)."""
    known = torch_compat.torchrun_options()
    options, script = args[: args.index("-m")], args[args.index("-m") :]
    kept = [arg for arg in options if arg.split("=", 1)[0] in known]
    for arg in sorted(set(options) - set(kept)):
        if note := dropped_option_note(arg.split("=", 1)[0]):
            _say(note)
    return kept + script


def dropped_option_note(option: str) -> str | None:
    """What to tell the user about a torchrun option this torch lacks, or None. Without
    --shutdown-timeout (torch < 2.12) the ranks get torchrun's 30 s to save after a stop signal
    (README, "Installing"): nothing a user can change, so not said on every start."""
    if option == "--shutdown-timeout":
        return None
    return (
        f"this torch's torchrun has no {option}; it forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT only "
        f"and gives the ranks {TORCHRUN_DEFAULT_SHUTDOWN_S} s"
    )


def _quiet_torchrun(mark: str) -> None:
    """torchrun's agent logs each move of stopping the ranks ("Sending process N closing signal
    SIGTERM", "Received 2 death signal, shutting down workers", "failed (exitcode: 1) ..."): the
    launcher says what happened in one line, so they are dropped unless asked for with LOGLEVEL
    (`LOGLEVEL=INFO make run`), and always once a rank marked bad input (rank 0 said it in one line)."""
    import logging

    asked = "LOGLEVEL" in os.environ

    def unmarked(record) -> bool:
        if os.path.exists(mark):
            return False
        return asked or (record.levelno >= logging.ERROR and not record.getMessage().startswith("failed (exitcode"))

    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).addFilter(unmarked)


def rendezvous_poll_s(nnodes: int) -> float:
    """Seconds between a node's reads of the rendezvous state while it waits for the others, and
    between its checks for a node waiting to join (a restart elsewhere). torchrun reads it once a
    second (its poll and its cache of the state); a restart waits out several of them. Here 0.05 s
    a node, between 0.2 s and torchrun's 1 s: the nodes read the store at most 20 times a second in
    all below 20 nodes, and once a second each, as torchrun, from there."""
    return min(1.0, max(0.2, 0.05 * nnodes))


_rendezvous_poll = torch_compat.rendezvous_poll  # kept under its old name: tests/{unit,system}/test_dist.py


def first_failure(failures: dict, ended: set[int] = frozenset()) -> tuple[int, object]:
    """(global rank, torchrun's ProcessFailure) of the failure that came first, whatever order torchrun
    reaped the processes in. `ended`: the ranks that had ended before torchrun noticed a failure and
    stopped the others (SIGTERM, after the shutdown time SIGKILL); a rank it stopped is named only
    when none ended on its own. Of those that did, a death by a signal (an outside kill, a segfault)
    comes before an exit, which in the same instant is a peer's reaction to it (a closed connection);
    then torchrun's time of each (whole seconds, from the rank's error file if it wrote one), then
    the order in which torchrun reaped them."""
    order = {rank: i for i, rank in enumerate(failures)}
    candidates = [(rank, f) for rank, f in failures.items() if rank in ended] or list(failures.items())
    return min(candidates, key=lambda item: (item[1].exitcode >= 0, item[1].timestamp, order[item[0]]))


def _cause(failure) -> str:
    name = failure.signal_name() if failure.exitcode < 0 else "see its error above"
    return f"failed with exit code {failure.exitcode} ({name})"


def _ended(pid: int) -> bool:
    """Whether child process `pid` has ended, without reaping it (torchrun does that)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _failed(pid: int) -> bool:
    """Whether child process `pid` has ended other than with exit code 0, without reaping it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already: torchrun knows
        return False
    return info is not None and not (info.si_code == os.CLD_EXITED and info.si_status == 0)


def newest_step(run_dir: str) -> int | None:
    """The step of the run's newest committed checkpoint, as its ranks' resume takes it: a folder's, or
    an s3:// run dir's from its bucket (StoreError or OSError where the bucket cannot be read)."""
    if not objects.is_remote(run_dir):
        return layout.latest_committed_step(run_dir)
    from trainer.checkpoint import remote

    found = remote.newest_committed(run_dir)
    return found[0] if found else None


def _row_step(run_dir: str) -> int:
    """newest_step for a launcher's row: 0 where there is none, or the bucket cannot be read now."""
    try:
        return newest_step(run_dir) or 0
    except (OSError, objects.StoreError):
        return 0


def _resume_point(run_dir: str) -> str:
    try:
        step = newest_step(run_dir)
    except (OSError, objects.StoreError) as e:
        return f"its newest checkpoint in the bucket (reading it failed: {e})"
    return f"step {step}, the newest checkpoint" if step is not None else "the start (no checkpoint yet)"


def lost_nodes_line(lost: list[str], nnodes: int, run_dir: str) -> str:
    """One line for a node that stopped answering: which, and what happens next."""
    names = ", ".join(lost)
    what = f"node {names} stopped answering" if len(lost) == 1 else f"nodes {names} stopped answering"
    resume = _resume_point(run_dir)
    asked = os.environ.get(NODES_ENV, "")  # the job's --nodes (the batch script, the submitit task)
    if under_operator(os.environ):
        after = f"this pod fails and the JobSet starts every pod again (its failurePolicy); they resume from {resume}"
    elif not os.environ.get("SLURM_JOB_ID"):
        after = f"this launch ends; start it again on the nodes left and it resumes from {resume}"
    elif "-" in asked and nnodes - len(lost) >= int(asked.split("-")[0]):
        after = f"the job ends, Slurm requeues it on the nodes left (--nodes={asked}) and it resumes from {resume}"
    else:
        need = asked.split("-")[0] if asked else str(nnodes)
        after = (
            f"the job ends, Slurm requeues it and it waits for {need} nodes (--nodes={asked or nnodes}; "
            f"MIN_NODES lets it go on with fewer), then resumes from {resume}"
        )
    return outcomes.NODE_LOST.line.format(node=node_name(), what=what, silent_s=heartbeat.SILENT_S, after=after)


def _restarting_agent(
    run_dir: str,
    marks: str,
    outcome: dict,
    monitor: hangs.Monitor,
    beating=None,
    nnodes: int = 1,
    poll_s: float = 1.0,
):
    """torchrun's agent (LocalElasticAgent), which also finds the rank that failed first (kept in
    outcome["first"]) and, before each of torchrun's restarts, says it in one line and a
    metrics.jsonl row, or cancels the restarts left when the ranks stopped on bad input or divergence.
    In a multi-node launch (`beating`: this node's heartbeat.Heartbeat), a failure whose cause is a
    node that stopped answering (trainer/resilience/heartbeat.py) is not restarted (the rendezvous would wait for
    that node): the node is named in one line, kept in outcome["lost"], and the launch ends. Of the
    nodes whose ranks failed in the same round, only the one whose failure came first (a death by a
    signal before an exit, then the earlier) says the restart: the others' ranks failed after it.
    Stop signals never get here: the agent raises SignalException instead of restarting.

    It is written against torch_compat.agent_class(), which hands torchrun's private hooks
    (_start_workers, ...) to public names: a torch that renames one breaks there, not here."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    from trainer.observe.metrics import START_ENV, process_started

    launched = process_started()

    class RestartingAgent(torch_compat.agent_class()):
        def stop_workers(self, worker_group):
            """Before a restart (and after the last failure): kill the ranks at once. torchrun would
            send SIGTERM and wait 30 s for each one that does not exit, but a restart resumes from the
            newest committed checkpoint, so nothing a rank still holds is kept, and the ranks it waits
            for are the stuck ones: stopped (SIGSTOP), or blocked in a collective with a dead rank.
            A hang's stacks are taken first (trainer/resilience/hangs.py Monitor)."""
            monitor.settle()
            self.kill_workers()
            outcome["stopped"] = time.time()

        def start_workers(self, worker_group):
            """The ranks get this start's moments (metrics.START_ENV) for their resume row."""
            moments = {"launcher": launched, "rendezvous": round(time.time(), 3)}
            if "stopped" in outcome:
                moments["stopped"] = round(outcome.pop("stopped"), 3)
            os.environ[START_ENV] = json.dumps(moments)
            return super().start_workers(worker_group)

        def rendezvous(self, worker_group):
            self.cap_rendezvous_cache(worker_group, poll_s)  # the state read at most every poll_s, not every second
            super().rendezvous(worker_group)
            # The ranks' process group keys (trainer/dist.py) are per rendezvous round, which every
            # node agrees on. The restart count is not: a node whose ranks had not failed yet
            # restarts for the others' new round without counting one.
            round_ = self.rendezvous_round(worker_group)
            restarts = worker_group.spec.max_restarts - self.restarts_left
            os.environ[ROUND_ENV] = str(restarts if round_ is None else round_)

        def monitor_workers(self, worker_group):
            ended = {w.global_rank for w in worker_group.workers if w.id is not None and _ended(w.id)}
            if any(_failed(w.id) for w in worker_group.workers if w.id is not None):
                # torchrun would stop the others with SIGTERM and wait 30 s for each that stays: as
                # in stop_workers, kill them at once, once a hang's stacks are taken.
                monitor.settle()
                for w in worker_group.workers:
                    if w.id is not None and not _ended(w.id):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(w.id, signal.SIGKILL)
            result = super().monitor_workers(worker_group)  # stops every rank once one has failed
            if result.state != WorkerState.FAILED or not result.failures:
                return result
            rank, failure = outcome["first"] = first_failure(result.failures, ended)
            lost, after_another = [], False
            if beating:
                endpoint, round_, noticed = beating.record["endpoint"], os.environ.get(ROUND_ENV, ""), time.time()
                beating.failed(round_, rank, failure.exitcode, noticed)
                lost = heartbeat.silent_nodes(run_dir, endpoint, node_name())
                mine = (failure.exitcode >= 0, noticed)
                after_another = any(
                    (f.get("exit_code", 0) >= 0, f.get("time", noticed)) < mine
                    for node, f in heartbeat.failures(run_dir, endpoint, round_).items()
                    if node != node_name()
                )
            if lost:
                beating.lost(lost)
                self.restarts_left = 0
                _report_lost(outcome, lost, nnodes, run_dir, endpoint)
                return result
            if outcomes.marked(marks) or self.restarts_left <= 0:  # not restarted, as the rank said
                self.restarts_left = 0
                return result
            if after_another:  # restarted all the same, said by the node whose rank failed first
                return result
            restart = worker_group.spec.max_restarts - self.restarts_left + 1
            node = node_name()
            start = _resume_point(run_dir)
            _say(
                f"rank {rank} on {node} {_cause(failure)}; restart {restart} of {worker_group.spec.max_restarts}: "
                f"every rank starts again from {start}"
            )
            write_row(
                run_dir,
                {
                    "event": "restart",
                    "step": _row_step(run_dir),
                    "rank": rank,
                    "node": node,
                    "exit_code": failure.exitcode,
                    "restart": restart,
                    "max_restarts": worker_group.spec.max_restarts,
                },
            )
            return result

    return RestartingAgent


def _report_lost(outcome: dict, lost: list[str], nnodes: int, run_dir: str, endpoint: str) -> None:
    """Say once in this launch (kept in outcome["lost"], should a further signal come while it is
    said) that `lost` stopped answering, and leave the run's one node_lost row."""
    if outcome.get("lost"):
        return
    outcome["lost"] = lost
    _say(lost_nodes_line(lost, nnodes, run_dir))
    record_lost_nodes(run_dir, endpoint, lost)


def record_lost_nodes(run_dir: str, endpoint: str, lost: list[str]) -> None:
    """The node_lost row of this launch, written once: by the first survivor to name `lost`. srun
    stops the other survivors as soon as one exits: a claim without its row would leave the run
    with none, so their stop signal waits for both."""
    with signals.held():
        if heartbeat.first_to_name(run_dir, endpoint, lost):
            write_row(run_dir, {"event": "node_lost", "step": _row_step(run_dir), "nodes": lost, "node": node_name()})


def write_row(run_dir: str, row: dict) -> None:
    """Append one row, with the time, to metrics.jsonl (this node's ranks are stopped), unless the
    run has not written its run dir yet: a folder's, or an s3:// run dir's in its bucket (the ranks
    download it at their start and append to it)."""
    line = json.dumps({**row, "time": round(time.time(), 3)}) + "\n"
    try:
        if objects.is_remote(run_dir):
            from trainer.checkpoint import remote

            objects.Store(run_dir).append(layout.METRICS_FILE, line.encode(), remote.RUN_FILE_BYTES)
            return
        if not os.path.isdir(run_dir):
            return
        with files.open_append(os.path.join(run_dir, layout.METRICS_FILE)) as f:
            f.write(line)
    except (OSError, objects.StoreError) as e:  # the restart matters more than its row
        _say(f"could not write the restart's row to {run_dir}/metrics.jsonl: {e}")


def _signalled(run_dir: str, signum: int, started: float, shutdown_s: int) -> int:
    """Say how a launch stopped by `signum` ended, from the status the run's rank 0 left (a folder's, or
    an s3:// run dir's in its bucket, uploaded at the run's end): saved (STOPPED), stopped for another
    node's health, or stopped without a save of this start (SIGNALLED); the exit code."""
    status = objects.read_status(run_dir)
    name = signal.Signals(signum).name
    unhealthy = _stopped_for_health(run_dir, name)
    if unhealthy and status.get("updated", 0) < started:  # no step ran: the job ends for that node
        _say(unhealthy)
        return outcomes.signal_code(signum)
    if status.get("state") == "stopped" and status.get("updated", 0) >= started:
        _say(outcomes.STOPPED.line.format(signal=name, step=status.get("step")))
        return outcomes.STOPPED.code
    _say(outcomes.SIGNALLED.line.format(signal=name, shutdown_s=shutdown_s))
    return outcomes.signal_code(signum)


def _stopped_for_health(run_dir: str, signal_name: str) -> str | None:
    """The line of a node stopped by srun because another node of its Slurm job failed the health
    check (that node's record, trainer/resilience/health.py), or None. Without it the line would say only that
    a signal came."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    from trainer.launchers.requeue import health_records

    me = node_name()
    nodes = sorted({str(r["node"]) for r in health_records(run_dir, job)} - {me})
    if not nodes:
        return None
    which = f"node {nodes[0]}" if len(nodes) == 1 else "nodes " + ", ".join(nodes)
    return outcomes.STOPPED_FOR_HEALTH.line.format(node=me, signal=signal_name, which=which)


def launcher_dir(run_dir: str) -> str:
    """Where this node's launcher keeps its records of the run (a hang's dumps): the run dir, or for an
    s3:// run dir a folder of this node's own (objects.launcher_dir): a URL is no folder to write in."""
    return objects.launcher_dir(run_dir) if objects.is_remote(run_dir) else run_dir


def _health_check(cfg) -> int:
    """This node's health check (trainer/resilience/health.py): its one line, and 0, or HEALTH_FAILED after
    leaving the record the requeue check reads (under Slurm: that check runs after every node's end)."""
    from trainer.resilience import health

    node = node_name()
    try:
        result = health.check_node(cfg.health, cfg.run_dir, node)
    except health.HealthError as e:
        result = health.NodeCheck(node, failure=str(e))
    if not result.failure:  # on stdout, as the ranks' progress: stderr holds what went wrong
        print(result.line(), flush=True)
        return 0
    print(result.line(), file=sys.stderr, flush=True)
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        try:
            health.record(cfg.run_dir, job, node, result.failure, cfg.health.max_excluded)
        except OSError as e:
            _say(f"could not record the failed health check in {cfg.run_dir}: {e}")
    return outcomes.HEALTH_FAILED.code


def _signalled_for_others(bad_input: str, run_dir: str, endpoint: str, outcome: dict, nnodes: int) -> int | None:
    """The exit code of a launcher that srun stopped because of what its ranks or another node ended
    on, or None: bad input (this node's ranks marked it as they stopped: another node's exit 2 made
    srun kill this one, which must exit 2 as well), or a node another node named dead (said once)."""
    if os.path.exists(bad_input):
        return outcomes.BAD_INPUT.code
    lost = heartbeat.named_lost(run_dir, endpoint) if endpoint else []
    if lost and node_name() not in lost:  # srun's kill after another node named a dead one
        _report_lost(outcome, lost, nnodes, run_dir, endpoint)
        return outcomes.NODE_LOST.code
    return None


def _quiet_cpp_warnings() -> None:
    """This process's torch logs no C++ warnings or errors. Its agent talks to the rendezvous store on the first
    node; once that node is gone (dead, or already ended), each try logs a warning with some thirty
    C++ frames, which says less than the launcher's own line. Set before torch is imported (libc10
    reads it then), and taken out of the environment again once it is, so the ranks keep theirs."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # errors too: each is an exception the launcher says
    import torch  # noqa: F401 - reads the level now

    del os.environ["TORCH_CPP_LOG_LEVEL"]


# ---- Kubernetes: the rendezvous from what the operators set on each pod -------------------------

# Kubeflow Trainer v2's torch runtime sets torchrun's own variables on every pod of a TrainJob
# (pkg/runtime/framework/plugins/torch of kubeflow/trainer): the node count, this pod's rank (its
# Job's completion index), the first pod's address and port, and the ranks per node.
KUBEFLOW_ENV = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
KUBEFLOW_NPROC_ENV = "PET_NPROC_PER_NODE"
# A plain JobSet's pod: the Job controller sets its completion index (an Indexed Job), and the pod's
# own labels give the JobSet's and the replicated job's names (the downward API lines of the manifest
# trainer/launchers/k8s.py renders), from which its headless service names the first pod.
JOBSET_ENV = ("JOB_COMPLETION_INDEX", "JOBSET_NAME", "REPLICATED_JOB_NAME")
# The rendezvous port on a JobSet's first pod: Kubeflow Trainer's (its ContainerTrainerPort).
JOBSET_RDZV_PORT = 29500
# Seconds a pod waits for the first pod's rendezvous store (torchrun's c10d read_timeout, 60 s by
# default): the pods of a job start minutes apart where their nodes pull the image one by one.
OPERATOR_STORE_TIMEOUT_S = 600


class OperatorEnvError(Exception):
    """What a Kubernetes operator set on this pod cannot be a rendezvous: one line."""


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """This pod's place in a multi-node launch, as a Kubernetes operator said it."""

    source: str  # which operator, as said to the user: "Kubeflow Trainer (PET_*)", "JobSet (...)"
    nnodes: int
    node_rank: int
    endpoint: str  # HOST:PORT of the first pod, where the rendezvous store is
    rdzv_id: str  # the same on every pod of the job: the first pod's host name
    nproc: str | None  # ranks per node the operator asked for (Kubeflow's PET_NPROC_PER_NODE), else None


def _whole(environ, name: str, minimum: int) -> int:
    text = environ.get(name, "")
    if not text.isdigit() or int(text) < minimum:
        raise OperatorEnvError(f"{name}={text!r}: expected a whole number >= {minimum} (set by the job's operator)")
    return int(text)


def under_operator(environ) -> bool:
    """Whether this is a pod of a Kubernetes job whose operator set its rendezvous (Kubeflow Trainer, a JobSet)."""
    return any(name in environ for name in KUBEFLOW_ENV) or all(name in environ for name in JOBSET_ENV)


def operator_rendezvous(environ, nnodes: int | None) -> Rendezvous | None:
    """The rendezvous a Kubernetes operator set up for this pod (None where none did): Kubeflow
    Trainer's PET_* variables, else a JobSet's (JOB_COMPLETION_INDEX and the JobSet's names;
    `nnodes`, from the command line, counts its nodes). OperatorEnvError for values that are none."""
    if any(name in environ for name in KUBEFLOW_ENV):
        missing = [name for name in KUBEFLOW_ENV if not environ.get(name)]
        if missing:
            raise OperatorEnvError(
                f"{', '.join(missing)} not set while {', '.join(n for n in KUBEFLOW_ENV if n not in missing)} "
                f"are: not a Kubeflow Trainer torch runtime's pod; set all of them, or none"
            )
        count = _whole(environ, "PET_NNODES", 1)
        rank = _whole(environ, "PET_NODE_RANK", 0)
        port = _whole(environ, "PET_MASTER_PORT", 1)
        host = environ["PET_MASTER_ADDR"]
        nproc = environ.get(KUBEFLOW_NPROC_ENV) or None
        source = "Kubeflow Trainer (PET_*)"
    elif "JOB_COMPLETION_INDEX" in environ and "JOBSET_NAME" in environ:
        missing = [name for name in JOBSET_ENV if not environ.get(name)]
        if missing:
            raise OperatorEnvError(f"{', '.join(missing)} not set: a JobSet's pod needs {', '.join(JOBSET_ENV)}")
        if nnodes is None:
            raise OperatorEnvError(
                "JOB_COMPLETION_INDEX and JOBSET_NAME are set (a JobSet's pod) but --nnodes is not: give the "
                "number of pods of the replicated job (its Job's completions)"
            )
        count, rank, port = nnodes, _whole(environ, "JOB_COMPLETION_INDEX", 0), JOBSET_RDZV_PORT
        jobset, job = environ["JOBSET_NAME"], environ["REPLICATED_JOB_NAME"]
        host = f"{jobset}-{job}-0-0.{jobset}"  # pod 0 of job 0, under the JobSet's headless service
        nproc, source = None, "JobSet (JOB_COMPLETION_INDEX)"
    else:
        return None
    if nnodes is not None and nnodes != count:
        raise OperatorEnvError(f"--nnodes={nnodes} but {source} says {count} node(s); give one of them")
    if rank >= count:
        raise OperatorEnvError(f"{source}: node rank {rank} is not below its {count} node(s)")
    return Rendezvous(source, count, rank, f"{host}:{port}", host, nproc)


def apply_rendezvous(a: argparse.Namespace, environ) -> Rendezvous | None:
    """Fill the launcher's rendezvous options from a Kubernetes operator's variables where the
    command line gives no rendezvous (--rdzv-endpoint): what is given is never overwritten. Of several
    nodes, the first pod hosts the store (its address may not resolve yet when it starts), and every pod waits for it
    OPERATOR_STORE_TIMEOUT_S. The defaults of what stays unset: one node, rank 0, auto."""
    rdzv = None if a.rdzv_endpoint else operator_rendezvous(environ, a.nnodes)
    if rdzv is not None:
        if a.node_rank is not None and a.node_rank != rdzv.node_rank:
            raise OperatorEnvError(f"--node-rank={a.node_rank} but {rdzv.source} says {rdzv.node_rank}; give one")
        a.nnodes, a.node_rank = rdzv.nnodes, rdzv.node_rank
        a.nproc_per_node = a.nproc_per_node or rdzv.nproc
        if rdzv.nnodes > 1:  # one node: torchrun's standalone rendezvous, on the pod alone
            a.rdzv_endpoint, a.rdzv_id = rdzv.endpoint, a.rdzv_id or rdzv.rdzv_id
            host = "true" if rdzv.node_rank == 0 else "false"
            a.rdzv_conf = f"is_host={host},read_timeout={OPERATOR_STORE_TIMEOUT_S}"
    a.nnodes = 1 if a.nnodes is None else a.nnodes
    a.node_rank = 0 if a.node_rank is None else a.node_rank
    a.nproc_per_node = a.nproc_per_node or "auto"
    return rdzv


def operator_exit(rdzv: Rendezvous, code: int, run_dir: str | None, finished: bool = False) -> int:
    """The pod's exit code under a Kubernetes operator: a launch that ended cleanly (0) before the run
    finished (a stop signal: a drained node, an evicted pod) exits as a SIGTERM'd process does, so that
    the Job fails and the JobSet's failure policy restarts the whole set, which resumes from the
    checkpoint just saved; exit 0 would count this pod's part as done. Every other code is the table's.
    `finished`: the launch found the run finished before it started anything (startup.finished)."""
    if code != 0 or run_dir is None or finished or objects.read_status(run_dir).get("state") == "finished":
        return code
    stopped = outcomes.signal_code(signal.SIGTERM)
    _say(
        f"stopped before the end of training under {rdzv.source}: exit code {stopped}, so that the whole set is "
        f"restarted (the JobSet's failurePolicy) and resumes from {_resume_point(run_dir)}"
    )
    return stopped


def main(argv: list[str] | None = None) -> int:
    for sig in signals.STOP_SIGNALS:
        signal.signal(sig, _remember)
    a = _parser().parse_intermixed_args(argv)  # overrides may come before --config too
    try:
        rdzv = apply_rendezvous(a, os.environ)
    except OperatorEnvError as e:
        print(f"error: {node_name()}: {e}", file=sys.stderr, flush=True)
        return outcomes.BAD_INPUT.code
    ran: dict = {}
    code = _launch(a, ran)
    return operator_exit(rdzv, code, ran.get("run_dir"), ran.get("finished", False)) if rdzv else code


def _launch(a: argparse.Namespace, ran: dict) -> int:
    """The launch of main(), with its options resolved; ran["run_dir"]: the run's, once known."""
    if a.nnodes > 1:
        _quiet_cpp_warnings()
    started = time.time()
    # Config errors are the same on every node: the first node says it. A node's own problem
    # (its devices, checked first) is said by that node, with its name.
    first = a.node_rank == 0
    from trainer.config import ConfigError
    from trainer.dist import NodeError
    from trainer.preflight.startup import Finished, Target, preflight

    try:  # the ranks say what differs from a saved run (the notes)
        target = Target.launcher(a.nproc_per_node, a.nnodes, node_name() if a.nnodes > 1 else "")
        ready = preflight(target, a.config, a.overrides)
    except NodeError as e:  # this node's devices
        print(f"error: {e}", file=sys.stderr, flush=True)
        return outcomes.BAD_INPUT.code
    except ConfigError as e:
        if first:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return outcomes.BAD_INPUT.code
    # What the ranks would say, before any check or set-up: a run that stopped early (trainer/early_stop.py)
    # and stays stopped, or one that reached train.steps.
    ran["run_dir"] = ready.run_dir if isinstance(ready, Finished) else ready.cfg.run_dir
    ran["finished"] = isinstance(ready, Finished)
    if isinstance(ready, Finished):
        if first:
            print(ready.line, flush=True)
            if not objects.is_remote(ready.run_dir):  # a bucket's status.json: its run's, said finished then
                layout.write_status(ready.run_dir, state="finished")
        return 0
    cfg, crowded, nproc = ready.cfg, ready.crowded, ready.target.ranks_per_node
    _say(device_line(nproc))
    if crowded:
        _say(f"warning: {crowded}")
    if cfg.health.enabled:
        code = _health_check(cfg)
        if code:
            return code

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def forward(signum, frame):  # until the agent installs its own handler, which does the same
        raise SignalException(f"received {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    for sig in signals.STOP_SIGNALS:
        signal.signal(sig, forward)
    if _early:
        name = signal.Signals(_early[0]).name
        _say(_stopped_for_health(cfg.run_dir, name) or outcomes.STOPPED_BEFORE_TRAINING.line.format(signal=name))
        return outcomes.STOPPED_BEFORE_TRAINING.code

    shutdown_s = signals.shutdown_budget(a.grace_seconds)
    os.environ.setdefault("OMP_NUM_THREADS", _threads_per_rank(nproc))
    try:
        args = torchrun.parse_args(
            _supported(
                torchrun_args(
                    a, nproc, shutdown_s, cfg.launch.max_restarts, ready.memory_checked, ready.weights_checked
                )
            )
        )
    except OSError as e:
        print(f"error: {node_name()}: {e}", file=sys.stderr, flush=True)
        return outcomes.BAD_INPUT.code
    import torch

    gpus = torch.cuda.is_available()  # the ranks' NCCL records its collectives, dumped in a hang
    try:
        local = launcher_dir(cfg.run_dir)
    except (OSError, objects.StoreError) as e:
        print(f"error: {node_name()}: {e}", file=sys.stderr, flush=True)
        return outcomes.BAD_INPUT.code
    for key, value in hangs.launcher_env(local, time.strftime("%Y%m%d-%H%M%S", time.localtime(started)), gpus).items():
        os.environ[key] = value if key == hangs.HANG_DIR_ENV else os.environ.get(key, value)
    monitor = hangs.Monitor(local, started, os.environ[hangs.HANG_DIR_ENV] if gpus else None)
    monitor.start()
    marks = tempfile.mkdtemp(prefix="trainer-launch-")
    bad_input = os.path.join(marks, outcomes.BAD_INPUT.mark)
    os.environ[MARKS_ENV] = marks
    _quiet_torchrun(bad_input)
    outcome: dict = {}
    endpoint = a.rdzv_endpoint if a.nnodes > 1 else ""
    # The heartbeats need a folder every node sees: an s3:// run dir has none (a lost node is then torchrun's
    # rendezvous timeout's to find).
    beating = heartbeat.Heartbeat(cfg.run_dir, node_name(), endpoint) if endpoint and local == cfg.run_dir else None
    agent = _restarting_agent(cfg.run_dir, marks, outcome, monitor, beating, a.nnodes, rendezvous_poll_s(a.nnodes))
    if beating:
        beating.start()
    try:
        try:
            with _rendezvous_poll(rendezvous_poll_s(a.nnodes)), torch_compat.agent_used(agent):
                torchrun.run(args)
        except ChildFailedError as e:
            if outcome.get("lost"):
                return outcomes.NODE_LOST.code  # said in one line by the agent
            if os.path.exists(bad_input):
                return outcomes.BAD_INPUT.code  # the rank said what is wrong, in one line
            passed_on = outcomes.of_rank_codes({f.exitcode for f in e.failures.values()})
            if passed_on:  # bad input, a lost lease, the all-reduce below its floor: rank 0 said it, in one line
                return passed_on.code
            report = monitor.report()
            if report:
                _say(f"a rank stopped answering: see {report} (the stacks of the ranks are beside it)")
            rank, failure = outcome.get("first") or first_failure(e.failures)
            _say(outcomes.FAILED.line.format(rank=rank, cause=_cause(failure)))
            return outcomes.FAILED.code
        except SignalException as e:
            code = _signalled_for_others(bad_input, cfg.run_dir, endpoint, outcome, a.nnodes)
            if code is not None:
                return code
            return _signalled(cfg.run_dir, e.sigval, started, shutdown_s)
        except Exception as e:  # noqa: BLE001 - rendezvous and agent failures: one line, not a traceback
            # The rendezvous store lives on the first node: a dead first node is seen here first.
            lost = heartbeat.silent_nodes(cfg.run_dir, endpoint, node_name()) if endpoint else []
            if lost:
                _report_lost(outcome, lost, a.nnodes, cfg.run_dir, endpoint)
                return outcomes.NODE_LOST.code
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""  # not a C++ stack
            _say(outcomes.TORCHRUN_FAILED.line.format(kind=type(e).__name__, first_line=first_line))
            return outcomes.TORCHRUN_FAILED.code
        return 0
    except SignalException:  # a further signal while the outcome above was being mapped
        code = _signalled_for_others(bad_input, cfg.run_dir, endpoint, outcome, a.nnodes)
        return outcomes.FAILED.code if code is None else code
    finally:
        # The outcome is decided: a late signal must not turn it into a kill (Python restores the
        # default handlers while it exits, and torch's agent handler would raise here).
        for sig in signals.STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if beating:
            beating.stop()
        shutil.rmtree(marks, ignore_errors=True)
        monitor.stop()


if __name__ == "__main__":
    sys.exit(main())
