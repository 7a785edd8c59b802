"""Submit training to Slurm, and decide whether a stopped job is requeued.

Two launchers start the same thing, one torchrun per node over the whole allocation:

* ``sbatch`` (default): renders ``slurm/train.sbatch.in`` into ``<run_dir>/slurm/train.sbatch``
  and submits it. The batch script requeues itself through ``requeue-check`` below.
* ``submitit``: submits :class:`TorchrunTask` with one task per node; submitit's own
  checkpoint/requeue mechanism handles the time-limit warning.

Usage (``make submit`` calls the first form)::

    python -m trainer.submit --nodes 4 [--gpus-per-node 8] [--config F] [--run-dir D] [--time T]
                             [--partition P] [--container IMG] [--launcher sbatch|submitit] [k=v ...]
    python -m trainer.submit requeue-check --run-dir D [--exit-code N] [--max-attempts-without-progress K]

This module imports only the standard library at the top: ``requeue-check`` runs in the batch
shell, outside any container. PyYAML and submitit are imported where they are needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
TEMPLATE = REPO_DIR / "slurm" / "train.sbatch.in"
# Signals torchrun forwards to its ranks (torch >= 2.10 reads this; older versions ignore it).
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# Paths that are local to each node on nearly every cluster.
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run")
NODE_LOCAL_FSTYPES = {"tmpfs", "ramfs", "devtmpfs"}
STEP_DIR = re.compile(r"^step_(\d{8})$")


class SubmitError(Exception):
    """Bad input, said in one line to the user before anything is submitted."""


# ---- run-directory state ------------------------------------------------------------------------


def latest_step(run_dir: Path) -> int | None:
    """Step of the newest complete checkpoint in run_dir, or None.

    The cheap part of trainer.checkpoint.latest_step: complete checkpoints are
    ``checkpoints/step_<8 digits>/`` holding DCP's ``.metadata`` and the trainer's ``meta.json``;
    temporary ones start with a dot. Standard library only, because requeue-check runs in the
    batch shell outside any container, where torch may be missing.
    """
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        return None
    steps = [int(m.group(1)) for p in ckpt_dir.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / ".metadata").is_file() and (p / "meta.json").is_file()]
    return max(steps, default=None)


def target_steps(run_dir: Path) -> int | None:
    """train.steps from the resolved config the trainer wrote into run_dir, or None if absent."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    import yaml

    config = yaml.safe_load(path.read_text()) or {}
    return int(config["train"]["steps"])


# ---- requeue check (runs in the batch script after srun) ----------------------------------------


def _job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    m = re.search(r"\bJobState=(\S+)", out.stdout)
    return m.group(1) if m else "UNKNOWN"


