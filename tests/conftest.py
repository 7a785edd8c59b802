"""The tests' one set of helpers: run the real trainer in real processes (torchrun, gloo, CPU), read
what it wrote, refuse bad input, and submit to the local Slurm cluster.

Plain functions and fixtures both live here, not in a separate helpers module: every test file
imports them as `from conftest import ...` (pytest puts tests/ on sys.path), and fixtures such as
`runs` must be here for pytest to find them without an import in each file.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# Small and fast: the tiny transformer on generated data; B=12 divides over 1, 2, 3 and 4 ranks.
TINY = [
    "model.seq_len=32",
    "train.global_batch_size=12",
    "train.steps=6",
    "log.interval=1",
    "log.progress=false",
    "optim.warmup_steps=2",
    "checkpoint.interval=0",
]

# The in-process tests run on one thread, as the processes they start do (env() below): their
# tensors are small, and on a loaded 2-core machine two threads of each op wait for each other.
torch.set_num_threads(1)


def env(gpu: bool = False) -> dict:
    """The trainer's environment; the CPU (gloo) unless `gpu`, also on a machine with GPUs."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if not gpu:
        e["CUDA_VISIBLE_DEVICES"] = ""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(name, None)
    return e


def run_command(
    cmd: list, timeout: float | None = 120, extra_env: dict | None = None, gpu: bool = False, **kw
) -> subprocess.CompletedProcess:
    """`cmd` in the repository with the trainer's environment (env(gpu), then `extra_env`), to its end;
    its output captured as text. `kw`: more of subprocess.run's arguments (umask)."""
    return subprocess.run(
        cmd, cwd=ROOT, env={**env(gpu), **(extra_env or {})}, capture_output=True, text=True, timeout=timeout, **kw
    )


