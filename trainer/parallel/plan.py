"""How the model is spread over the ranks: FSDP2 (`fully_shard`), DDP as the baseline, or nothing.

`Plan` is the one object that knows: built once from `ParallelArgs` and the environment, it holds
the run's named degrees (`dims`: dp_replicate, dp_shard, cp, tp, pp; trainer/parallel/dims.py),
owns the device mesh built from them, says this rank's data-parallel rank and size, wraps the model
(`apply`: the config in, the wrapped model out), runs one micro-batch's forward and backward
(`forward_backward`: a pipeline schedule's step under pipeline parallelism), and answers what differs between the
strategies: `no_sync`, the grad scaler, autocast, the config's checks and what one rank holds
(`memory_factors`). Nothing outside this module asks which strategy runs.

Each technique is a file of its own, as torchtitan's distributed/: pipeline parallelism
(trainer/parallel/pp.py), tensor parallelism (trainer/parallel/tp.py), activation checkpointing
(trainer/parallel/activation_checkpointing.py), FSDP (trainer/parallel/fsdp.py), float8
(trainer/parallel/float8.py). `apply` composes them in one order, torchtitan's: the pipeline stage cut,
tp, float8, activation checkpointing, compile, then FSDP over the wrapped units (then the stage's
schedule).

Importing this module needs no torch (each function imports it where it runs): the config check
reads the plan's checks on a login node, as it reads the model families' specs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.config import ConfigError, ParallelArgs
from trainer.parallel import activation_checkpointing
from trainer.parallel import fsdp as parallel_fsdp
from trainer.parallel import pp as parallel_pp
from trainer.parallel import tp as parallel_tp
from trainer.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.dist import Env
    from trainer.models import ModelArgs
    from trainer.models.family import Family
    from trainer.parallel.fsdp import Blocks


def dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name: float32, bfloat16, float16."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass(frozen=True)
class MemoryFactors:
    """What one rank holds under the plan, for trainer.preflight.memory's estimate and the changes it offers."""

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
    # pipeline parallelism: a rank holds 1/pp of the blocks, and the root's parameters at most (the
    # activations its schedule keeps in flight: trainer/parallel/pp_plan.py)
    pp: int = 1


