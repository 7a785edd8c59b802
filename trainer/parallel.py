"""How the model is spread over the ranks: FSDP2 (`fully_shard`), DDP as the baseline, or nothing.

`Plan` is the one object that knows (torchtitan's `ParallelDims`): built once from `ParallelArgs` and
the environment, it owns the device mesh with named dimensions, says this rank's data-parallel rank
and size, wraps the model (`apply`: the config in, the wrapped model out), and answers what differs
between the strategies: `no_sync`, the grad scaler, autocast, the config's checks and what one rank
holds (`memory_factors`). Nothing outside this module asks which strategy runs. What the FSDP
tutorials call auto-wrap policies, sharding strategies, mixed precision and CPU offload all map
onto `fully_shard` arguments here. Tensor parallelism (parallel.tp > 1) adds a "tp" dimension to the mesh
and applies the model family's tp_plan first; FSDP then shards over the data-parallel dimension.

Importing this module needs no torch (each function imports it where it runs): the config check
reads the plan's checks on a login node, as it reads the model families' specs.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.config import ConfigError, ParallelArgs

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.dist import Env
    from trainer.models import ModelArgs
    from trainer.models.family import Family


def dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name: float32, bfloat16, float16."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass(frozen=True)
class MemoryFactors:
    """What one rank holds under the plan, for trainer.memory's estimate and the changes it offers."""

    shards: int  # ranks one parameter (its gradient, its optimizer state) is split over (dp_shard x tp); 1: none
    tp: int  # tensor-parallel degree: a rank gathers, computes and keeps 1/tp of each block (1: none)
    gathers: bool  # units are all-gathered in the compute dtype and gradients reduce-scattered (FSDP)
    keeps_gathered: bool  # every unit stays all-gathered from forward to backward (FSDP's grad_op)
    bucket_copy: bool  # DDP over more than one rank: its gradient buckets are a second copy of the gradients
    can_offload: bool  # parallel.cpu_offload would apply (FSDP)
    node_shards: bool  # hybrid sharding over fewer ranks than the world: sharding=full would shard finer
    finer_per_node: bool  # more ranks per node shard finer (FSDP without a fixed shard_size)
    finer_with_nodes: bool  # more nodes shard finer (FSDP over the whole world)
    # under accumulation FSDP reduce-scatters every micro-batch: the gradients held are the sharded ones
    # (parallel.grad_sync=every_micro_batch); else unsharded until the last micro-batch
    sharded_accumulation: bool = False


