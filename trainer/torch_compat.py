"""Every torch-private API the trainer touches, in one place, with the torch versions it was checked on.

torch may rename or drop a private name in any release. Nothing else in trainer/ names one: each use
is a function here, listed in `PRIVATE` (a module's name), `AGENT` (a hook of torchrun's agent) or
`ATTRIBUTES` (an attribute torch sets on its objects); `missing()` says which this torch lacks, and
tests/unit/test_torch_compat.py runs it in both test venvs (`make test`, `make test-compat`) and checks
that no other module of trainer/ reaches into torch's private names.

Checked on: torch 2.11.0 (.venv-compat, the H100 machines) and 2.14.1 (.venv), 2026-11-26.

Each private name: who uses it (through which function here); what happens where it is missing.

* distributed_c10d._get_default_store: train.py (default_store); the trainer cannot start.
* elastic dynamic_rendezvous._delay: launch.py (rendezvous_poll); the rendezvous polls at 1 s.
* torch.distributed.run's parser `_actions`: launch.py (torchrun_options); the launch fails.
* LocalElasticAgent._start_workers, _stop_workers, _monitor_workers, _rendezvous, _shutdown,
  SimpleElasticAgent._remaining_restarts, the rendezvous handler's _state_holder (.state,
  ._cache_duration): launch.py's agent (agent_class, see AGENT and ATTRIBUTES); the launch fails.
* algorithms._checkpoint.checkpoint_wrapper: parallel/activation_checkpointing.py (checkpoint_wrapper); AC
  cannot be used.
* distributed.tensor._utils.compute_local_shape_and_global_offset: hf.py (local_shape_and_offset);
  no HF import of a DTensor.
* checkpoint._nested_dict.flatten_state_dict: checkpoint.py (flatten, for save_plan.describe: the
  state as DCP's planner flattens it); checkpoints are saved by DCP's own planner.
* distributed.tensor._utils._compute_local_shape_and_global_offset (the same for any mesh coordinate,
  not only this rank's): save_plan.py (chunk_at: every rank's chunk of a DTensor other than one
  mesh dimension of Shard); checkpoints are saved by DCP's own planner (gathering every plan).
* checkpoint.filesystem._StorageInfo, FileSystemReader._get_metadata_path: shard_reader.py
  (storage_info_class, metadata_path); checkpoints cannot load.
* torch._utils._rebuild_tensor_v2, serialization._get_layout: names that checkpoint files' pickles
  carry, which shard_reader.py's unpickler maps to its own functions (never torch's); checked here.
* utils._python_dispatch.TorchDispatchMode, utils._pytree.tree_flatten, UntypedStorage._cdata:
  memory.py (dispatch_mode_base, leaves, storage_key); no memory estimate.
* LRScheduler._last_lr: optim.py (set_last_lr); get_last_lr() says the old lr until the next step
  after a resumed run changed optim.lr.
* _inductor.config.emulate_precision_casts: float8.py (emulate_precision_casts; torchtitan's
  workaround for pytorch#150859); compiled rowwise float8 rounds unlike eager.
* DTensor._local_tensor (a class annotation; torch sets it on each instance): float8.py
  (local_tensor: the very tensor, where to_local() would give a view); float8 checkpoints hold
  torchao's class.
* ops._c10d_functional.reduce_scatter_tensor (the functional collectives' op namespace):
  parallel/activation_checkpointing.py (reduce_scatter_op: an op whose output selective activation
  checkpointing keeps, as torchtitan's policy does); its output is recomputed, which costs a
  collective per block.
* nn.modules.batchnorm._BatchNorm: parallel.py (batch_norm_base); no BatchNorm statistics synced,
  or the trainer cannot start.
* checkpoint.staging.DefaultStager._config (the StagingOptions it was made with): checkpoint.py
  (fresh_stager: a new stager per async save on torch 2.11, whose stager stages once); async saves
  after the first fail there.
* DefaultSavePlanner._cached_plans_key and SavePlanner's class-level plan caches (_cached_save_plan,
  _cached_all_plans, _cached_global_plan, _cached_metadata, _cached_final_save_plan): checkpoint.py
  (cache_plans_under, drop_cached_plans: each Checkpointer's plans cached under a key of its own, and
  dropped at its close); without them plan caching cannot be kept to one layout.

Not calls, so not here: the `_checkpoint_wrapped_module.` prefix that checkpoint_wrapper puts in
parameter names (parallel.py, hf.py and models/transformer_net.py take it out), and FileSystemReader's
`_extension_registry` argument, passed through as shard_reader.py receives it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import signal
import time

# DCP's save-plan caches: class-level dicts of SavePlanner, keyed by a planner's _cached_plans_key.
PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)
# (module, attribute) of every private name above; a dotted attribute is looked up step by step.
PRIVATE = [
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_delay"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.distributed.tensor._utils", "_compute_local_shape_and_global_offset"),
    ("torch.distributed.checkpoint._nested_dict", "flatten_state_dict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader._get_metadata_path"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.serialization", "_get_layout"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._pytree", "tree_flatten"),
    ("torch", "UntypedStorage._cdata"),
    ("torch.nn.modules.batchnorm", "_BatchNorm"),
    ("torch._inductor.config", "emulate_precision_casts"),
    ("torch", "ops._c10d_functional.reduce_scatter_tensor"),
    ("torch.distributed.elastic.utils.store", "_barrier_nonblocking"),
    ("torch.distributed.elastic.agent.server.api", "_TERMINAL_STATE_SYNC_ID"),
    *(("torch.distributed.checkpoint.planner", f"SavePlanner.{name}") for name in PLAN_CACHES),
]
# Seconds between a node's looks at torchrun's exit barrier (Agent.exit_barrier).
EXIT_BARRIER_POLL_S = 0.1
# The hooks of torchrun's agent (a LocalElasticAgent) that Agent below hands to public names.
AGENT = ["_start_workers", "_stop_workers", "_monitor_workers", "_rendezvous", "_shutdown", "_exit_barrier"]
# (module, class, attribute) that torch sets on its objects (`self.<attribute> =` in the class's source):
# read or set by Agent below and by set_last_lr.
ATTRIBUTES = [
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_remaining_restarts"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_exit_barrier_timeout"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_store"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_worker_group"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "DynamicRendezvousHandler", "_state_holder"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_BackendRendezvousStateHolder", "_cache_duration"),
    ("torch.optim.lr_scheduler", "LRScheduler", "_last_lr"),
    ("torch.distributed.checkpoint.staging", "DefaultStager", "_config"),
    ("torch.distributed.checkpoint.default_planner", "DefaultSavePlanner", "_cached_plans_key"),
    # module_view: a module sharing another's children, parameters and buffers (pp.py's stages)
    ("torch.nn.modules.module", "Module", "_modules"),
    ("torch.nn.modules.module", "Module", "_parameters"),
    ("torch.nn.modules.module", "Module", "_buffers"),
    ("torch.nn.modules.module", "Module", "_non_persistent_buffers_set"),
]


def missing() -> list[str]:
    """The private names of PRIVATE, AGENT and ATTRIBUTES that this torch lacks (empty where all are there)."""
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
    from torch.distributed.tensor import DTensor

    if "_local_tensor" not in getattr(DTensor, "__annotations__", {}):  # set on instances, declared on the class
        gone.append("torch.distributed.tensor.DTensor._local_tensor")
    for module, cls, name in ATTRIBUTES:
        try:
            source = inspect.getsource(getattr(importlib.import_module(module), cls))
        except (ImportError, AttributeError, OSError, TypeError):
            source = ""
        set_as = (f"self.{name} =", f"self.{name}: ", f'super().__setattr__("{name}",')  # Module's own way
        if not any(form in source for form in set_as):
            gone.append(f"{module}.{cls}.{name}")
    return gone


def module_view(model):
    """A module of `model`'s class and attributes whose children, parameters and buffers are
    `model`'s (the same objects, in dictionaries of its own), without `model`'s hooks: a pipeline
    stage cut from it reassigns its own children only (trainer/parallel/pp.py). nn.Module's
    dictionaries (ATTRIBUTES)."""
    import torch.nn as nn

    view = type(model).__new__(type(model))
    nn.Module.__init__(view)
    own = vars(view)
    for key, value in vars(model).items():
        own.setdefault(key, value)
    view._modules.update(model._modules)
    view._parameters.update(model._parameters)
    view._buffers.update(model._buffers)
    view._non_persistent_buffers_set.update(model._non_persistent_buffers_set)
    view.training = model.training
    return view


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


@functools.cache
def agent_class() -> type:
    """torchrun's agent (LocalElasticAgent) with its private hooks handed to public names: the one
    seam trainer/launchers/torchrun.py's agent is written against. As torchelastic's own subclasses do
    (LocalElasticAgent over SimpleElasticAgent), a subclass overrides a hook and calls super() for
    torch's behaviour; only its names differ, so that a torch that renames a hook breaks here, in one
    class that tests/unit/test_torch_compat.py checks, not in the launcher's logic.

    A subclass overrides start_workers, stop_workers, monitor_workers, rendezvous (torch's
    _start_workers, ...); it reads and sets restarts_left (the restarts torchrun has left in this
    launch), and calls kill_workers() (every rank at once, SIGKILL), rendezvous_round() and
    cap_rendezvous_cache(). torch's exit barrier is replaced by one that a stop signal interrupts
    (exit_barrier). Built once, on first use: importing this module does not import torch."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        # torch calls these; each hands over to the public name below
        def _start_workers(self, worker_group):
            return self.start_workers(worker_group)

        def _stop_workers(self, worker_group):
            return self.stop_workers(worker_group)

        def _monitor_workers(self, worker_group):
            return self.monitor_workers(worker_group)

        def _rendezvous(self, worker_group):
            return self.rendezvous(worker_group)

        def _exit_barrier(self):
            return self.exit_barrier()

        # torch's own behaviour, what a subclass's super() call reaches
        def start_workers(self, worker_group):
            return LocalElasticAgent._start_workers(self, worker_group)

        def stop_workers(self, worker_group):
            return LocalElasticAgent._stop_workers(self, worker_group)

        def monitor_workers(self, worker_group):
            return LocalElasticAgent._monitor_workers(self, worker_group)

        def rendezvous(self, worker_group):
            return LocalElasticAgent._rendezvous(self, worker_group)

        def exit_barrier(self) -> None:
            """torch's exit barrier, polled: this node's agent, its ranks ended, waits for every node's
            (node 0's hosts the rendezvous store the others still read) up to torch's exit barrier
            timeout (300 s). torch waits in C++, where a stop signal is not acted on until the wait
            ends: a Kubernetes pod whose peer stopped first (a drained node) and that the JobSet then
            deletes would ignore its SIGTERM for 300 s. Here the wait is a Python loop: the signal
            raises at once. As torch's, a store that went away (node 0 ended) ends the wait."""
            from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
            from torch.distributed.elastic.utils.store import _barrier_nonblocking

            deadline = time.monotonic() + self._exit_barrier_timeout
            try:
                key = _barrier_nonblocking(self._store, self._worker_group.group_world_size, _TERMINAL_STATE_SYNC_ID)
                while not self._store.check([key]) and time.monotonic() < deadline:
                    time.sleep(EXIT_BARRIER_POLL_S)
            except (RuntimeError, OSError):  # the store's host ended (torch's DistStoreError is a RuntimeError)
                return

        def kill_workers(self) -> None:
            """Every rank of this node killed at once (SIGKILL), as torch's shutdown does it."""
            self._shutdown(signal.SIGKILL)

        @property
        def restarts_left(self) -> int:
            return self._remaining_restarts

        @restarts_left.setter
        def restarts_left(self, value: int) -> None:
            self._remaining_restarts = value

        @staticmethod
        def rendezvous_round(worker_group):
            """The round of the rendezvous this node's ranks started in (the same on every node), or
            None where the handler is not torchrun's dynamic one."""
            holder = getattr(worker_group.spec.rdzv_handler, "_state_holder", None)
            return getattr(getattr(holder, "state", None), "round", None)

        @staticmethod
        def cap_rendezvous_cache(worker_group, seconds: float) -> None:
            """The rendezvous state is read again at most `seconds` after the last read (torchrun: 1 s)."""
            holder = getattr(worker_group.spec.rdzv_handler, "_state_holder", None)
            if hasattr(holder, "_cache_duration"):
                holder._cache_duration = min(holder._cache_duration, seconds)

    return Agent


