"""The health check's judgements (trainer/resilience/health.py), each on its own: only the GPUs are mocked (a
fake device whose matmul is wrong, a node that sees fewer GPUs than assigned). The ranks' all-reduce
is measured in real 2-process runs: test_launch.py (gloo, one node), test_slurm_failures.py (two nodes)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.run import ROOT, TINY
from trainer.launchers import torchrun
from trainer.resilience import health
from trainer.resilience.health import HealthArgs, check_node

CPU = lambda: None  # a node where torch sees no CUDA


def cpu_matmul(a, b, dtype):
    return a @ b


def wrong_matmul(a, b, dtype):
    """A faulty GPU: one row of the product has the wrong sign (a flipped sign bit)."""
    c = a @ b
    c[7] *= -1
    return c


def test_a_correct_matmul_passes_in_float32_and_bfloat16():
    errors = health.matmul_errors(cpu_matmul)
    assert set(errors) == {"float32", "bfloat16"}
    assert errors["float32"] < 1e-6 and 1e-4 < errors["bfloat16"] < health.MATMUL_TOLERANCE["bfloat16"] / 2
    assert health.judge_matmul("GPU 0", errors) is None


def test_the_float64_reference_is_computed_once_for_all_gpus():
    """#33 item 7: every GPU's check computed the same float64 product on the CPU again."""
    health.matmul_reference.cache_clear()

    def spoiling(a, b, dtype):  # a matmul that writes into its inputs spoils no later check
        product = a @ b
        a.zero_()
        return product

    first = [health.matmul_errors(spoiling) for _ in range(3)]
    assert health.matmul_reference.cache_info().misses == 1
    assert first[0] == first[1] == first[2] == health.matmul_errors(cpu_matmul)


def test_tf32_rounding_is_within_the_float32_tolerance():
    """TF32 keeps 10 of float32's 23 mantissa bits: the inputs rounded so must still pass."""

    def tf32(x):
        bits = x.view(torch.int32)
        return ((bits + (1 << 12)) & ~((1 << 13) - 1)).view(torch.float32)

    error = health.matmul_errors(lambda a, b, dtype: tf32(a) @ tf32(b) if dtype == torch.float32 else a @ b)
    assert 1e-4 < error["float32"] < health.MATMUL_TOLERANCE["float32"] / 3


def test_a_device_whose_matmul_is_wrong_fails_the_node():
    errors = health.matmul_errors(wrong_matmul)
    result = check_node(HealthArgs(), ROOT, "n3", gpu_check=lambda: (1, {"GPU 0 (fake)": errors}))
    assert result.line() == (
        f"health: n3: a 512x512 float32 matmul on GPU 0 (fake) differs from the CPU's by {errors['float32']:.2e} "
        f"(normwise relative error; at most 2e-03 allowed)"
    )
    nan = {"float32": math.nan, "bfloat16": 0.0}
    assert "differs from the CPU's by nan" in health.judge_matmul("GPU 1", nan)