@dataclass(eq=False)
class Plan:
    """The parallel plan of one run (torchtitan's ParallelDims), built once: `Plan.of(args, env)` in
    the trainer, `Plan(args, world_size)` for the arithmetic alone (the config check, the memory
    estimate, tests), which needs no process group. Data parallelism is `dp_replicate x dp_shard`
    ranks: FSDP shards over dp_shard (all ranks, or hybrid's groups) and replicates over
    dp_replicate; DDP replicates over all. `tp` (parallel.tp) ranks of one node split each block's
    matmuls and share their samples: the data-parallel size is the world over tp."""

    args: ParallelArgs
    world_size: int
    rank: int = 0
    ranks_per_node: int | None = None  # hybrid's default shard group; None: LOCAL_WORLD_SIZE, else the world
    device: Any = "cpu"  # a torch.device or its name: where the parameters live

    @classmethod
    def of(cls, args: ParallelArgs, env: Env) -> Plan:
        return cls(args, env.world_size, env.rank, env.local_world_size, env.device)

    # -- dimensions ---------------------------------------------------------------------------------

    @property
    def strategy(self) -> str:
        """The strategy's name, for the line that says what trains."""
        return self.args.strategy

    @property
    def fsdp(self) -> bool:
        return self.args.strategy == "fsdp"

    @property
    def hybrid(self) -> bool:
        return self.fsdp and self.args.sharding == "hybrid"

    @property
    def shard_size(self) -> int:
        """Hybrid sharding's group: parallel.shard_size, else the ranks of one node."""
        return self.args.shard_size or self.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    @property
    def tp(self) -> int:
        """Tensor-parallel degree: ranks that split each block's matmuls (1: none)."""
        return self.args.tp

    @property
    def dp_size(self) -> int:
        """Ranks that take different samples: the global batch is divided over them."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's place among them (the tensor-parallel ranks of one group share samples)."""
        return self.rank // self.tp

    @property
    def dp_shard(self) -> int:
        """Ranks one parameter is sharded over (1: not sharded)."""
        if not self.fsdp:
            return 1
        return self.shard_size if self.hybrid else self.dp_size

    @property
    def dp_replicate(self) -> int:
        """Copies of each shard (DDP: of the whole model)."""
        return self.dp_size // self.dp_shard

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The device mesh, made on first use (it needs the process group). Named as torchtitan names
        them: "dp_shard" (FSDP's), "dp_replicate" under hybrid sharding, and "tp" innermost once
        tp > 1, so that the tensor-parallel ranks of a group are consecutive: the ranks of one node."""
        from torch.distributed.device_mesh import init_device_mesh

        device_type = self._device_type
        if self.hybrid:
            shape, names = (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard")
        elif self.tp > 1:
            shape, names = (self.dp_size, self.tp), ("dp_shard", "tp")
        else:
            shape, names = (self.dp_size,), ("dp_shard",)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """What FSDP shards over: the mesh without its "tp" dimension."""
        return self.mesh["dp_shard"] if self.tp > 1 else self.mesh

    @property
    def _device_type(self) -> str:
        return getattr(self.device, "type", str(self.device).split(":")[0])

    # -- checks -------------------------------------------------------------------------------------

    def problems(self, model: ModelArgs | None = None) -> list[tuple[str, str]]:
        """What is wrong with the parallel config for this world: (key, message), in the order the
        config check says them (trainer.check.validate raises the first, blamed on its source).
        `model`: the resolved model keys, for what tensor parallelism needs of the model."""
        p, found = self.args, []
        if p.strategy != "fsdp" and p.cpu_offload:
            found.append(("parallel.cpu_offload", f"needs parallel.strategy=fsdp (it is {p.strategy})"))
        if self.hybrid and self.world_size % self.shard_size:
            found.append(
                (
                    "parallel.shard_size",
                    f"{self.shard_size} does not divide the {self.world_size} processes; choose a divisor",
                )
            )
        if p.strategy == "none" and self.world_size > 1:
            found.append(("parallel.strategy", f"is 'none' but {self.world_size} processes run; use fsdp or ddp"))
        if self.tp > 1:
            found += self._tp_problems(model)
        return found

    def _tp_problems(self, model: ModelArgs | None) -> list[tuple[str, str]]:
        """What tensor parallelism (tp > 1) cannot run with: the layout, the options it does not
        compose with, and, given the resolved model keys, a family or shape it cannot split."""
        p, tp, found = self.args, self.tp, []
        if p.strategy != "fsdp":
            found.append(("parallel.tp", f"is {tp} but needs parallel.strategy=fsdp (it is {p.strategy}); set tp=1"))
        # its ranks talk at every layer, so they share a node (NVLink): tp divides the ranks of one node
        # (ranks_per_node; else torchrun's LOCAL_WORLD_SIZE, where the trainer runs under it)
        node = self.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        if node and node % tp:
            found.append(
                (
                    "parallel.tp",
                    f"{tp} does not divide the {node} processes (GPUs) of a node; tensor parallelism stays inside "
                    f"a node: choose a divisor of {node}",
                )
            )
        elif self.world_size % tp:
            found.append(("parallel.tp", f"{tp} does not divide the {self.world_size} processes; choose a divisor"))
        for key, on in (
            ("sharding", p.sharding == "hybrid"),
            ("cpu_offload", p.cpu_offload),
            ("float8", p.float8 != "none"),
        ):
            if on:
                found.append(
                    (f"parallel.{key}", f"does not compose with parallel.tp={tp} (not built); use one of them")
                )
        if model is None:
            return found
        from trainer.models import spec

        if spec(model).tp_plan is None:
            found.append(("parallel.tp", f"is {tp} but model {model.name!r} has no tensor-parallel plan; set tp=1"))
            return found
        for key, why in (
            ("n_heads", "attention heads"),
            ("n_kv_heads", "key/value heads"),
            ("ffn_dim", "feed-forward units"),
            ("seq_len", "positions (sequence parallelism)"),
        ):
            value = getattr(model, key, None)
            if isinstance(value, int) and value % tp:
                found.append(
                    (f"model.{key}", f"{value} {why} do not split over parallel.tp={tp}; use a multiple of {tp}")
                )
        for key in ("tie_embeddings", "qk_norm"):
            if getattr(model, key, False):
                found.append((f"model.{key}", f"does not compose with parallel.tp={tp} (not built); use one of them"))
        return found

    def check(self, where: str = "config", model: ModelArgs | None = None) -> None:
        """Raise ConfigError with the first problem, one line: where, key, what to do."""
        for key, message in self.problems(model):
            raise ConfigError(f"{where}: {key}: {message}")

    def memory_factors(self) -> MemoryFactors:
        p = self.args
        return MemoryFactors(
            shards=self.dp_shard * self.tp,
            tp=self.tp,
            gathers=self.fsdp,
            keeps_gathered=self.fsdp and p.sharding == "grad_op",
            bucket_copy=p.strategy == "ddp" and self.world_size > 1,
            can_offload=self.fsdp,
            node_shards=self.hybrid and self.dp_shard < self.dp_size,
            finer_per_node=self.fsdp and not p.shard_size,
            finer_with_nodes=self.fsdp and not self.hybrid,
            sharded_accumulation=self.fsdp and p.grad_sync == "every_micro_batch",
        )

    # -- training -----------------------------------------------------------------------------------

    def autocast_dtype(self, model: nn.Module) -> torch.dtype | None:
        """The dtype to run the forward under torch.autocast, or None.

        FSDP casts its parameters itself. DDP and plain training use autocast instead, and so does
        FSDP for models with BatchNorm: its running statistics stay float32, which the CPU kernels
        refuse to mix with bfloat16 parameters (FSDP1 kept BatchNorm in float32 for the same reason).
        """
        import torch

        compute = dtype(self.args.param_dtype)
        if compute == torch.float32 or (self.fsdp and not has_batchnorm(model)):
            return None
        return compute

    def autocast(self, compute_dtype: torch.dtype | None):
        """Lower-precision compute where FSDP does not cast itself (`compute_dtype`: autocast_dtype's)."""
        import torch

        return torch.autocast(self._device_type, dtype=compute_dtype) if compute_dtype else contextlib.nullcontext()

    def grad_sync(self, model: nn.Module, micro: int, accum: int):
        """The gradient reduction of micro-batch `micro` of `accum` (parallel.grad_sync, resolved:
        trainer.memory.choose_grad_sync). last_micro_batch: none before the last (FSDP's gradients stay
        unsharded, DDP's no_sync). every_micro_batch (FSDP): a reduce-scatter each micro-batch, FSDP2
        adding it into the sharded gradient; hybrid sharding all-reduces across its replicas at the last
        only (torchtitan's set_requires_all_reduce). Without accumulation there is nothing to do: the
        reduction is on by default (FSDP's setters walk every module)."""
        if accum == 1:
            return contextlib.nullcontext()
        last_micro = micro == accum - 1
        if self.fsdp and self.args.grad_sync == "every_micro_batch":
            if micro == 0:
                model.set_requires_gradient_sync(True)
            if self.hybrid:
                model.set_requires_all_reduce(last_micro)
        elif self.fsdp:
            model.set_requires_gradient_sync(last_micro)
        elif self.args.strategy == "ddp" and not last_micro:
            return model.no_sync()
        return contextlib.nullcontext()

    def loss_parallel(self):
        """Where the loss and its backward run: under tensor parallelism the head's logits stay sharded
        over the vocabulary and cross-entropy is computed on them as they are (torch's loss_parallel)."""
        if self.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def scaler(self):
        """Loss scaling, needed for float16 compute only (None otherwise)."""
        import torch

        if self.args.param_dtype != "float16":
            return None
        if self.fsdp:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self._device_type, init_scale=self.args.loss_scale)
        return torch.amp.GradScaler(self._device_type, init_scale=self.args.loss_scale)

    def apply(self, model: nn.Module, family: Family) -> nn.Module:
        """Wrap `model` for the configured strategy; parameters end up on the plan's device. The
        model family's repeated units (`family.blocks`) are what per-block wrapping, activation
        checkpointing and compile take one by one."""
        import torch

        args, device = self.args, self.device
        if self.tp > 1:  # first, as torchtitan: checkpointing, compile and FSDP see the DTensor blocks
            if family.tp_plan is None:
                raise ConfigError(f"parallel.tp: is {self.tp} but this model has no tensor-parallel plan; set tp=1")
            family.tp_plan(model, self.mesh["tp"])
        if args.float8 != "none":  # first, as torchtitan: compile, checkpointing and FSDP see the float8 layers
            from trainer import float8

            float8.convert(model, args, family.blocks, fsdp_ranks=self.dp_shard if self.fsdp else 0)
        units = units_of(model, args, family.blocks)
        if args.ac_mode != "none":
            # The wrappers become the FSDP units (torchtitan's order): FSDP's pre-forward hook casts the
            # block's float inputs (the RoPE tables) to param_dtype outside the checkpointed region, so
            # the recompute sees the dtypes the forward saved. Sharded inside the wrapper, torch < 2.13
            # skips that cast in the recompute (pytorch#150140) and raises CheckpointError at step 1.
            units = checkpoint_units(model, units, args)
        if args.compile:  # after checkpointing, as torchtitan: dynamo traces the checkpoint and its policy
            for unit in units:
                unit.compile()
        if args.strategy == "none":
            return model.to_empty(device=device) if _on_meta(model) else model.to(device)
        if args.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = model.to_empty(device=device) if _on_meta(model) else model.to(device)
            return DistributedDataParallel(model, device_ids=[device.index] if self._device_type == "cuda" else None)

        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        param_dtype = torch.float32 if has_batchnorm(model) else dtype(args.param_dtype)  # see autocast_dtype
        options = dict(
            mesh=self.dp_mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=dtype(args.reduce_dtype)),
            offload_policy=CPUOffloadPolicy(pin_memory=self._device_type == "cuda")
            if args.cpu_offload
            else OffloadPolicy(),
            reshard_after_forward=args.sharding != "grad_op",
        )
        for unit in units:
            fully_shard(unit, **options)
        # The root's parameters (embeddings, head) are needed right after the last block's backward:
        # keeping them unsharded after forward saves one all-gather, as torchtitan does.
        fully_shard(model, **{**options, "reshard_after_forward": False})
        if _on_meta(model):  # fully_shard moved real tensors already; meta ones get storage now
            model.to_empty(device="cpu" if args.cpu_offload else device)
            if args.cpu_offload:  # FSDP offloads the parameters only: buffers (RoPE tables) stay where compute is
                _buffers_to(model, device)
        return model