def python(*args, timeout: float | None = 120, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`python *args` (a `-m trainer.x ...` or a `-c` script) as run_command runs it."""
    return run_command([PYTHON, *map(str, args)], timeout=timeout, extra_env=extra_env)


def command(run_dir, nproc: int, overrides, config: str = "configs/default.yaml", module: str = "trainer") -> list[str]:
    args = ["-m", module, "--config", str(ROOT / config), f"run_dir={run_dir}", *overrides]
    if nproc == 1:
        return [PYTHON, *args]
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *args]


def train(
    run_dir,
    nproc: int = 1,
    *overrides,
    config: str = "configs/default.yaml",
    expect: int = 0,
    timeout: float = 300,
    gpu: bool = False,
    module: str = "trainer",
) -> subprocess.CompletedProcess:
    """Run the trainer to the end; fail the test with its output if the exit code is not `expect`.
    `module`: what `python -m` runs (a test's own entry point into the trainer)."""
    proc = run_command(command(run_dir, nproc, overrides, config, module), timeout=timeout, gpu=gpu)
    if proc.returncode != expect:
        pytest.fail(
            f"trainer exited {proc.returncode}, expected {expect}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def start(run_dir, nproc: int, *overrides, config: str = "configs/default.yaml") -> subprocess.Popen:
    """Start the trainer in its own process group (so the whole job can be signalled or killed)."""
    return subprocess.Popen(
        command(run_dir, nproc, overrides, config),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def launch_command(run_dir, *overrides: str, options=(), config: str = str(ROOT / "configs" / "default.yaml")) -> list:
    """`python -m trainer.launch` with 2 ranks (what make run does) on the tiny run: `options` for the
    launcher, `overrides` for the trainer."""
    return [
        PYTHON,
        "-m",
        "trainer.launch",
        "--nproc-per-node=2",
        *options,
        "--config",
        config,
        f"run_dir={run_dir}",
        *TINY,
        *overrides,
    ]


def launch(run_dir, *overrides: str, options=(), extra_env: dict | None = None, **kw) -> subprocess.Popen:
    """Start launch_command's launcher; its stdout and stderr are pipes. `kw`: more of Popen's arguments."""
    return subprocess.Popen(
        launch_command(run_dir, *overrides, options=options),
        cwd=ROOT,
        env={**env(), **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def wait_for(predicate, timeout: float = 120, what: str = "condition", interval: float = 0.02):
    """The first true value of `predicate()`, asked every `interval` s; fails the test after `timeout` s."""
    deadline = time.time() + timeout
    while not (value := predicate()):
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return value


def kill_group(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def metrics(run_dir) -> list[dict]:
    """The rows of metrics.jsonl but its event rows (resume, restart, node_lost: trainer/observe/metrics.py):
    training and evaluation rows; none while there is no such file."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "event" not in r]


def rows(run_dir) -> list[dict]:
    """Training rows of metrics.jsonl (evaluation rows have no 'loss')."""
    return [r for r in metrics(run_dir) if "loss" in r]


def losses(run_dir) -> dict[int, float]:
    """Loss by step; a step logged twice (redone after a crash) keeps its last value."""
    return {r["step"]: r["loss"] for r in rows(run_dir)}


def weights(run_dir, step: int | None = None) -> dict[str, torch.Tensor]:
    """The consolidated model weights of a run's checkpoint, through the export tool's code."""
    from trainer.commands.export import consolidate

    return consolidate(str(run_dir), step)[0]


def assert_same_weights(a: dict, b: dict, exact: bool = False, atol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), f"{key} differs"
        else:
            torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def assert_same_losses(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), f"steps differ: {sorted(a)} vs {sorted(b)}"
    for step in a:
        assert abs(a[step] - b[step]) <= rtol * abs(b[step]) + 1e-6, f"step {step}: loss {a[step]} vs {b[step]}"


def export_hf(run_dir, out, *options: str, umask: int = -1) -> subprocess.CompletedProcess:
    """`python -m trainer.export RUN_DIR --format hf --out OUT *options` under `umask` (-1: this
    process's); fails the test unless it exits 0."""
    proc = run_command(
        [PYTHON, "-m", "trainer.export", str(run_dir), "--format", "hf", "--out", str(out), *options],
        timeout=300,
        umask=umask,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def corpus(n: int, seed: int = 0) -> list[str]:
    """Sentences from a small grammar: learnable structure, for a tokenizer and a token file."""
    rng = random.Random(seed)
    subjects, verbs, objects = (
        ["the cat", "a dog", "my bird", "the fox"],
        ["sees", "eats", "likes"],
        ["the fish.", "a bone.", "some seeds."],
    )
    return [
        " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}" for _ in range(rng.randint(1, 4)))
        for _ in range(n)
    ]


# ---- what an attacker plants in a run dir, and a checkpoint tampered with -------------------------

SECRET = "the victim's own file\n"  # the text of the `secret` fixture's file


@pytest.fixture
def secret(tmp_path):
    """A file of the victim's own, which a link planted in a run dir points to."""
    path = tmp_path / "secret"
    path.write_text(SECRET)
    return path


def plant(kind: str, path: Path, secret: Path) -> None:
    """Put at `path` what someone else could: a link to `secret`, a FIFO, or a folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        os.symlink(secret, path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)


def load_metadata(folder):
    """A checkpoint folder's .metadata (DCP's pickle), to tamper with."""
    import pickle

    with open(os.path.join(folder, ".metadata"), "rb") as f:
        return pickle.load(f)  # only ever a file this test wrote or is about to tamper with


def rerecord(folder) -> None:
    """Record the folder's files again, as someone who tampers with a checkpoint would: the
    checksums then agree, and only the reader's own care stands in the way."""
    from trainer.checkpoint import checksums

    for name in os.listdir(folder):
        if name.endswith(checksums.SUFFIX):
            shard = os.path.join(folder, name[: -len(checksums.SUFFIX)])
            size, digest = checksums.checksum_file(shard)
            with open(shard + checksums.SUFFIX, "w") as f:
                json.dump({"size": size, "xxh3_64": digest}, f)
    if os.path.exists(os.path.join(folder, "manifest.json")):  # checkpoints saved since issue 27
        checksums.write_manifest(str(folder), json.load(open(os.path.join(folder, "meta.json"))).get("run_id"))


def point_index(folder, fqn: str, offset: int, length: int) -> None:
    """The chunk index's record of the value `fqn` (a pickled item) pointed at `offset`, `length` of
    its shard file, as someone who tampers with a checkpoint would (rerecord afterwards)."""
    import numpy as np

    from trainer.checkpoint import save_plan

    path = os.path.join(folder, save_plan.INDEX)
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    items = json.loads(arrays["header"].tobytes())["items"]
    t = next(t for t, item in enumerate(items) if item["fqn"] == fqn)
    arrays[f"p{t}"][0], arrays[f"l{t}"][0] = offset, length
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def without_index(folder) -> None:
    """`folder` as DCP's own planner saves it: no chunk index (chunks.npz), so a load reads its
    .metadata (rerecorded)."""
    from trainer.checkpoint import save_plan

    os.remove(os.path.join(folder, save_plan.INDEX))
    rerecord(folder)


# ---- bad input: one line, exit 2, nothing written -----------------------------------------------

DEFAULT = str(ROOT / "configs" / "default.yaml")  # the default config, as the bad-input tests name it


def refused(capsys, run_dir: Path, *argv: str, config: str = DEFAULT) -> str:
    """The one error line of `python -m trainer.check`; fails unless it exits 2 and wrote nothing."""
    from trainer.preflight import check

    code = check.main(["--config", config, f"run_dir={run_dir}", *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, out + err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not run_dir.exists(), "the check wrote into the run dir"
    return lines[0]


def accepted(capsys, run_dir: Path, *argv: str, config: str = DEFAULT) -> None:
    from trainer.preflight import check

    code = check.main(["--config", config, f"run_dir={run_dir}", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not run_dir.exists()


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The single error line of a process that must exit 2 without a traceback."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    device_line = re.compile(r"launch: \S+: \d+ rank\(s\) on ")  # the launcher says it before the ranks start
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not device_line.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


# A Hugging Face llama config small enough for a folder in a test (hf_folder).
HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def hf_folder(tmp_path, config=HF_CONFIG, index: str | None = None) -> Path:
    """A Hugging Face folder as trainer.check reads it: config.json and a safetensors file (its header
    is read, not its names), with `index` as model.safetensors.index.json if given."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(32)}, str(folder / "model.safetensors"))
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(index)
    return folder


# ---- the local Slurm cluster (make slurm-up): tests/test_slurm_jobs.py, test_slurm_failures.py ----

FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
COMMON = ["checkpoint.interval=5", "log.interval=5"]  # the cluster jobs' checkpoint and log interval

# Polls of the cluster (scontrol, sinfo): 5 a second, not 50, on the cores the cluster shares.
wait_for_cluster = functools.partial(wait_for, interval=0.2)


@functools.cache
def _cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
    return out.returncode == 0 and len(re.findall(r" (idle|mix|alloc)", out.stdout)) >= 4


def cluster(test):
    """Needs the local Slurm cluster (skipped without it); slow: each such test runs jobs or submits."""
    no_cluster = pytest.mark.skipif(not _cluster_up(), reason="local Slurm cluster is not up (make slurm-up)")
    return pytest.mark.slow(no_cluster(test))


@pytest.fixture(scope="module")
def runs():
    """A run dir root the nodes see and that only this user can swap: submitit refuses a run dir
    whose folders above let another user rename it (a CI clone owned by another uid than the one
    running the tests, or one in /tmp, falls back to a folder under home)."""
    from trainer.launchers import slurm
    from trainer.rundir import files

    root = ROOT / "runs" / f"test-slurm-{os.getpid()}"
    try:
        slurm.check_shared(root, nodes=4)
        root.mkdir(parents=True, exist_ok=True)
        safe = files.replaceable(root) is None
    except (slurm.SubmitError, OSError):
        safe = False
    if not safe:
        shutil.rmtree(root, ignore_errors=True)
        root = Path.home() / ".cache" / "fsdp-trainer-tests" / f"slurm-{os.getpid()}"
        root.mkdir(parents=True, exist_ok=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def submit_job(*args: str, env: dict[str, str] | None = None) -> str:
    """Run python -m trainer.submit; return the job id it prints."""
    out = subprocess.run(
        [sys.executable, "-m", "trainer.submit", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def make_submit(*variables: str) -> str:
    """`make submit VAR=...` as a user types it; return the job id it prints."""
    out = subprocess.run(["make", "submit", *variables], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


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


def log_text(run_dir: Path, job_id: str) -> str:
    return (run_dir / "slurm" / f"{job_id}.out").read_text()


def small_parts(seed: int, mesh=None):
    """A small model (fully_shard'ed over the DeviceMesh `mesh`, when given), its AdamW and a constant
    scheduler, seeded by `seed`: the stateful parts the checkpoint tests save and load."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def small_step(model, optimizer, scheduler) -> None:
    """One training step of small_parts' parts on a random batch."""
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
