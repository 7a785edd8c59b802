"""What trainer.submit renders and refuses without a cluster: golden batch scripts for what cannot
run here (GPUs, containers), the local cluster's configuration for N nodes, values that reach the
batch script as data, dry runs against a stub cluster, and what is written into the run dir's slurm/
(files planted there, submitit's pickles). Jobs on the real cluster: tests/system/test_slurm_jobs.py and
tests/system/test_slurm_failures.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.run import ROOT as REPO
from trainer.launchers import slurm

GOLDEN = REPO / "tests" / "golden"

# ---- rendered batch scripts for what cannot run here (GPUs, containers) -------------------------


def _gpu_job(
    container: str | None, runtime: str | None = None, net_if: str | None = None, min_nodes: int | None = None
) -> slurm.Job:
    return slurm.Job(
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
    text = slurm.render_sbatch(
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
    assert slurm.container_image(given, forced) == (image, runtime)


def test_gres_gpu_counts():
    assert slurm.gres_gpus("gpu:8") == 8
    assert slurm.gres_gpus("gpu:a100:4(S:0-1),gpu:h100:4") == 8
    assert slurm.gres_gpus("gpu:2,mps:100") == 2
    assert slurm.gres_gpus("(null)") == 0


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
    job = slurm.Job(
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
    script.write_text(slurm.render_sbatch(job, repo_dir=repo, python=str(pybin / "python")))
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
    code = slurm.main(["--dry-run", *args])
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


@pytest.mark.parametrize("where", ["RUN_DIR", "ARGS", "config"])
def test_an_s3_run_dir_is_refused_for_a_slurm_job_in_one_line(stub_cluster, capsys, monkeypatch, where):
    """`make submit RUN_DIR=s3://...` made a local folder named `s3:` in the current one (Path.resolve),
    and the job's requeue check would have read that folder: a Slurm job's run dir (its batch script,
    logs, requeue and health records) is a folder of the cluster's shared filesystem; one line says so
    and what to use, before anything is written."""
    monkeypatch.chdir(stub_cluster)
    url = "s3://my-bucket/runs/tiny"
    config = stub_cluster / "s3.yaml"
    config.write_text((REPO / "configs/default.yaml").read_text().replace("run_dir: runs/default", f"run_dir: {url}"))
    given = {
        "RUN_DIR": ("--run-dir", url),
        "ARGS": ("--", f"run_dir={url}"),
        "config": ("--config", str(config)),
    }[where]
    code, out, err = _dry_run(capsys, *given)
    said = {"RUN_DIR": f"RUN_DIR={url}", "ARGS": f"ARGS run_dir={url}", "config": f"run_dir: {url} in s3.yaml"}[where]
    assert code == 2 and out == "", err
    assert err == (
        f"submit: error: {said}: a Slurm job's run dir is a folder on the cluster's shared filesystem (its batch "
        f"script, logs, requeue and health records live there), not object storage; give a shared folder, or run "
        f"s3:// run dirs with make run or make submit-k8s (docs/checkpoints.md)\n"
    ), err
    assert not (stub_cluster / "s3:").exists()


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
        slurm.main(
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


def _local_job(run_dir: Path) -> slurm.Job:
    return slurm.Job(
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
    """An sbatch on PATH that records its arguments and standard input, and accepts the job as 42 (and
    an srun, for submitit's check that it is on a Slurm login node)."""
    record = tmp_path / "sbatch-calls"
    _stub(
        tmp_path / "sbatch-bin",
        "sbatch",
        f"open({str(record)!r}, 'a').write(json.dumps([sys.argv[1:], sys.stdin.read()]) + '\\n')\n"
        "print('42' if '--parsable' in sys.argv else 'Submitted batch job 42')\n",
    )
    # submitit asks for srun on PATH before it submits (a login node has one); a unit test never runs it
    _stub(tmp_path / "sbatch-bin", "srun", "sys.exit('srun is not run by a unit test')\n")
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
    assert slurm.submit_sbatch(job) == "42"
    argv, stdin = json.loads(stub_sbatch.read_text())
    assert argv == ["--parsable"] and stdin == slurm.render_sbatch(job)
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
    for launcher in (slurm.submit_sbatch, slurm.submit_submitit):
        with pytest.raises(slurm.SubmitError) as e:
            launcher(_local_job(run_dir))
        assert str(e.value).startswith(f"{run_dir / 'slurm'} is ") and "\n" not in str(e.value), e.value
    assert not stub_sbatch.exists() and list(elsewhere.iterdir()) == []


def test_submitit_refuses_a_run_dir_others_can_write(tmp_path, stub_sbatch):
    """Another user who can write the run dir could rename slurm/ away and plant a pickle the nodes
    run: LAUNCHER=submitit needs a run dir (and folders above it) only the user can write."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o775)
    run_dir.chmod(0o775)
    with pytest.raises(slurm.SubmitError) as e:
        slurm.submit_submitit(_local_job(run_dir))
    assert str(e.value).startswith(f"LAUNCHER=submitit: {run_dir} (owner uid {os.geteuid()}, mode 775) lets another")
    assert not stub_sbatch.exists()


def test_submitit_folder_is_private_and_the_nodes_run_the_guard(tmp_path, stub_sbatch):
    """The submitit folder is 0700, its pickle 0600, and the nodes' command is the guard's."""
    run_dir = tmp_path / "run"
    job_id = slurm.submit_submitit(_local_job(run_dir))
    assert job_id == "42"
    folder = run_dir / "slurm" / "submitit"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "42_submitted.pkl").stat().st_mode) == 0o600
    argv, _ = json.loads(stub_sbatch.read_text())
    script = Path(argv[-1]).read_text()
    assert f"-u -m trainer.launchers.submitit_guard -u -m submitit.core._submit {folder}" in script, script


class _Marker:
    """Unpickling it creates the file `path`: proof that a pickle was (or was not) unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _guard(folder: Path, monkeypatch) -> int:
    from trainer.launchers import submitit_guard

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