@contextlib.contextmanager
def agent_used(agent: type):
    """torchrun's launcher starts `agent` (a subclass of agent_class()) in place of its own while this runs."""
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = agent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # main() may run again in this process (submitit)


def checkpoint_wrapper(module, context_fn=None):
    """`module` wrapped for activation checkpointing (torch's wrapper, still under a private path);
    `context_fn`: torch.utils.checkpoint's, for selective checkpointing (None: recompute everything)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, context_fn=context_fn) if context_fn else wrap(module)


def reduce_scatter_op():
    """The functional collectives' reduce-scatter (tensor parallelism's, and float8's): an op whose
    output selective activation checkpointing keeps rather than recompute."""
    import torch

    return torch.ops._c10d_functional.reduce_scatter_tensor.default


def local_shape_and_offset(param):
    """(shape, offset) in the full tensor of this rank's part of the DTensor `param`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


def chunk_at(shape, mesh_shape, coordinate: list[int], placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) in the full tensor of the chunk a DTensor of `shape` and `placements` on a mesh
    of `mesh_shape` holds at mesh `coordinate` (any rank's, where local_shape_and_offset is this
    rank's); raises AttributeError where this torch has no such function."""
    from torch.distributed.tensor import _utils

    return _utils._compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)


def flatten(state: dict) -> dict:
    """`state` flattened as DCP's planners flatten it (keys "model.layers.0.w", ...)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


def storage_info_class() -> type:
    """DCP's record of where a tensor lies in a shard file, a class its .metadata pickles name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def metadata_path(reader, rank: int | None):
    """The path of the .metadata file a FileSystemReader `reader` reads for `rank`."""
    return reader._get_metadata_path(rank)


