"""Pipeline parallelism (parallel.pp > 1) with torch's own `torch.distributed.pipelining`, as torchtitan's
distributed/pipeline_parallel.py: the model family cuts the model into this rank's stage (its
`pp_split`: consecutive blocks under their whole-model names, the embedding on the first stage, the
norm and head on the last), FSDP shards the stage over its data-parallel ranks, and a schedule (GPipe
or 1F1B) runs `pp_microbatches` micro-batches through the stages per forward/backward of the loop:
the first stage reads the inputs, the last computes the loss. What it cannot run with is refused
before anything starts (`problems`). The plan (trainer/parallel/plan.py) cuts the stage first, wraps
it, and runs the schedule in `forward_backward`, the loop's one seam.

The batch: the global batch / data-parallel ranks = pipeline micro-batches (pp_microbatches) x
micro-batch (train.micro_batch_size, samples a stage runs at once) x accumulation steps.

Importing this module needs no torch (each function imports it where it runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.nn as nn

    from trainer.config import ParallelArgs
    from trainer.models import ModelArgs

# parallel.pp_schedule -> torch.distributed.pipelining's single-stage schedule class
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def microbatches(args: ParallelArgs) -> int:
    """Pipeline micro-batches per forward/backward of a rank: parallel.pp_microbatches, else pp (1
    without a pipeline)."""
    return (args.pp_microbatches or args.pp) if args.pp > 1 else 1


def micro_batch(args: ParallelArgs, per_rank: int, micro_batch_size: int | None) -> int:
    """Samples of one micro-batch (what a stage runs at once): train.micro_batch_size, else the
    `per_rank` samples of a data-parallel rank over the pipeline's micro-batches (all of them without
    a pipeline)."""
    return micro_batch_size or per_rank // microbatches(args)


def in_flight(args: ParallelArgs) -> int:
    """Micro-batches whose activations the first stage holds at once, its peak: GPipe runs every
    forward before any backward (all of them); 1F1B at most one a stage ahead (pp, or fewer micro-batches)."""
    m = microbatches(args)
    return m if args.pp_schedule == "gpipe" else min(args.pp, m)


def bubble(args: ParallelArgs) -> float:
    """The share of a step each stage idles, filling and draining the pipeline: (pp - 1) / (m + pp - 1)
    for GPipe and 1F1B alike (m: the micro-batches)."""
    return (args.pp - 1) / (microbatches(args) + args.pp - 1)


def problems(args: ParallelArgs, world_size: int, model: ModelArgs | None) -> list[tuple[str, str]]:
    """What pipeline parallelism (pp > 1) cannot run with: the layout, the schedule against the
    micro-batches, the options it does not compose with (not built), and, given the resolved model
    keys (`model`), a family without a split or blocks that do not split into pp stages."""
    pp, found = args.pp, []
    if args.strategy != "fsdp":
        found.append(("parallel.pp", f"is {pp} but needs parallel.strategy=fsdp (it is {args.strategy}); set pp=1"))
    if world_size % (pp * args.tp):
        of = f"{pp} stages" + (f" x parallel.tp={args.tp}" if args.tp > 1 else "")
        found.append(("parallel.pp", f"{of} do not divide the {world_size} processes; choose a divisor"))
    m = microbatches(args)
    if args.pp_schedule == "1f1b" and m < pp:
        found.append(
            (
                "parallel.pp_microbatches",
                f"{m} micro-batches do not fill the 1f1b schedule of parallel.pp={pp} stages: it needs at least "
                f"{pp} (or parallel.pp_schedule=gpipe)",
            )
        )
    for key, on in (
        ("tp", args.tp > 1),
        ("sharding", args.sharding == "hybrid"),
        ("cpu_offload", args.cpu_offload),
        ("compile", args.compile),
        ("float8", args.float8 != "none"),
        ("param_dtype", args.param_dtype == "float16"),  # loss scaling over the stages
    ):
        if on:
            found.append((f"parallel.{key}", f"does not compose with parallel.pp={pp} (not built); use one of them"))
    if model is None:
        return found
    from trainer.models import spec

    family = spec(model)
    if family.pp_split is None or family.pp_blocks is None:
        what = f"model.family {model.family!r}" if getattr(model, "family", None) else f"model {model.name!r}"
        found.append(("parallel.pp", f"is {pp} but {what} has no pipeline split; set pp=1"))
        return found
    blocks = family.pp_blocks(model)
    if blocks % pp:
        found.append(
            (
                "parallel.pp",
                f"{pp} stages do not split the model's {blocks} blocks (model.n_layers) evenly; choose a divisor "
                f"of {blocks}",
            )
        )
    if getattr(model, "tie_embeddings", False):
        found.append(("model.tie_embeddings", f"does not compose with parallel.pp={pp} (not built); use one of them"))
    return found


def batch_problem(args: ParallelArgs, per_rank: int, micro_batch_size: int | None, ranks: str) -> str | None:
    """Why the `per_rank` samples of a data-parallel rank (`ranks`: the line's divisor) do not split into
    the pipeline's micro-batches of micro_batch_size (None: per_rank / pp_microbatches), or None."""
    m = microbatches(args)
    if micro_batch_size is None and per_rank % m:
        return (
            f"the {per_rank} samples per rank ({ranks}) do not split into parallel.pp_microbatches={m} "
            f"micro-batches; use a multiple of {m} per rank"
        )
    if micro_batch_size is not None and per_rank % (m * micro_batch_size):
        return (
            f"the {per_rank} samples per rank ({ranks}) are not a multiple of parallel.pp_microbatches={m} x "
            f"train.micro_batch_size={micro_batch_size}; choose them so that {m * micro_batch_size} divides {per_rank}"
        )
    return None


class Pipeline:
    """This rank's stage of the pipeline and the schedule that runs it (torch.distributed.pipelining).
    `module`: the stage, wrapped (FSDP); `group`: the pipeline's process group (the mesh's "pp")."""

    def __init__(self, module: nn.Module, stage: int, stages: int, args: ParallelArgs, device, group):
        from torch.distributed import pipelining

        self.first, self.last, self.n_microbatches = stage == 0, stage == stages - 1, microbatches(args)
        self.stage = pipelining.PipelineStage(module, stage, stages, device, group=group)
        self._loss: Callable | None = None  # the current call's loss of (output, target)
        schedule = getattr(pipelining, SCHEDULES[args.pp_schedule])
        # scale_grads=False: the loss of each micro-batch is divided by the micro-batches itself, so
        # gradients accumulated over several steps of the schedule are not divided again
        self.schedule = schedule(self.stage, self.n_microbatches, loss_fn=self._loss_of, scale_grads=False)

    def _loss_of(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(output, target)

    def _inputs(self, x: torch.Tensor, y: torch.Tensor) -> tuple[tuple, dict]:
        """The schedule's arguments on this stage: the inputs on the first, the targets on the last."""
        return ((x,) if self.first else ()), ({"target": y} if self.last else {})

    def step(self, x: torch.Tensor, y: torch.Tensor, loss: Callable) -> list[torch.Tensor]:
        """One forward and backward of the batch `x` (targets `y`) in n_microbatches micro-batches:
        gradients accumulate into the stage's parameters (FSDP reduce-scatters them at the end);
        `loss(output, target)` is each micro-batch's, on the last stage. The micro-batches' losses
        on the last stage, [] on the others (`loss` is also called by the schedule's first step,
        which runs one micro-batch to learn the shapes between the stages: not among them)."""
        self._loss = loss
        args, kwargs = self._inputs(x, y)
        losses: list = []
        self.schedule.step(*args, **kwargs, losses=losses if self.last else None, return_outputs=False)
        return losses

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The model's output for the batch `x` on the last stage (None on the others), forward only
        (the schedule's eval: the same micro-batches and stages, no backward)."""
        self._loss = lambda output, target: output.new_zeros(())  # evaluation computes its own loss
        args, kwargs = self._inputs(x, y)
        return self.schedule.eval(*args, **kwargs)


def clip_grad_norm(parameters: list, max_norm: float, group) -> torch.Tensor:
    """Clip the gradients of this stage's `parameters` to the global norm `max_norm` over every stage
    (torchtitan's clip_grad_norm_ with a pp mesh): this stage's norm (over its FSDP shards), squared,
    summed over the pipeline's `group`. The norm, a plain tensor on every rank."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = norm**2
    dist.all_reduce(norm, group=group)
    norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
