"""docs/extending.md's examples are true (issue #43, "Done when"): each ```python block, found by the
heading it stands under, runs as written against the real tables, and what it adds works: the family
passes the config check and builds (from FAMILIES and as model.family), the checkpoint part comes
back through a real save and load, the sink receives the rows Trackers hands on, the launcher's check
and command are the trainer's own, the degrees come out of ParallelDims. What an example registers
is removed again (monkeypatch). Fast: one process, a process group of one."""

from __future__ import annotations

import json
import re
import socket
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.helpers.pages import ROOT, block, section
from tests.helpers.run import TINY
from trainer import models
from trainer.checkpoint import manager
from trainer.config import ConfigError, load
from trainer.launchers import torchrun
from trainer.observe import trackers
from trainer.parallel.dims import ParallelDims
from trainer.preflight.check import validate
from trainer.preflight.startup import Ready
from trainer.resilience import outcomes

PAGE = "docs/extending.md"


def example(heading: str, name: str) -> types.ModuleType:
    """The page's python block under `heading`, run as the module `name` (as a file of its own is)."""
    module = types.ModuleType(name)
    module.__file__ = f"<{PAGE}, {heading}>"
    exec(compile(block(PAGE, heading, "python"), module.__file__, "exec"), module.__dict__)
    return module


def test_each_kind_of_addition_has_its_section_and_the_architecture_page_points_here():
    for heading in (
        "Adding a model family",
        "Adding a checkpoint part",
        "Adding a metrics sink",
        "Adding a launcher",
        "Adding a parallelism technique",
        "Adding an optimizer",
        "Adding a failure detector",
    ):
        assert re.search(r"tests/(unit|system|{unit,system})/test_", section(PAGE, heading)), (
            heading
        )  # each names the test that holds it
    architecture = (ROOT / "docs/architecture.md").read_text()
    assert "(extending.md)" in architecture and "## Adding" not in architecture  # one place for each


MY_MLP = ["model.name=my_mlp", "data.name=synthetic_images", "model.image_size=8", "model.num_classes=3"]


def test_the_example_family_checks_and_builds_from_families_and_as_model_family(tmp_path, monkeypatch):
    spec = example("Adding a model family", "my_family")
    assert "torch" not in vars(spec)  # the spec imports no torch; build does
    monkeypatch.setitem(models.FAMILIES, "my_mlp", spec.FAMILY)
    args = load(None, [*MY_MLP, f"run_dir={tmp_path / 'run'}"])
    assert models.spec(args.model) is spec.FAMILY
    validate(args, 1)
    with pytest.raises(ConfigError) as e:
        validate(load(None, [*MY_MLP, "data.name=synthetic"]), 1)
    assert str(e.value) == "config: data.name: is 'synthetic'; my_mlp trains on synthetic_images"
    model = models.build(args.model)
    x = torch.zeros(2, *spec.FAMILY.input_shape(args.model))
    assert model(x).shape == (2, 3)
    assert [sum(p.numel() for p in unit.parameters()) for unit in spec.FAMILY.blocks(model)] == [
        3 * 8 * 8 * 32 + 32,
        32 * 3 + 3,
    ]

    # without a fork: the same file in a package of the user's, named by model.family
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_family.py").write_text(block(PAGE, "Adding a model family", "python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_pkg", "my_pkg.my_family"):  # another test's my_pkg, imported before, is not this one
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        found = models.user_family("my_pkg.my_family")
        assert found.kind == "classifier" and found.input_shape(args.model) == (3, 8, 8)
    finally:
        sys.modules.pop("my_pkg.my_family", None)
        sys.modules.pop("my_pkg", None)


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _checkpointer(run_dir, group, part):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    parts = {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), "tokens_seen": part}
    return manager.Checkpointer(manager.CheckpointArgs(keep=0), str(run_dir), 0, 1, group, model, optimizer, parts)