def dispatch_mode_base() -> type:
    """torch's TorchDispatchMode: the base of a mode that sees every op dispatched while it is on."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def leaves(tree) -> list:
    """The leaves of a nest of lists, tuples and dicts (an op's outputs), in order."""
    from torch.utils._pytree import tree_flatten

    return tree_flatten(tree)[0]


def storage_key(storage) -> int:
    """What tells one tensor storage from another while both live, on the meta device too (where
    data_ptr() is 0 for all)."""
    return storage._cdata


def set_last_lr(scheduler, lrs: list[float]) -> None:
    """What `scheduler.get_last_lr()` answers until its next step."""
    scheduler._last_lr = list(lrs)


def batch_norm_base() -> type:
    """The base class of every BatchNorm of torch (1d, 2d, 3d, lazy and synced)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


def emulate_precision_casts() -> None:
    """Compiled code rounds casts as eager code does (torchtitan's workaround for pytorch#150859,
    needed by rowwise float8 under compile)."""
    from torch._inductor import config

    config.emulate_precision_casts = True


def local_tensor(dtensor):
    """This rank's tensor of `dtensor` itself, not a view of it (to_local's): a tensor subclass
    (torchao's float8 weight) stays what it is."""
    return dtensor._local_tensor


def fresh_stager(stager):
    """A new stager of `stager`'s class made with the same options (DefaultStager._config)."""
    return type(stager)(stager._config)


def cache_plans_under(planner, key: str) -> None:
    """Have a DefaultSavePlanner(enable_plan_caching=True) cache its plans under `key`, not under its
    class name (which every planner of the process shares)."""
    planner._cached_plans_key = key


def drop_cached_plans(key: str) -> None:
    """Forget the save plans DCP cached under `key` (cache_plans_under)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in PLAN_CACHES:
        getattr(SavePlanner, cache, {}).pop(key, None)
