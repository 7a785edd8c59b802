"""Config parsing, and every kind of bad input: one line saying what, where and what to do, exit
code 2, no traceback, nothing written."""

import os
import re
import subprocess

import numpy as np
import pytest

from tests.helpers.run import ROOT, python
from trainer.config import ConfigError, load, resolve
from trainer.preflight import check
from trainer.preflight.check import check_devices, validate


def write(tmp_path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_defaults_yaml_overrides(tmp_path):
    path = write(tmp_path, "train:\n  steps: 50\n  global_batch_size: 8\noptim:\n  lr: 1.0e-3\n")
    cfg = load(path, ["train.steps=70", "optim.lr=2e-4", "model.vocab_size=null", "optim.betas=[0.8, 0.9]"])
    assert cfg.train.steps == 70  # override beats YAML
    assert cfg.train.global_batch_size == 8  # YAML beats default
    assert cfg.train.seed == 0  # default
    assert cfg.optim.lr == 2e-4  # '2e-4' is a string to YAML; float fields accept it
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.model.vocab_size is None


def test_every_shipped_config_is_valid():
    for name in sorted(os.listdir(ROOT / "configs")):
        path = str(ROOT / "configs" / name)
        cfg = load(path)
        if cfg.data.name in ("synthetic", "synthetic_images"):
            validate(cfg, world_size=2, where=path)


# The scale each shipped config is written for: (nodes, GPUs per node), checked against 80 GB GPUs.
SHIPPED_SCALE = {
    "default.yaml": (1, 2),
    "mnist.yaml": (1, 2),
    "llama-1b.yaml": (1, 8),
    "llama-8b.yaml": (4, 8),
    "llama-70b.yaml": (8, 8),
    "llama-405b.yaml": (64, 8),
    "resnet50.yaml": (1, 8),
}


def stand_in_data(cfg, tmp_path) -> list[str]:
    """Overrides pointing a config's data at the smallest files of the same kind (none for generated or
    downloaded data): a token file of seq_len+1 tokens of its dtype, image folders with one class."""
    d, overrides = cfg.data, []
    for key, path in (("data.path", d.path), ("data.eval_path", d.eval_path)):
        if not path or d.name not in ("tokens", "imagefolder"):
            continue
        stand_in = tmp_path / key
        if d.name == "tokens":
            np.zeros(cfg.model.seq_len + 1, dtype=d.token_dtype).tofile(stand_in)
        else:
            (stand_in / "class0").mkdir(parents=True)
        overrides.append(f"{key}={stand_in}")
    return overrides


# The full-size models' estimates take 2-3 s each (405B's about 25 s): the system tier (tests/system/test_config.py).
HEAVY_CONFIGS = {"llama-8b.yaml", "llama-70b.yaml", "llama-405b.yaml", "llama-1b.yaml", "resnet50.yaml"}


def shipped(heavy: bool) -> list[str]:
    """The shipped configs' names: the heavy ones or the others."""
    return [name for name in sorted(os.listdir(ROOT / "configs")) if (name in HEAVY_CONFIGS) == heavy]


@pytest.mark.parametrize("name", shipped(heavy=False))
def test_every_shipped_config_passes_the_check_at_its_scale(tmp_path, monkeypatch, capsys, name):
    """The shipped configs but the heavy ones (tests/system/test_config.py), as check_at_scale says."""
    check_at_scale(tmp_path, monkeypatch, capsys, name)


def check_at_scale(tmp_path, monkeypatch, capsys, name: str) -> None:
    """`python -m trainer.check` on shipped config `name` at the scale it is written for. As shipped,
    the only error allowed is its data missing on this machine; with stand-in data every check passes,
    the memory preflight against 80 GB GPUs included. Only the count of local devices is mocked."""
    assert name in SHIPPED_SCALE, f"configs/{name}: add the scale it is written for to SHIPPED_SCALE"
    nodes, gpus = SHIPPED_SCALE[name]
    monkeypatch.chdir(ROOT)  # the configs' relative paths (data/mnist, runs/...) as make check sees them
    monkeypatch.setattr(check, "check_devices", lambda nproc, option="": None)  # this machine has no GPU, CI neither
    path = f"configs/{name}"
    cfg = load(path)
    args = [
        "--config",
        path,
        "--nproc",
        str(gpus),
        "--nnodes",
        str(nodes),
        "--gpu-mem-gb",
        "80",
        f"run_dir={tmp_path / 'run'}",
    ]
    missing = [
        p
        for p in (cfg.data.path, cfg.data.eval_path)
        if p and cfg.data.name in ("tokens", "imagefolder") and not os.path.exists(p)
    ]

    code = check.main(args)
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith(f"config OK: {path}: "), err
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    if missing:  # planning for 80 GB GPUs (GPU_MEM_GB): data only the cluster has is a warning, the only kind
        assert len(warnings) == len(missing), out
        for warning, key, where in zip(warnings, ("data.path", "data.eval_path"), missing):
            assert warning.startswith(f"warning: {path}: {key}: ") and f"{where} does not exist" in warning, out
    else:
        assert warnings == [], out

    code = check.main(args + stand_in_data(cfg, tmp_path))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"config OK: {path}: {cfg.model.name} on {nodes * gpus} processes"), out
    assert re.search(
        r"^memory: about [\d.]+ GB per GPU estimated for NPROC=\d+ x NODES=\d+, of the 80.0 GB", out, re.MULTILINE
    ), out
    assert not (tmp_path / "run").exists()  # a check writes nothing


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("train: [1, 2\n", [], "c.yaml:2: invalid YAML"),
        ("trian:\n  steps: 3\n", [], "unknown key 'trian'"),
        ("train:\n  stepz: 3\n", [], "unknown key 'train.stepz'"),
        ("{}\n", ["train.steps=abc"], "override 'train.steps=abc': 'train.steps' is 'abc'; expected int"),
        ("train:\n  steps: 1.5\n", [], "c.yaml: 'train.steps' is 1.5; expected int"),
        ("train: 3\n", [], "'train' is a section"),
        ("parallel:\n  strategy: zero3\n", [], "choose one of fsdp, ddp, none"),
        ("{}\n", ["train.steps"], "expected key=value"),
    ],
)
def test_parse_errors_name_the_place(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=None) as e:
        load(write(tmp_path, text), overrides)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["train.steps=0"], 1, "train.steps: is 0; it must be at least 1"),
        (["train.global_batch_size=10"], 3, "10 is not divisible by 3 processes; use a multiple of 3"),
        (["train.global_batch_size=12", "train.micro_batch_size=4"], 2, "4 does not divide the 6 samples per rank"),
        (["data.name=tokens"], 1, "data.path: is not set"),
        (["data.name=tokens", "data.path=/nonexistent.bin"], 1, "token file /nonexistent.bin does not exist"),
        (
            ["model.name=mnist_cnn", "data.name=mnist", "data.path=/nope", "data.download=false"],
            1,
            "/nope/MNIST/raw does not exist",
        ),
        (["model.name=resnet18", "data.name=imagefolder", "data.path=/nope"], 1, "folder /nope does not exist"),
        (["model.name=gpt5"], 1, "model.name: is 'gpt5'"),
        (["model.size=huge"], 1, "model.size: is 'huge'; choose one of tiny"),
        (
            ["checkpoint.resume_from=/nope/step_00000001"],
            1,
            "checkpoint.resume_from: /nope/step_00000001 does not exist",
        ),
        (
            ["checkpoint.resume_from=s3://bucket/runs/x"],
            1,
            "checkpoint.resume_from: s3://bucket/runs/x is not a checkpoint of an s3:// run dir; give one such as "
            "s3://BUCKET/PREFIX/checkpoints/step_00000100",
        ),
        (["parallel.strategy=none"], 2, "is 'none' but 2 processes run"),
        (["parallel.sharding=hybrid", "parallel.shard_size=3"], 4, "3 does not divide the 4 processes"),
        (["optim.lr=-1"], 1, "optim.lr: is -1.0; it must be positive"),
    ],
)
def test_validation_errors(overrides, world, message):
    cfg = load(None, overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world, where="c.yaml")
    assert message in str(e.value)
    assert str(e.value).startswith("c.yaml: ")


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="is a file; choose another run_dir"):
        validate(load(None, [f"run_dir={blocker}/run"]), 1)
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        validate(load(None, [f"run_dir={blocker}"]), 1)