def has_batchnorm(model: nn.Module) -> bool:
    from trainer.torch_compat import batch_norm_base

    return any(isinstance(m, batch_norm_base()) for m in model.modules())


# A model family's repeated units of a built model (trainer.models.Family.blocks).
Blocks = Callable[["nn.Module"], list["nn.Module"]]


def wrap_units(model: nn.Module, args: ParallelArgs, blocks: Blocks) -> list[nn.Module]:
    """The submodules that become their own FSDP unit (the root is always one more)."""
    if args.wrap == "block":
        return blocks(model)
    # Size policy, like size_based_auto_wrap_policy: post-order, wrap a module once the
    # parameters under it that are not yet wrapped reach the threshold.
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        pending = sum(visit(child) for child in module.children())
        pending += sum(p.numel() for p in module.parameters(recurse=False))
        if module is not model and pending >= args.wrap_min_params:
            units.append(module)
            return 0
        return pending

    visit(model)
    return units


def units_of(model: nn.Module, args: ParallelArgs, blocks: Blocks) -> list[nn.Module]:
    """What activation checkpointing and torch.compile wrap one by one: the FSDP units under FSDP,
    else the model's blocks."""
    return wrap_units(model, args, blocks) if args.strategy == "fsdp" else blocks(model)


def average_batchnorm_stats(model: nn.Module) -> None:
    """Make every BatchNorm's running mean and variance the mean over all ranks.

    FSDP shards parameters, not buffers: each rank's running statistics follow its own batches and
    drift apart (15% after 20 steps of a ResNet), so evaluation and a checkpoint (which keeps one
    rank's copy) would depend on the rank. The trainer calls this before both. The mean of the
    variances leaves out the spread of the ranks' means, as SyncBatchNorm's running statistics do
    not; num_batches_tracked is the same on every rank (every rank takes every step)."""
    import torch
    import torch.distributed as dist

    from trainer.torch_compat import batch_norm_base

    stats = [
        buffer
        for m in model.modules()
        if isinstance(m, batch_norm_base()) and m.running_mean is not None
        for buffer in (m.running_mean, m.running_var)
    ]
    if not stats or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        flat = torch.cat([s.flatten().double() for s in stats])
        dist.all_reduce(flat)  # gloo has no AVG
        flat /= dist.get_world_size()
        for s, mean in zip(stats, flat.split([s.numel() for s in stats])):
            s.copy_(mean.view_as(s))


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))  # a registered buffer stays one


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def checkpoint_units(model: nn.Module, units: list[nn.Module], args: ParallelArgs | None = None) -> list[nn.Module]:
    """Replace units by checkpoint-wrapped ones, in place in their parents, as `args` says
    (activation_checkpointing and selective_ac; None: full): every unit, in full or with the
    operator policy (`selective_policy`), or every selective_ac-th unit in full (torchtitan counts
    from 1: with 2, the second, fourth, ...). The units with the wrappers in their place, in order.
    State-dict keys do not change: the wrapper's hooks (and DCP) drop its
    `_checkpoint_wrapped_module.` prefix."""
    from trainer.torch_compat import checkpoint_wrapper

    mode, option = (args.ac_mode, args.selective_ac) if args else ("full", "op")
    by_op = mode == "selective" and option == "op"
    every = option if mode == "selective" and not by_op else 1
    targets = {id(u) for i, u in enumerate(units) if (i + 1) % every == 0}
    wrapped: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                wrapped[id(child)] = checkpoint_wrapper(child, selective_context if by_op else None)
                parent.register_module(name, wrapped[id(child)])
    return [wrapped.get(id(u), u) for u in units]