def requeue_check(run_dir: Path, exit_code: int, max_attempts: int, job_id: str) -> int:
    """Requeue job_id unless training finished or stopped making progress; return an exit code.

    An attempt makes progress when it leaves a newer checkpoint than the previous attempt of
    the same job. After max_attempts attempts in a row without progress the job is not requeued
    and fails with a message, so a broken run does not loop forever.
    """
    run_dir = Path(run_dir)
    latest, total = latest_step(run_dir), target_steps(run_dir)
    prefix = f"requeue-check: job {job_id}:"
    if total is not None and latest == total:
        print(f"{prefix} training finished at step {total}; {run_dir}", flush=True)
        return 0

    state_file = run_dir / "slurm" / "requeue.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    if state.get("job_id") != job_id:
        state = {"job_id": job_id, "step": None, "attempts_without_progress": 0}
    progressed = latest is not None and (state["step"] is None or latest > state["step"])
    attempts = 0 if progressed else state["attempts_without_progress"] + 1
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps({"job_id": job_id, "step": latest, "attempts_without_progress": attempts}))

    where = f"newest checkpoint: step {latest}" if latest is not None else "no checkpoint yet"
    if attempts >= max_attempts:
        print(
            f"{prefix} NOT requeued: {attempts} attempts in a row saved no new checkpoint ({where}, "
            f"last exit code {exit_code}). Read the log above, fix the cause, then resubmit with "
            f"the same RUN_DIR to resume.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    state_now = _job_state(job_id)
    if state_now.startswith("CANCELLED"):
        print(f"{prefix} cancelled; not requeued ({where})", flush=True)
        return 0
    print(f"{prefix} stopped at {where} (exit code {exit_code}); requeueing", flush=True)
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"{prefix} scontrol requeue failed: {result.stderr.strip()}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---- submission ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """What the user asked for, checked."""

    nodes: int
    gpus_per_node: int  # 0: one CPU process per node
    config: Path
    run_dir: Path
    overrides: list[str]
    time: str | None  # Slurm time limit ("90", "01:30:00", "1-00:00:00"); None: partition default
    partition: str | None  # None: the cluster's default partition
    container: str | None  # .sqsh/.sif file or image reference; None: no container
    warn_seconds: int  # time-limit warning sent this long before the limit
    max_attempts: int  # attempts in a row without a new checkpoint before giving up

    @property
    def nproc_per_node(self) -> int:
        return self.gpus_per_node or 1

    def train_args(self) -> list[str]:
        """Arguments after ``-m trainer``."""
        return ["--config", str(self.config), f"run_dir={self.run_dir}", *self.overrides]


TIME_FORMAT = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


def _time_minutes(time_limit: str) -> float:
    """Minutes in a Slurm time limit ("M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S")."""
    days, _, rest = time_limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
    else:
        hours, minutes, seconds = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    return int(days or 0) * 1440 + hours * 60 + minutes + seconds / 60


def _filesystem(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) that holds path (or its nearest existing parent)."""
    best = ("/", "unknown")
    real = os.path.realpath(path)
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
            best = (mount, fstype)
    return best


def check_shared(run_dir: Path, nodes: int) -> None:
    """Refuse a run directory that other nodes cannot see, where that is detectable."""
    if nodes < 2:
        return
    real = os.path.realpath(run_dir)
    mount, fstype = _filesystem(run_dir)
    if fstype in NODE_LOCAL_FSTYPES or any(real == p or real.startswith(p + "/") for p in NODE_LOCAL_PREFIXES):
        raise SubmitError(
            f"RUN_DIR {run_dir} is node-local ({fstype} at {mount}); a {nodes}-node job needs a "
            f"directory every node sees (a shared filesystem such as your home or project space)"
        )


def _slurm_partitions() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SubmitError(f"cannot reach Slurm (sinfo: {out.stderr.strip()}); is the cluster up?")
    return sorted(set(out.stdout.split()))


def parse_job(args: argparse.Namespace) -> Job:
    """Check every input that can be checked without running anything; raise SubmitError."""
    def number(name: str, text: str, minimum: int) -> int:
        if not re.fullmatch(r"\d+", text or "") or int(text) < minimum:
            raise SubmitError(f"{name}={text!r}: expected a whole number >= {minimum}")
        return int(text)

    nodes = number("NODES", args.nodes, 1)
    gpus = number("GPUS_PER_NODE", args.gpus_per_node, 0)
    warn = number("WARN", args.warn_seconds, 1)
    max_attempts = number("MAX_ATTEMPTS", args.max_attempts, 1)
    config = Path(args.config).resolve()
    if not config.is_file():
        raise SubmitError(f"CONFIG={args.config}: no such file")
    for item in args.overrides:
        if "=" not in item:
            raise SubmitError(f"ARGS: {item!r} is not key=value")
        if item.split("=", 1)[0] == "run_dir":
            raise SubmitError("ARGS: set the run directory with RUN_DIR=..., not run_dir=")
        if re.search(r"[\"$`\\]", item):
            raise SubmitError(f"ARGS: {item!r} contains one of \" $ ` \\ which the batch script cannot pass on")
    if args.run_dir:
        run_dir = Path(args.run_dir).resolve()
    else:
        run_dir = (REPO_DIR / "runs" / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    check_shared(run_dir, nodes)
    time_limit = args.time or None
    if time_limit is not None:
        if not TIME_FORMAT.match(time_limit):
            raise SubmitError(f"TIME={time_limit!r}: use minutes, H:MM:SS or D-HH:MM:SS")
        if _time_minutes(time_limit) * 60 <= warn:
            raise SubmitError(f"TIME={time_limit} is not longer than the {warn} s time-limit warning (WARN)")
    container = args.container or None
    if container and ("/" in container or container.endswith((".sqsh", ".sif"))) and not Path(container).exists():
        raise SubmitError(f"CONTAINER={container}: no such file")
    return Job(
        nodes=nodes,
        gpus_per_node=gpus,
        config=config,
        run_dir=run_dir,
        overrides=list(args.overrides),
        time=time_limit,
        partition=args.partition or None,
        container=container,
        warn_seconds=warn,
        max_attempts=max_attempts,
    )


def check_cluster(job: Job) -> None:
    """Check what needs Slurm itself: that it answers and that the partition exists."""
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch not found: submit from a Slurm login node (locally: make slurm-up)")
    partitions = _slurm_partitions()
    if job.partition and job.partition not in partitions:
        raise SubmitError(f"PARTITION={job.partition}: unknown partition (this cluster has: {', '.join(partitions)})")


def check_config(job: Job, python: str = sys.executable) -> None:
    """Validate the config for this shape with trainer.check before anything is submitted."""
    cmd = [python, "-m", "trainer.check", "--config", str(job.config), "--nproc", str(job.nproc_per_node),
           "--nnodes", str(job.nodes), f"run_dir={job.run_dir}", *job.overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_DIR)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or [f"trainer.check exited with {out.returncode}"]
        raise SubmitError(lines[-1])


# ---- sbatch launcher ----------------------------------------------------------------------------


def render_sbatch(job: Job, repo_dir: Path = REPO_DIR, python: str = sys.executable,
                  host_python: str = "python3") -> str:
    """The batch script for job. Lines whose only placeholder is empty are left out."""
    if job.container and job.container.endswith(".sif"):  # Apptainer / Singularity
        binds = f"{repo_dir},{job.run_dir}"
        nv = "--nv " if job.gpus_per_node else ""
        container_options, container_exec = "", f"apptainer exec {nv}--bind {binds} --pwd {repo_dir} {job.container}"
    elif job.container:  # Pyxis + Enroot: a .sqsh file or an image reference
        container_options = (f"--container-image={job.container} "
                             f"--container-mounts={repo_dir}:{repo_dir},{job.run_dir}:{job.run_dir} "
                             f"--container-workdir={repo_dir}")
        container_exec = ""
    else:
        container_options = container_exec = ""
    values = {
        "JOB_NAME": f"train-{job.run_dir.name}",
        "NODES": str(job.nodes),
        "GPUS_PER_NODE": str(job.gpus_per_node) if job.gpus_per_node else "",
        "PARTITION": job.partition or "",
        "TIME": job.time or "",
        "RUN_DIR": str(job.run_dir),
        "WARN_SECONDS": str(job.warn_seconds),
        "REPO_DIR": str(repo_dir),
        "CONTAINER_OPTIONS": container_options,
        "CONTAINER_EXEC": container_exec,
        # Inside a container the image's python runs training; the requeue check runs outside.
        "TRAIN_PYTHON": "python" if job.container else python,
        "HOST_PYTHON": host_python if job.container else python,
        "NPROC_PER_NODE": str(job.nproc_per_node),
        "TRAIN_ARGS": " ".join(shlex.quote(a) for a in job.train_args()),
        "MAX_ATTEMPTS": str(job.max_attempts),
    }
    lines = []
    for line in TEMPLATE.read_text().splitlines():
        names = re.findall(r"\{\{(\w+)\}\}", line)
        if names and all(values[n] == "" for n in names) and re.fullmatch(
                r"\s*(#SBATCH --[\w-]+=)?(\{\{\w+\}\}\s*)+\\?", line):
            continue
        for n in names:
            line = line.replace("{{" + n + "}}", values[n])
        lines.append(re.sub(r"\s+\\$", lambda _: " \\", line.rstrip()))
    return "\n".join(lines) + "\n"


def submit_sbatch(job: Job) -> str:
    """Render, save and submit the batch script; return the job id."""
    (job.run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    script = job.run_dir / "slurm" / "train.sbatch"
    script.write_text(render_sbatch(job))
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=REPO_DIR)
    if out.returncode != 0:
        raise SubmitError(f"sbatch refused the job: {out.stderr.strip()}")
    job_id = out.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}: {job.nodes} node(s) x {job.nproc_per_node} process(es)")
    print(f"  log:     {job.run_dir}/slurm/{job_id}.out")
    print(f"  run dir: {job.run_dir}  (must be on a filesystem every node sees)")
    print(f"  script:  {script}")
    return job_id


# ---- submitit launcher --------------------------------------------------------------------------


class TorchrunTask:
    """One submitit task per node: runs torchrun for that node and waits for it.

    On the time-limit warning (SIGUSR1, see submit_submitit) torchrun forwards the signal to the
    ranks, which save and exit; submitit calls checkpoint() on task 0, which waits for that and
    returns this task to submitit, which requeues the job. A preemption SIGTERM is ignored by
    submitit itself; task 0 then requeues through requeue_check like the batch script does.
    """

    def __init__(self, job: Job, python: str = sys.executable, shutdown_timeout: int = 120) -> None:
        self.job = job
        self.python = python
        self.shutdown_timeout = shutdown_timeout
        self._proc: subprocess.Popen | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_proc": None}

    def __call__(self) -> dict:
        import submitit

        env = submitit.JobEnvironment()
        port = 29500 + int(env.job_id.split("_")[0]) % 1000
        cmd = [self.python, "-m", "torch.distributed.run", f"--nnodes={env.num_nodes}",
               f"--node-rank={env.node}", f"--nproc-per-node={self.job.nproc_per_node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={env.hostnames[0]}:{port}",
               f"--rdzv-id={env.job_id}", "--max-restarts=0", "-m", "trainer", *self.job.train_args()]
        child_env = {**os.environ, "PET_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE,
                     "PET_SHUTDOWN_TIMEOUT": str(self.shutdown_timeout)}
        print(f"submitit task {env.global_rank}: {shlex.join(cmd)}", flush=True)
        self._proc = subprocess.Popen(cmd, env=child_env, cwd=REPO_DIR)
        # Poll rather than wait(): checkpoint() may run in a signal handler meanwhile.
        while self._proc.poll() is None:
            time.sleep(0.5)
        code = self._proc.returncode
        latest, total = latest_step(self.job.run_dir), target_steps(self.job.run_dir)
        if latest is not None and latest == total:
            return {"run_dir": str(self.job.run_dir), "step": latest}
        if env.global_rank == 0:
            if requeue_check(self.job.run_dir, code, self.job.max_attempts, env.job_id) != 0:
                raise RuntimeError(f"training stopped at step {latest} and is not requeued (see log)")
            sys.exit(-1)  # requeued, like submitit's own requeue
        return {"run_dir": str(self.job.run_dir), "step": latest, "exit_code": code}

    def checkpoint(self, *args, **kwargs):
        """Called by submitit on task 0 at the time-limit warning: let the ranks save first."""
        import submitit

        deadline = time.time() + self.shutdown_timeout + 30
        while self._proc is not None and self._proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        latest = latest_step(self.job.run_dir)
        print(f"submitit checkpoint: ranks stopped, newest checkpoint step {latest}; requeueing", flush=True)
        return submitit.helpers.DelayedSubmission(TorchrunTask(self.job, self.python, self.shutdown_timeout))


def _submitit_minutes(time_limit: str | None) -> int:
    return max(1, int(round(_time_minutes(time_limit)))) if time_limit else 60


def submit_submitit(job: Job) -> str:
    """Submit job through submitit; return the job id."""
    if job.container:
        raise SubmitError("CONTAINER is supported by the sbatch launcher only (LAUNCHER=sbatch)")
    # submitit reads the warning signal from this variable at import, here and in the job.
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = "USR1"
    import submitit

    folder = job.run_dir / "slurm" / "submitit"
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params = dict(nodes=job.nodes, tasks_per_node=1, timeout_min=_submitit_minutes(job.time),
                  name=f"train-{job.run_dir.name}", slurm_signal_delay_s=job.warn_seconds,
                  slurm_additional_parameters={"requeue": True},
                  slurm_srun_args=["--open-mode=append"])  # a requeued job appends to its task logs
    if job.gpus_per_node:
        params["gpus_per_node"] = job.gpus_per_node
    if job.partition:
        params["slurm_partition"] = job.partition
    executor.update_parameters(**params)
    submitted = executor.submit(TorchrunTask(job))
    print(f"submitted job {submitted.job_id} (submitit): {job.nodes} node(s) x {job.nproc_per_node} process(es)")
    print(f"  log:     {folder}/{submitted.job_id}_0_log.out (task 0; _1_, _2_... for the other nodes)")
    print(f"  run dir: {job.run_dir}  (must be on a filesystem every node sees)")
    return submitted.job_id


# ---- command line -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.submit", description="Submit training to Slurm.")
    p.add_argument("--nodes", default="1", help="number of nodes")
    p.add_argument("--gpus-per-node", default="0", help="GPUs per node; 0: one CPU process per node")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--run-dir", default="", help="run directory on a filesystem every node sees")
    p.add_argument("--time", default="", help="Slurm time limit; empty: the partition's default")
    p.add_argument("--partition", default="", help="empty: the cluster's default partition")
    p.add_argument("--container", default="", help=".sqsh (Pyxis/Enroot) or .sif (Apptainer) image")
    p.add_argument("--launcher", default="sbatch", choices=["sbatch", "submitit"])
    p.add_argument("--warn-seconds", default="120", help="time-limit warning, seconds before the limit")
    p.add_argument("--max-attempts", default="3", help="attempts without a new checkpoint before giving up")
    p.add_argument("--dry-run", action="store_true", help="print the batch script instead of submitting")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, key=value")
    return p


def _requeue_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.submit requeue-check")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--exit-code", type=int, default=0, help="exit code of the training step")
    p.add_argument("--max-attempts-without-progress", type=int, default=3)
    p.add_argument("--job-id", default=os.environ.get("SLURM_JOB_ID", ""))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["requeue-check"]:
        a = _requeue_parser().parse_args(argv[1:])
        return requeue_check(a.run_dir, a.exit_code, a.max_attempts_without_progress, a.job_id)
    args = _parser().parse_args(argv)
    try:
        job = parse_job(args)
        if args.dry_run:
            print(render_sbatch(job), end="")
            return 0
        check_cluster(job)
        check_config(job)
        if args.launcher == "submitit":
            submit_submitit(job)
        else:
            submit_sbatch(job)
    except SubmitError as e:
        print(f"submit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