def test_unwritable_run_dir_permissions(tmp_path):
    if os.geteuid() == 0:  # root passes permission bits; /proc/sys refuses new entries even to root
        locked = "/proc/sys/net"
        if os.access(locked, os.W_OK):
            pytest.skip("running as root and no folder here refuses root's writes")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="cannot write to"):
        validate(load(None, [f"run_dir={locked}/run"]), 1)


def test_more_processes_than_gpus_is_refused_naming_the_command_s_own_option(monkeypatch):
    """A pip user's `fsdp-train --nproc-per-node=4` was told `use NPROC=2 or fewer` (make's variable).
    The GPUs are mocked (this machine has none, CI neither)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError) as e:
        check_devices(4, "--nproc-per-node={}")
    assert str(e.value) == (
        "--nproc-per-node=4 processes but this machine has 2 GPUs; use --nproc-per-node=2 or fewer (NPROC=2 under "
        "make), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU"
    )
    with pytest.raises(ConfigError, match=r"^--nproc 3 processes but this machine has 2 GPUs; use --nproc 2 or fewer"):
        check_devices(3)
    assert check_devices(2) is None


def test_more_processes_than_cpu_cores_warn_and_run(monkeypatch):
    """Without a GPU, 4 processes on 2 cores were refused (`use NPROC=2 or fewer`), so tp=2 x 2
    data-parallel ranks could not be tried on a laptop through the launcher, though torchrun and gloo
    run them. Now a warning: the cores are shared."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = len(os.sched_getaffinity(0))
    assert check_devices(cores) is None
    assert check_devices(cores + 2) == (
        f"{cores + 2} processes on {cores} CPU core(s) (no GPU found): the ranks share the cores, so every step "
        f"is slower than on {cores}; fine to try a layout (parallel.tp, data-parallel ranks), not to train fast"
    )
    with pytest.raises(ConfigError, match="^--nproc 0: give 1 or more processes$"):
        check_devices(0)