def _saved_ops() -> set:
    """What selective checkpointing by operator keeps (torchtitan's _save_list): the matmuls' outputs
    (every other mm: `selective_policy`), the attention kernels' (the CPU's flash kernel too, so that
    the CPU runs what a GPU does), tensor parallelism's reduce-scatters, and float8's: its scaled
    matmul and the abs-max its scales come from."""
    import torch

    from trainer.torch_compat import reduce_scatter_op

    aten, names = (
        torch.ops.aten,
        (
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_mm",
            "max",
        ),
    )
    ops = {aten.mm.default, reduce_scatter_op()}
    return ops | {getattr(aten, name).default for name in names if hasattr(aten, name)}


def selective_policy(counts: dict):
    """torchtitan's operator policy: keep the outputs of the ops of `_saved_ops`, but recompute every
    second matmul (those with an even count in this forward, or in its recompute: torch < 2.14 asks
    again there); recompute every other op. `counts`: one forward's matmuls, by phase."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    saved, mm = _saved_ops(), torch.ops.aten.mm.default

    def policy(ctx, func, *args, **kwargs):
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[phase] += 1
        keep = func in saved and not (func == mm and counts[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context():
    """The context_fn of a block's checkpoint wrapper: torch's create_selective_checkpoint_contexts
    with the operator policy, its matmul counts new for each forward."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy(collections.Counter()))


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model under a DDP wrapper (FSDP2 wraps in place)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