def test_the_example_part_is_saved_in_meta_json_and_loaded_back(tmp_path, group):
    TokensSeen = example("Adding a checkpoint part", "tokens_seen").TokensSeen
    part = TokensSeen()
    part.tokens = 12345
    ckpt = _checkpointer(tmp_path, group, part)
    ckpt.save(1, {"samples": 3}, blocking=True)
    ckpt.close()
    meta = json.loads((Path(manager.step_path(tmp_path, 1)) / "meta.json").read_text())
    assert meta["tokens_seen"] == {"tokens": 12345}

    again = TokensSeen()
    ckpt = _checkpointer(tmp_path, group, again)
    assert ckpt.load()["step"] == 1
    ckpt.close()
    assert again.tokens == 12345
    # what the load asks before load_state_dict: a state meta.json could hold that is no count
    assert again.problem({"tokens": 7}) is None
    assert again.problem({"tokens": -1}) == "is {'tokens': -1}, not a count of tokens"
    assert again.problem({"tokens": "7"}) is not None and again.problem([1]) is not None


def test_the_example_sink_receives_each_steps_numbers_through_the_trackers(tmp_path, monkeypatch):
    StatsD = example("Adding a metrics sink", "statsd").StatsD
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(30)
    monkeypatch.setenv("STATSD_HOST", "127.0.0.1")
    monkeypatch.setenv("STATSD_PORT", str(server.getsockname()[1]))
    monkeypatch.setitem(trackers.SINKS, "statsd", StatsD)
    args = SimpleNamespace(tensorboard=False, wandb=False, mlflow=False, statsd=True)
    assert trackers.missing_package("statsd") is None
    run = trackers.Trackers(str(tmp_path), args, {}, None)
    try:
        run.log({"step": 3, "loss": 2.5, "eval_loss": 1.25, "source": "x", "stopped": True})
        run.log({"step": 4, "loss": float("nan")})  # no finite number: nothing sent
        run.log({"step": 5, "tokens": 7})
        assert server.recv(1000).decode().splitlines() == ["train.loss:2.5|g", "eval.loss:1.25|g"]
        assert server.recv(1000).decode() == "train.tokens:7.0|g"
    finally:
        run.close()
        server.close()
    assert not (tmp_path / "trackers.json").exists()  # it keeps no run id


def test_the_example_launcher_checks_with_the_one_preflight_and_starts_the_trainers_launcher(tmp_path):
    k8s = example("Adding a launcher", "k8s_launcher")
    config = str(ROOT / "configs/default.yaml")
    ready = k8s.check(config, 2, 2, [f"run_dir={tmp_path / 'run'}", *TINY])
    assert isinstance(ready, Ready) and ready.target.world_size == 4
    with pytest.raises(ConfigError, match="12 is not divisible by 8 processes"):  # checked for the Job's ranks
        k8s.check(config, 2, 4, [f"run_dir={tmp_path / 'run'}", *TINY])
    with pytest.raises(ConfigError, match="train.no_such_key"):
        k8s.check(config, 2, 2, [f"run_dir={tmp_path / 'run'}", "train.no_such_key=1"])

    argv = k8s.pod_command("configs/default.yaml", 2, 4, "job7", node_rank=1)
    assert argv[:3] == ["python", "-m", "trainer.launch"]
    parsed = torchrun._parser().parse_intermixed_args(argv[3:])  # options the launcher has
    assert (parsed.nnodes, parsed.node_rank, parsed.rdzv_id, parsed.config) == (2, 1, "job7", "configs/default.yaml")
    assert parsed.rdzv_endpoint == "job7-0.job7:29400"

    codes = k8s.fail_job_codes()
    assert outcomes.BAD_INPUT.code in codes and outcomes.LEASE_LOST.code in codes
    assert outcomes.FAILED.code not in codes and 0 not in codes  # a crash is restarted; 0 ends the Job
    assert all(outcomes.by_code(code).requeue == outcomes.NOT_REQUEUED for code in codes)


def test_the_example_degrees_come_out_of_parallel_dims():
    pp = example("Adding a parallelism technique", "pp")
    assert isinstance(pp.dims, ParallelDims)
    assert (pp.mesh_shape, pp.mesh_names) == ((4, 2, 2), ("pp", "dp_shard", "tp"))
    assert pp.dims.dp_size == 2 and pp.dims.non_data_parallel_size == 8
    assert pp.samples_of == [0, 0, 1, 1] * 4
    assert pp.stage_of == [s for s in range(4) for _ in range(4)]
    assert pp.found == [
        ("parallel.pp", "4 stages do not split the model's 6 blocks (model.n_layers) evenly; choose a divisor of 6")
    ]
    assert pp.dims.problems() == []