def test_make_run_validates_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        ["make", "--no-print-directory", "run", "NPROC=999", f"RUN_DIR={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "train.global_batch_size: 32 is not divisible by 999 processes" in proc.stderr  # CPU: 999 may run, not so
    assert "rank(s) on" not in proc.stderr  # never launched
    assert not run_dir.exists()


@pytest.mark.parametrize("start", ["scratch", "hf"])
def test_the_config_and_its_validation_need_no_torch(tmp_path, start):
    """A login node's `make check` / `make submit` read and validate the config before any step that
    needs torch: with torch unimportable, configs/default.yaml loads and validates for 2 processes
    (the CPU memory check, ranks_per_node, is the step that needs torch: not asked for here), also
    when it starts from a Hugging Face folder (config.json and the weights' headers are read)."""
    overrides = [f"run_dir={tmp_path / 'run'}"]
    if start == "hf":
        from tests.helpers.inputs import hf_folder

        overrides.append(f"model.init_from={hf_folder(tmp_path)}")
    code = (
        'import sys; sys.modules["torch"] = None  # any import of torch now raises ImportError\n'
        "from trainer.config import load_run\n"
        "from trainer.preflight.check import validate\n"
        f"cfg, where, notes = load_run('configs/default.yaml', {overrides!r})\n"
        "print(validate(cfg, 2, where=where, ranks_per_node=None), cfg.model.name)\n"
    )
    proc = python("-c", code, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "[] transformer\n", proc.stderr


@pytest.mark.parametrize("optimizer, per_param", [("adamw", 12), ("adam", 12), ("adadelta", 12), ("sgd", 8)])
def test_the_checkpoint_size_comes_from_the_memory_estimates_table(tmp_path, optimizer, per_param):
    """One table of bytes per parameter (trainer/preflight/memory.py): the save time the plan estimates for a
    run dir without a measured save counts the float32 weight and the optimizer's state, the same
    bytes the memory estimate counts for them."""
    from trainer.preflight import memory
    from trainer.preflight.interval import param_count, save_seconds

    cfg = resolve(load(None, [f"optim.name={optimizer}", "model.size=tiny", f"run_dir={tmp_path}"]))
    assert memory.checkpoint_bytes(optimizer) == memory.WEIGHT_BYTES + memory.OPTIMIZER_BYTES[optimizer] == per_param
    seconds, how = save_seconds(cfg, nodes=2, run_dir=str(tmp_path))
    gb = param_count(cfg) * per_param / 1e9
    assert seconds == pytest.approx(gb / 2)  # 1 GB/s per node assumed
    assert f"{gb:.2f} GB of weights and optimizer state over 2 node(s)" in how