@dataclass(eq=False)
class Plan:
    """The parallel plan of one run, built once: `Plan.of(args, env)` in the trainer, `Plan(args,
    world_size)` for the arithmetic alone (the config check, the memory estimate, tests), which
    needs no process group. Its degrees (`dims`) are derived once: data parallelism is
    `dp_replicate x dp_shard` ranks: FSDP shards over dp_shard (all ranks, or hybrid's groups) and
    replicates over dp_replicate; DDP replicates over all. `tp` (parallel.tp) ranks of one node
    split each block's matmuls and share their samples: the data-parallel size is the world over tp."""

    args: ParallelArgs
    world_size: int
    rank: int = 0
    ranks_per_node: int | None = None  # hybrid's default shard group; None: LOCAL_WORLD_SIZE, else the world
    device: Any = "cpu"  # a torch.device or its name: where the parameters live
    # this rank's pipeline stage and its schedule, set by `apply` under pipeline parallelism (pp > 1)
    pipeline: parallel_pp.Pipeline | None = None

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

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """The run's named degrees (hybrid's groups: parallel.shard_size, else the ranks of one node)."""
        return ParallelDims.of(self.args, self.world_size, self.ranks_per_node)

    @property
    def tp(self) -> int:
        """Tensor-parallel degree: ranks that split each block's matmuls (1: none)."""
        return self.dims.tp

    @property
    def pp(self) -> int:
        """Pipeline-parallel degree: stages of consecutive blocks (1: none)."""
        return self.dims.pp

    @property
    def pp_microbatches(self) -> int:
        """Pipeline micro-batches per forward/backward (1 without a pipeline)."""
        return parallel_pp.microbatches(self.args)

    @property
    def stages_line(self) -> str:
        """This rank's pipeline stages, for the line that says what trains: "stage 0 of 2", "stages 0, 3 of 4"."""
        stages = parallel_pp.local_stages(self.args, self.dims.pp_rank(self.rank))
        total = self.pp * parallel_pp.stages_per_rank(self.args)
        return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} of {total}"

    @property
    def loss_ranks(self) -> int:
        """Ranks that hold a loss, whose sum over the world the logged mean divides: every rank, or
        the last pipeline stage's (the world over pp)."""
        return self.world_size // self.pp

    @property
    def dp_size(self) -> int:
        """Ranks that take different samples: the global batch is divided over them."""
        return self.dims.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's place among them (the tensor-parallel ranks of one group share samples)."""
        return self.dims.dp_rank(self.rank)

    @property
    def dp_shard(self) -> int:
        """Ranks one parameter is sharded over (1: not sharded)."""
        return self.dims.dp_shard

    @property
    def dp_replicate(self) -> int:
        """Copies of each shard (DDP: of the whole model)."""
        return self.dims.dp_replicate

    @property
    def fsdp_ranks(self) -> int:
        """Ranks FSDP shards a parameter over, 0 without FSDP: what float8 asks."""
        return self.dp_shard if self.fsdp else 0

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The device mesh of the degrees (`dims.mesh_dims`), made on first use (it needs the
        process group): "dp_shard" under FSDP, "dp_replicate" outside it under hybrid sharding (and
        DDP), and "tp" innermost once tp > 1, so that the tensor-parallel ranks of a group are
        consecutive: the ranks of one node."""
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.dims.mesh_dims()
        return init_device_mesh(self._device_type, shape, mesh_dim_names=names)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """What FSDP shards over: the mesh's data-parallel dimensions (the mesh without "tp")."""
        dp = self.dims.dp_dims()
        return self.mesh if dp == self.mesh.mesh_dim_names else self.mesh[dp]

    @property
    def _device_type(self) -> str:
        return getattr(self.device, "type", str(self.device).split(":")[0])

    # -- checks -------------------------------------------------------------------------------------

    def problems(self, model: ModelArgs | None = None) -> list[tuple[str, str]]:
        """What is wrong with the parallel config for this world: (key, message), in the order the
        config check says them (trainer.preflight.check.validate raises the first, blamed on its source).
        `model`: the resolved model keys, for what tensor, pipeline and context parallelism need of the model."""
        p, found = self.args, []
        if p.strategy != "fsdp" and p.cpu_offload:
            found.append(("parallel.cpu_offload", f"needs parallel.strategy=fsdp (it is {p.strategy})"))
        dp = self.world_size // self.dims.non_data_parallel_size  # the data-parallel ranks hybrid's groups split
        if self.hybrid and dp % self.dp_shard:
            ranks = f"{self.world_size} processes"
            if dp != self.world_size:
                split = " x ".join(
                    f"{k}={n}" for k, n in (("pp", self.pp), ("cp", self.dims.cp), ("tp", self.tp)) if n > 1
                )
                ranks = f"{dp} data-parallel ranks (the {self.world_size} processes over {split})"
            found.append(("parallel.shard_size", f"{self.dp_shard} does not divide the {ranks}; choose a divisor"))
        if p.strategy == "none" and self.world_size > 1:
            found.append(("parallel.strategy", f"is 'none' but {self.world_size} processes run; use fsdp or ddp"))
        if self.tp > 1:
            node = self.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0))  # under torchrun
            found += parallel_tp.problems(p, self.world_size, node, model)
        if self.pp > 1:
            found += parallel_pp.problems(p, self.world_size, model)
        return found + self.dims.problems(getattr(model, "seq_len", None), p.strategy)

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
            keeps_gathered=self.fsdp and (p.sharding == "grad_op" or parallel_pp.keeps_gathered(p)),
            bucket_copy=p.strategy == "ddp" and self.world_size > 1,
            can_offload=self.fsdp,
            node_shards=self.hybrid and self.dp_shard < self.dp_size,
            finer_per_node=self.fsdp and not p.shard_size,
            finer_with_nodes=self.fsdp and not self.hybrid,
            # under a pipeline the stage's schedule reduce-scatters at the end of each of its steps
            sharded_accumulation=self.fsdp and (p.grad_sync == "every_micro_batch" or self.pp > 1),
            pp=self.pp,
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
        """The gradient reduction of micro-batch `micro` of `accum`: FSDP's as parallel.grad_sync says
        (trainer/parallel/fsdp.py); DDP's at the last micro-batch (no_sync before it)."""
        if self.fsdp:
            every = self.args.grad_sync == "every_micro_batch"
            return parallel_fsdp.grad_sync(model, micro, accum, every_micro_batch=every, hybrid=self.hybrid)
        if self.args.strategy == "ddp" and micro < accum - 1:
            return model.no_sync()
        return contextlib.nullcontext()

    def loss_parallel(self):
        """Where the loss and its backward run (under tp: on vocabulary-sharded logits)."""
        return parallel_tp.loss_parallel(self.tp)

    def forward_backward(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_fn: Callable,
        *,
        micro: int,
        accum: int,
        compute_dtype: torch.dtype | None = None,
        scaler=None,
        grad_scale: float = 1.0,
    ) -> torch.Tensor:
        """One micro-batch (`micro` of `accum`) through the model and back: the forward under autocast
        (`compute_dtype`: autocast_dtype's), the loss divided by `accum`, the backward of it times
        `grad_scale` (through `scaler`, where float16 scales the loss), gradients reduced as
        `grad_sync` says. The loss, detached (under tp a replicated DTensor).

        Under pipeline parallelism `x` and `y` are pp_microbatches micro-batches, which the stage's
        schedule runs through the stages (`forward_backward_pipeline`)."""
        if self.pipeline is not None:
            return self.forward_backward_pipeline(x, y, loss_fn, accum, compute_dtype, grad_scale)
        with self.grad_sync(model, micro, accum), self.loss_parallel():
            with self.autocast(compute_dtype):
                loss = loss_fn(model(x), y) / accum
            grad_loss = loss * grad_scale if grad_scale != 1 else loss
            scaler.scale(grad_loss).backward() if scaler else grad_loss.backward()
        return loss.detach()

    def forward_backward_pipeline(self, x, y, loss_fn, accum, compute_dtype, grad_scale) -> torch.Tensor:
        """forward_backward through the pipeline: the schedule's step over its m micro-batches, each
        micro-batch's loss divided by accum x m (so the gradients are those of the mean over the batch,
        as without a pipeline) and multiplied by `grad_scale`. FSDP reduce-scatters the stage's gradients
        at the end of the step (the schedule's), accumulating over the steps of one optimizer step. The
        loss, detached: the batch's mean / accum on the last stage, 0 on the others (`loss_ranks`)."""
        import torch

        def loss(output, target):
            value = loss_fn(output, target) / (accum * self.pipeline.n_microbatches)
            return value * grad_scale if grad_scale != 1 else value

        with self.autocast(compute_dtype), self.loss_parallel():
            losses = self.pipeline.step(x, y, loss)
        if not losses:
            return torch.zeros((), device=x.device)
        total = torch.stack(losses).sum().detach()
        return total / grad_scale if grad_scale != 1 else total

    def forward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The model's output for `x`, forward only (evaluation): through the pipeline's stages under
        pipeline parallelism, where only the last stage has it (None on the others)."""
        if self.pipeline is not None:
            return self.pipeline.forward(x, y)
        return model(x)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients to the global norm `max_norm`: over every parameter of the model, every
        pipeline stage's too. The norm (a DTensor under FSDP without a pipeline)."""
        import torch

        if self.pipeline is None:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return parallel_pp.clip_grad_norm(list(model.parameters()), max_norm, self.mesh["pp"].get_group())

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
        checkpointing and compile take one by one.

        Under pipeline parallelism each of this rank's stages (parallel_pp.local_stages) is cut first,
        as torchtitan does, and wrapped on its own (every technique below sees one stage, and FSDP
        makes each its own root, as torchtitan's model parts); with several stages a rank, `model`
        then holds all of them under the whole model's names (parallel_pp.merge)."""
        if self.pp == 1:
            return self._wrap(model, family)
        if family.pp_split is None:
            raise ConfigError(f"parallel.pp: is {self.pp} but this model has no pipeline split; set pp=1")
        stages = parallel_pp.local_stages(self.args, self.dims.pp_rank(self.rank))
        total = self.pp * parallel_pp.stages_per_rank(self.args)
        parts = [self._wrap(part, family) for part in parallel_pp.cut(model, family.pp_split, stages, total)]
        if len(parts) > 1:
            parallel_pp.merge(model, parts)
        else:
            model = parts[0]
        self.pipeline = parallel_pp.Pipeline(parts, stages, total, self.args, self.device, self.mesh["pp"].get_group())
        return model

    def _wrap(self, model: nn.Module, family: Family) -> nn.Module:
        """`apply`'s techniques on one module (the model, or a pipeline stage), in torchtitan's order."""
        import torch

        args, device = self.args, self.device
        if self.tp > 1:  # as torchtitan: checkpointing, compile and FSDP see the DTensor blocks
            parallel_tp.apply_tp(model, family, self.mesh["tp"])
        if args.float8 != "none":  # first, as torchtitan: compile, checkpointing and FSDP see the float8 layers
            from trainer.parallel import float8

            float8.convert(model, args, family.blocks, fsdp_ranks=self.fsdp_ranks)
        units = units_of(model, args, family.blocks)
        if args.ac_mode != "none":
            # The wrappers become the FSDP units (torchtitan's order): FSDP's pre-forward hook casts the
            # block's float inputs (the RoPE tables) to param_dtype outside the checkpointed region, so
            # the recompute sees the dtypes the forward saved. Sharded inside the wrapper, torch < 2.13
            # skips that cast in the recompute (pytorch#150140) and raises CheckpointError at step 1.
            units = activation_checkpointing.checkpoint_units(model, units, args)
        if args.compile:  # after checkpointing, as torchtitan: dynamo traces the checkpoint and its policy
            for unit in units:
                unit.compile()
        if args.strategy == "none":
            return model.to_empty(device=device) if parallel_fsdp.on_meta(model) else model.to(device)
        if args.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = model.to_empty(device=device) if parallel_fsdp.on_meta(model) else model.to(device)
            return DistributedDataParallel(model, device_ids=[device.index] if self._device_type == "cuda" else None)
        return parallel_fsdp.apply_fsdp(
            model,
            units,
            self.dp_mesh,
            param_dtype=torch.float32 if has_batchnorm(model) else dtype(args.param_dtype),  # see autocast_dtype
            reduce_dtype=dtype(args.reduce_dtype),
            cpu_offload=args.cpu_offload,
            reshard_after_forward=args.sharding != "grad_op" and not parallel_pp.keeps_gathered(args),
            device=device,
        )


def has_batchnorm(model: nn.Module) -> bool:
    from trainer.torch_compat import batch_norm_base

    return any(isinstance(m, batch_norm_base()) for m in model.modules())


def units_of(model: nn.Module, args: ParallelArgs, blocks: Blocks) -> list[nn.Module]:
    """What activation checkpointing and torch.compile wrap one by one: the FSDP units under FSDP,
    else the model's blocks."""
    return parallel_fsdp.wrap_units(model, args, blocks) if args.strategy == "fsdp" else blocks(model)


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


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model under a DDP wrapper (FSDP2 wraps in place)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
