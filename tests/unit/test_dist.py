"""The environment: ranks from torchrun, then Slurm, then one process; the device and backend
follow the machine. GPUs cannot run here, so their presence is mocked and what the code would
hand to torch.distributed is checked. How a rank that finished leaves is run for real."""

import pytest
import torch

from trainer import dist
from trainer.observe import metrics

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_torchrun_variables_come_first(clean_env):
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    clean_env.setenv("SLURM_PROCID", "0")  # srun also ran, but torchrun's ranks win
    clean_env.setenv("SLURM_NTASKS", "2")
    env = dist.read_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.device == torch.device("cpu")


def test_slurm_variables_without_torchrun(clean_env):
    for name, value in {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "2(x2)",
        "MASTER_ADDR": "n1",
    }.items():
        clean_env.setenv(name, value)
    env = dist.read_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)


def test_one_process_otherwise(clean_env):
    env = dist.read_env()
    assert (env.rank, env.world_size, env.is_main) == (0, 1, True)


def test_gpus_give_nccl_and_the_local_rank_device(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "3")
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 4)
    chosen = {}
    clean_env.setattr(torch.cuda, "set_device", lambda device: chosen.setdefault("device", device))
    clean_env.setattr(
        torch.distributed,
        "init_process_group",
        lambda backend, timeout, device_id: chosen.update(backend=backend, device_id=device_id),
    )
    env = dist.init(timeout_s=60)
    assert env.device == torch.device("cuda", 3)
    assert chosen == {
        "device": torch.device("cuda", 3),
        "backend": "cuda:nccl,cpu:gloo",
        "device_id": torch.device("cuda", 3),
    }


def test_more_processes_than_gpus_is_refused_with_what_to_do(monkeypatch):
    from trainer.config import ConfigError
    from trainer.preflight.check import check_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpus(1)
    with pytest.raises(
        ConfigError, match=r"2 processes on this node but 1 GPU\(s\) visible.*--nproc-per-node=1.*CUDA_VISIBLE_DEVICES="
    ):
        check_gpus(2)


def test_cpu_gives_gloo(clean_env):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):  # init sets these for one process
        clean_env.setenv(name, "")
        clean_env.delenv(name)
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    env = dist.init(timeout_s=60)  # a real one-process gloo group, as `python -m trainer` starts
    try:
        group = torch.distributed.group.WORLD
        assert env.device == torch.device("cpu") and torch.distributed.get_backend() == "gloo"
        assert group.bound_device_id is None and torch.distributed.get_world_size() == 1
        total = torch.tensor([2.0])
        torch.distributed.all_reduce(total)  # a CPU collective runs on it
        assert total.item() == 2.0
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Some Future GPU", None),
    ],
)
def test_peak_flops_for_mfu(monkeypatch, name, flops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
    assert metrics.peak_flops(torch.device("cuda", 0)) == flops
    assert metrics.peak_flops(torch.device("cpu")) is None


def test_transformer_flops_per_token():
    from trainer.models import ModelArgs, build

    with torch.device("meta"):
        model = build(ModelArgs(size="1b", seq_len=2048))
    s = model.shape
    n = model.num_params()
    assert model.flops_per_token() == 6 * n + 12 * s.n_layers * s.dim * 2048
    assert 6 * n / model.flops_per_token() > 0.8  # the attention term is the smaller part at 2k context
    with torch.device("meta"):
        tied = build(ModelArgs(size="1b", seq_len=2048, tie_embeddings=True))
    assert tied.flops_per_token() == model.flops_per_token()  # a tied head computes as much


def test_the_launchers_rendezvous_polls_faster_only_while_it_runs(monkeypatch):
    """torchrun's rendezvous waits 1 s between reads of its state (`_delay(seconds=1)`); while the
    launcher runs it waits launch.rendezvous_poll_s, any other delay unchanged, and torch's own after."""
    import time

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from trainer.launchers import torchrun

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    original = dynamic_rendezvous._delay
    with torchrun._rendezvous_poll(0.2):
        dynamic_rendezvous._delay(seconds=1)  # as torchrun calls it
        dynamic_rendezvous._delay(seconds=0.5)
    dynamic_rendezvous._delay(seconds=1)
    assert dynamic_rendezvous._delay is original and slept == [0.2, 0.5, 1]
    # 0.05 s a node from 0.2 s to torchrun's 1 s: at most 20 reads a second in all below 20 nodes
    assert [torchrun.rendezvous_poll_s(n) for n in (1, 4, 10, 20, 1000)] == [0.2, 0.2, 0.5, 1.0, 1.0]
