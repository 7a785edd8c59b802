"""Every torch-private API the trainer touches, in one place, with the torch versions it was checked on.

torch may rename or drop a private name in any release. Each use is listed in `PRIVATE` (module,
name, who uses it, what happens where it is missing); `missing()` says which this torch lacks, and
tests/test_torch_compat.py runs it in both test venvs (`make test`, `make test-compat`).

Checked on: torch 2.11.0 (.venv-compat, the H100 machines) and 2.14.1 (.venv), 2026-11-26.

| private name                                   | used by                 | where missing            |
|------------------------------------------------|-------------------------|--------------------------|
| distributed_c10d._get_default_store            | train.py (store keys)   | the trainer cannot start |
| elastic dynamic_rendezvous._delay              | launch.py (poll faster) | rendezvous polls at 1 s  |
| torch.distributed.run parser `_actions`        | launch.py (options)     | the launch fails         |
| LocalElasticAgent._start_workers, _stop_workers, _monitor_workers, _rendezvous, _shutdown,  |
|   _remaining_restarts; rdzv handler _state_holder(.state, ._cache_duration) | launch.py's agent |
|                                                | (see AGENT)             | the launch fails         |
| algorithms._checkpoint.checkpoint_wrapper      | parallel.py (AC)        | AC cannot be used        |
| distributed.tensor._utils.compute_local_shape_and_global_offset | hf.py  | HF import of a DTensor   |
| checkpoint.filesystem._StorageInfo             | shard_reader.py         | checkpoints cannot load  |
| torch._utils._rebuild_tensor_v2, serialization._get_layout | shard_reader.py's unpickler (names in the files) |
| utils._python_dispatch.TorchDispatchMode, utils._pytree.tree_flatten | memory.py | the memory estimate |
"""

from __future__ import annotations

import contextlib
import importlib

# (module, attribute) of every private name above; a dotted attribute is looked up step by step.
PRIVATE = [
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_delay"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.serialization", "_get_layout"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._pytree", "tree_flatten"),
]
# What trainer/launch.py's agent (a LocalElasticAgent) overrides or reads of torchrun's agent.
AGENT = ["_start_workers", "_stop_workers", "_monitor_workers", "_rendezvous", "_shutdown"]


def missing() -> list[str]:
    """The private names of PRIVATE and AGENT that this torch lacks (empty where all are there)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    gone = []
    for module, name in PRIVATE:
        try:
            obj = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            gone.append(f"{module}.{name}")
    gone += [f"LocalElasticAgent.{name}" for name in AGENT if not hasattr(LocalElasticAgent, name)]
    return gone


def default_store():
    """The process group's store (torchrun's TCP store): where ranks leave small keys for each other."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def torchrun_options() -> set[str]:
    """Every option string this torch's torchrun accepts."""
    from torch.distributed.run import get_args_parser

    return {s for action in get_args_parser()._actions for s in action.option_strings}


@contextlib.contextmanager
def rendezvous_poll(poll_s: float):
    """torchrun's rendezvous polls every `poll_s` seconds instead of every second while this runs (its
    private `_delay`, unchanged where this torch has none: the rendezvous is then just slower)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = getattr(dynamic_rendezvous, "_delay", None)
    if original is None:
        yield
        return

    def faster(seconds):  # torchrun's own argument name
        original(poll_s if seconds == 1 else seconds)

    dynamic_rendezvous._delay = faster
    try:
        yield
    finally:
        dynamic_rendezvous._delay = original


def checkpoint_wrapper(module):
    """`module` wrapped for activation checkpointing (torch's wrapper, still under a private path)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module)


def local_shape_and_offset(param):
    """(shape, offset) in the full tensor of this rank's part of the DTensor `param`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