def test_gpus_seen_against_those_assigned(monkeypatch):
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("SLURM_JOB_GPUS", raising=False)
    good = health.matmul_errors(cpu_matmul)
    result = check_node(HealthArgs(), ROOT, "n1", gpu_check=lambda: (1, {"GPU 0 (fake)": good}))
    assert result.line() == (
        "health: n1: torch sees 1 GPU(s) but 2 are assigned (SLURM_GPUS_ON_NODE=2, CUDA_VISIBLE_DEVICES=0,1): "
        "a GPU is missing or unusable"
    )
    two = {"GPU 0 (fake)": good, "GPU 1 (fake)": good}
    assert check_node(HealthArgs(), ROOT, "n1", gpu_check=lambda: (2, two)).line().startswith("health: n1: passed in ")
    assert (
        ": 2 GPU(s) as assigned, matmul agrees with the CPU (float32 "
        in check_node(HealthArgs(), ROOT, "n1", gpu_check=lambda: (2, two)).line()
    )
    # The local cluster's nodes: GPUs assigned, torch sees no CUDA: the ranks train on the CPU.
    result = check_node(HealthArgs(), ROOT, "n1", gpu_check=CPU)
    assert not result.failure and "no GPU used (trains on the CPU)" in result.summary
    # Outside Slurm, CUDA_VISIBLE_DEVICES alone says what is assigned.
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    assert health.judge_visible(2) is None
    assert health.judge_visible(1) == (
        "torch sees 1 GPU(s) but 2 are assigned (CUDA_VISIBLE_DEVICES=0,1): a GPU is missing or unusable"
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert health.judge_visible(8) is None


def test_a_failing_or_hanging_command_fails_the_node_with_its_last_line(tmp_path):
    args = HealthArgs(command='echo checking; echo "GPU 3: 12 uncorrectable ECC errors" >&2; exit 3')
    assert check_node(args, tmp_path, "n2", gpu_check=CPU).line() == (
        'health: n2: health.command `echo checking; echo "GPU 3: 12 uncorrectable ECC errors" >&2; exit 3` '
        "exited 3 (stderr's last line: GPU 3: 12 uncorrectable ECC errors)"
    )
    args = HealthArgs(command="sleep 30", command_timeout_s=1)
    assert check_node(args, tmp_path, "n2", gpu_check=CPU).line() == (
        "health: n2: health.command `sleep 30` did not end within 1 s (health.command_timeout_s)"
    )
    # The node's name is in the command's environment.
    args = HealthArgs(command='test "$HEALTH_NODE" != n2')
    assert check_node(args, tmp_path, "n2", gpu_check=CPU).failure.endswith("exited 1 (no output)")
    result = check_node(args, tmp_path, "n1", gpu_check=CPU)
    assert not result.failure and "health.command passed in" in result.summary


def test_a_write_floor_that_cannot_be_met_fails_and_leaves_nothing(tmp_path):
    run_dir = tmp_path / "not" / "yet"  # the ranks make it later: the nearest folder above is measured
    result = check_node(HealthArgs(min_write_mbps=1e12), run_dir, "n4", gpu_check=CPU)
    assert result.failure.startswith(f"the run dir ({tmp_path}) takes writes at ")
    assert result.failure.endswith(" MB/s (8 MiB with fsync), below health.min_write_mbps=1e+12")
    assert list(tmp_path.iterdir()) == []
    result = check_node(HealthArgs(), run_dir, "n4", gpu_check=CPU)
    assert not result.failure and "run dir write" in result.summary and list(tmp_path.iterdir()) == []


def test_an_s3_run_dir_is_written_in_this_nodes_staging_folder(tmp_path, monkeypatch):
    """The node writes an s3:// run dir's files in its staging copy (TRAINER_S3_STAGING), uploaded from
    there: that folder is measured, not a folder named s3: under the current one (a pod's read-only /app)."""
    staging, elsewhere = tmp_path / "staging", tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("TRAINER_S3_STAGING", str(staging))
    result = check_node(HealthArgs(min_write_mbps=1e12), "s3://bucket/runs/a", "n4", gpu_check=CPU)
    assert result.failure.startswith(f"the run dir ({staging}) takes writes at "), result.failure
    assert list(elsewhere.iterdir()) == [] and list(staging.iterdir()) == []
    staging.rmdir()
    staging.symlink_to(elsewhere)  # a staging root not the node's own: its line, nothing written
    result = check_node(HealthArgs(), "s3://bucket/runs/a", "n4", gpu_check=CPU)
    assert result.failure == (
        f"cannot write to the run dir's staging copy: TRAINER_S3_STAGING: {staging} is not a folder of this "
        "user's own (a link, a file or another user's); set TRAINER_S3_STAGING to a private folder"
    )
    assert list(elsewhere.iterdir()) == []


def test_bus_bandwidth_as_nccl_tests_define_it_judged_on_gpus_only():
    line, failed = health.busbw_line(1.0, 10**9, 4, "nccl", 2, floor=2.0)  # 1e9 x 2 x 3/4 / 1 s
    assert failed and line == (
        "health: all-reduce of 1000.0 MB across 4 ranks on 2 node(s) (nccl): 1.50 GB/s bus bandwidth, below "
        "health.min_busbw_gbps=2: the fabric between these nodes is slow"
    )
    assert health.busbw_line(1.0, 10**9, 4, "nccl", 2, floor=1.0) == (
        "health: all-reduce of 1000.0 MB across 4 ranks on 2 node(s) (nccl): 1.50 GB/s bus bandwidth, floor 1 met",
        False,
    )
    assert health.busbw_line(1.0, 10**9, 4, "nccl", 2, floor=0.0)[1] is False
    line, failed = health.busbw_line(100.0, 10**9, 2, "gloo", 1, floor=1000.0)
    assert not failed and line.endswith("0.01 GB/s bus bandwidth (measured, not judged on the CPU)")


def test_the_launcher_outside_slurm_is_one_line_and_exit_4_without_a_record(capsys, monkeypatch, tmp_path):
    """make run: a failing check is the node's one line and exit code 4; nothing starts, no record.
    Under Slurm (SLURM_JOB_ID) the same failure leaves the record the requeue check reads."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(health, "_gpus_in_child", lambda: None)  # no GPU here either way: no torch child
    run_dir = tmp_path / "run"
    args = [
        "--nproc-per-node=1",
        "--config",
        str(ROOT / "configs/default.yaml"),
        f"run_dir={run_dir}",
        *TINY,
        "health.command=exit 5",
    ]
    assert torchrun.main(args) == health.HEALTH_FAILED
    out, err = capsys.readouterr()
    err = [line for line in err.splitlines() if not line.startswith("launch: ")]
    assert err == [f"health: {torchrun.node_name()}: health.command `exit 5` exited 5 (no output)"] and out == ""
    assert not run_dir.exists()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURMD_NODENAME", "n9")
    assert torchrun.main([*args, "health.max_excluded=1"]) == health.HEALTH_FAILED
    record = run_dir / "slurm" / "health" / "77.n9.json"
    found = json.loads(record.read_text())
    assert (found["job"], found["node"], found["reason"], found["max_excluded"]) == (
        "77",
        "n9",
        "health.command `exit 5` exited 5 (no output)",
        1,
    )
    assert os.listdir(run_dir) == ["slurm"]
    capsys.readouterr()

    # health.enabled=false: no check (the command would fail); the launcher goes on to start torchrun.
    class Started(Exception):
        pass

    def start(args):
        raise Started

    monkeypatch.setattr(torchrun, "_supported", start)
    with pytest.raises(Started):
        torchrun.main([*args, "health.enabled=false"])
    assert "health:" not in "".join(capsys.readouterr())


def test_a_record_is_never_written_through_a_link_in_the_run_dir(tmp_path):
    """The failing node's record goes into the shared run dir: a link planted in place of the records'
    folder or at the record's own name does not make it write where the link leads (the record is
    written under a fresh random name and renamed over it: trainer/rundir/files.py)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    precious = victim / "precious.txt"
    precious.write_text("keep")
    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "health").symlink_to(victim)
    path = health.record(str(run), "7", "n2", "health.command failed", 2)
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    (Path(path).parent / "7.n3.json").symlink_to(precious)
    health.record(str(run), "7", "n3", "health.command failed", 2)
    assert precious.read_text() == "keep"
    assert sorted(p.name for p in Path(path).parent.iterdir()) == ["7.n2.json", "7.n3.json"]


def test_a_node_stopped_for_another_nodes_failed_check_says_so(monkeypatch, tmp_path):
    """srun stops every node of the job once the node that failed its health check exits 4: the
    others name that node, not just the signal; a node never names itself, nor another job's."""
    health.record(str(tmp_path), "7", "n2", "health.command `x` exited 1 (no output)", 2)
    monkeypatch.setattr(torchrun, "node_name", lambda: "n1")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert torchrun._stopped_for_health(str(tmp_path), "SIGTERM") == (
        "n1: stopped by SIGTERM: node n2 of this job failed the health check (said above); nothing to save"
    )
    monkeypatch.setattr(torchrun, "node_name", lambda: "n2")
    assert torchrun._stopped_for_health(str(tmp_path), "SIGTERM") is None
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    assert torchrun._stopped_for_health(str(tmp_path), "SIGTERM") is None
