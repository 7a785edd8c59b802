"""Pipeline parallelism (parallel.pp > 1) with torch's own `torch.distributed.pipelining`, as torchtitan's
distributed/pipeline_parallel.py: the model family cuts the model into stages (its `pp_split`:
consecutive blocks under their whole-model names, the embedding on the first stage, the norm and head
on the last), each rank holds `stages_per_rank` of them (`local_stages`), tensor parallelism splits
each stage's blocks and FSDP shards each stage over its data-parallel ranks, and a schedule runs
`pp_microbatches` micro-batches through the stages per forward/backward of the loop: the first stage
reads the inputs, the last computes the loss. What it cannot run with is refused before anything
starts (`problems`). The plan (trainer/parallel/plan.py) cuts the stages first, wraps them, and runs
the schedule in `forward_backward`, the loop's one seam.

The schedules (parallel.pp_schedule), torch's classes:

    gpipe             ScheduleGPipe: every forward, then every backward; one stage a rank
    1f1b              Schedule1F1B: one forward, one backward in the steady state; one stage a rank
    interleaved_1f1b  ScheduleInterleaved1F1B: several stages a rank, rank r holding r, r + pp, ...
                      (a smaller bubble: the pipeline fills a stage at a time)
    interleaved_zb    ScheduleInterleavedZeroBubble: interleaved_1f1b's stages, the backward split into
                      its input's and its weights' halves to fill the bubble
    zbv               ScheduleZBVZeroBubble: two stages a rank in a V (rank r holds r and 2 pp - 1 - r:
                      the first rank the embedding and the head), the backward split as interleaved_zb's

The zero-bubble schedules keep each stage's FSDP units gathered from forward to backward
(`keeps_gathered`).

The batch: the global batch / data-parallel ranks = pipeline micro-batches (pp_microbatches) x
micro-batch (train.micro_batch_size, samples a stage runs at once) x accumulation steps.

Importing this module needs no torch (each function imports it where it runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.config import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.nn as nn

    from trainer.config import ParallelArgs
    from trainer.models import ModelArgs

# parallel.pp_schedule -> torch.distributed.pipelining's schedule class
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
# the schedules that run several stages a rank (the others run one)
MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv")
# the zero-bubble schedules, which compute a stage's weight gradients in a pass of their own after its
# input's: FSDP keeps their units gathered from forward to backward (torchtitan's default under any
# pipeline); resharded after the forward, the weight pass of torch 2.14 lost their gradients (the
# losses left pp=1's at step 2)
SPLIT_BACKWARD = ("zbv", "interleaved_zb")


def stages_per_rank(args: ParallelArgs) -> int:
    """The stages a rank holds: parallel.pp_stages_per_rank, else 2 under a schedule of several
    stages a rank and 1 under the others (1 without a pipeline)."""
    if args.pp == 1:
        return 1
    return args.pp_stages_per_rank or (2 if args.pp_schedule in MULTI_STAGE else 1)


# torch 2.11's ZBV sends between the two stages of one rank over the process group, which gloo refuses
ZBV_TORCH = (
    "parallel.pp_schedule: zbv needs torch 2.14 or later on the CPU (torch {} sends between a rank's own two "
    "stages, which gloo refuses: 'Pair is not connected'); use interleaved_zb"
)


def _dtypes() -> tuple:
    import torch

    return (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _torch_before(major: int, minor: int) -> bool:
    import torch

    return tuple(int(part) for part in torch.__version__.split(".")[:2]) < (major, minor)


def keeps_gathered(args: ParallelArgs) -> bool:
    """Whether FSDP keeps the stages' units gathered from forward to backward (SPLIT_BACKWARD)."""
    return args.pp > 1 and args.pp_schedule in SPLIT_BACKWARD


def local_stages(args: ParallelArgs, pp_rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` holds, of pp x stages_per_rank: its own one (gpipe, 1f1b);
    pp_rank, pp_rank + pp, ... (interleaved_1f1b, interleaved_zb: the loop torch's stage-to-rank map
    assumes); pp_rank and 2 pp - 1 - pp_rank (zbv: the V, the first rank holding the first and the last
    stage)."""
    pp, v = args.pp, stages_per_rank(args)
    if args.pp_schedule == "zbv":
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(v))


def microbatches(args: ParallelArgs) -> int:
    """Pipeline micro-batches per forward/backward of a rank: parallel.pp_microbatches, else pp (1
    without a pipeline)."""
    return (args.pp_microbatches or args.pp) if args.pp > 1 else 1


def micro_batch(args: ParallelArgs, per_rank: int, micro_batch_size: int | None) -> int:
    """Samples of one micro-batch (what a stage runs at once): train.micro_batch_size, else the
    `per_rank` samples of a data-parallel rank over the pipeline's micro-batches (all of them without
    a pipeline)."""
    return micro_batch_size or per_rank // microbatches(args)


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
    m, v, schedule = microbatches(args), stages_per_rank(args), args.pp_schedule
    if schedule == "1f1b" and m < pp:
        found.append(
            (
                "parallel.pp_microbatches",
                f"{m} micro-batches do not fill the 1f1b schedule of parallel.pp={pp} stages: it needs at least "
                f"{pp} (or parallel.pp_schedule=gpipe)",
            )
        )
    rounds = max(1, m // pp)  # torch's: the interleaved schedule runs its micro-batches in rounds of pp
    if schedule in ("interleaved_1f1b", "interleaved_zb") and m % rounds:
        found.append(
            (
                "parallel.pp_microbatches",
                f"{m} micro-batches do not fit the {schedule} schedule of parallel.pp={pp} stages: it runs "
                f"them in {rounds} rounds of {m // rounds}; use a multiple of {pp} (or fewer than {pp})",
            )
        )
    if schedule not in MULTI_STAGE and v > 1:
        found.append(
            (
                "parallel.pp_stages_per_rank",
                f"is {v} but parallel.pp_schedule={schedule} runs one stage a rank; use interleaved_1f1b, "
                "interleaved_zb or zbv, or 1",
            )
        )
    if schedule == "zbv" and v != 2:
        found.append(
            ("parallel.pp_stages_per_rank", f"is {v} but parallel.pp_schedule=zbv runs 2 stages a rank (its V); set 2")
        )
    if schedule in SPLIT_BACKWARD and args.ac_mode == "selective" and args.selective_ac == "op":
        found.append(
            (
                "parallel.selective_ac",
                f"op does not compose with parallel.pp_schedule={schedule}: its weight pass goes back through a "
                "block a second time, which checkpointing by operator refuses; use an N, "
                "parallel.activation_checkpointing=full, or another schedule",
            )
        )
    for key, on in (
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
    if blocks % (pp * v) and v == 1:
        found.append(
            (
                "parallel.pp",
                f"{pp} stages do not split the model's {blocks} blocks (model.n_layers) evenly; choose a divisor "
                f"of {blocks}",
            )
        )
    elif blocks % (pp * v):
        found.append(
            (
                "parallel.pp_stages_per_rank",
                f"parallel.pp={pp} x {v} stages a rank do not split the model's {blocks} blocks (model.n_layers) "
                f"evenly; choose them so that pp x stages a rank divides {blocks}",
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


def cut(model: nn.Module, pp_split: Callable, stages: tuple[int, ...], total: int) -> list[nn.Module]:
    """This rank's `stages` of the `total`, each a module the schedule runs: one stage is `model`
    itself, cut in place by the family's `pp_split`; several are views of `model` (modules of its
    class sharing its submodules and buffers), each cut to its stage, which `merge` gathers back into
    `model` once they are wrapped."""
    if len(stages) == 1:
        pp_split(model, stages[0], total)
        return [model]
    from trainer import torch_compat

    views = []
    for stage in stages:
        view = torch_compat.module_view(model)
        pp_split(view, stage, total)  # reassigns the view's children, never changes the shared ones
        views.append(view)
    return views


def merge(model: nn.Module, views: list[nn.Module]) -> None:
    """Make `model` hold what its stages' `views` hold (as wrapped), under the whole model's names:
    each child a view has (a ModuleDict's entries gathered: every stage's blocks, by index), None
    where none has it; the root's buffers (the RoPE tables) one tensor each, shared with the views, so
    that the family's init_weights of `model` fills every stage's. The trainer's `model` (parameters,
    state dict, optimizer) is then this rank's every stage."""
    import torch.nn as nn

    for name in [name for name, _ in model.named_children()]:
        kept = [getattr(view, name) for view in views if getattr(view, name, None) is not None]
        if kept and isinstance(kept[0], nn.ModuleDict):
            entries = {key: module for d in kept for key, module in d.items()}
            order = sorted(entries, key=lambda key: int(key) if key.isdigit() else key)
            setattr(model, name, nn.ModuleDict({key: entries[key] for key in order}))
        elif len({id(module) for module in kept}) > 1:  # two stages' own modules under one name
            raise ValueError(
                f"pipeline stages hold different {name!r}: a family's pp_split keeps its blocks in a ModuleDict"
            )
        else:
            setattr(model, name, kept[0] if kept else None)  # a child's name: None keeps the name, holds nothing
    for name, buffer in views[0].named_buffers(recurse=False):
        setattr(model, name, buffer)  # a buffer's name: the buffer replaced, as persistent as it was
        for view in views[1:]:
            setattr(view, name, buffer)


class Pipeline:
    """This rank's stages of the pipeline and the schedule that runs them (torch.distributed.pipelining).
    `modules`: the stages `stages` of `total`, wrapped (FSDP); `group`: the pipeline's process group
    (the mesh's "pp")."""

    def __init__(self, modules: list, stages: tuple[int, ...], total: int, args: ParallelArgs, device, group):
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining

        if args.pp_schedule == "zbv" and torch.device(device).type == "cpu" and _torch_before(2, 14):
            raise ConfigError(ZBV_TORCH.format(torch.__version__))
        self.first, self.last, self.n_microbatches = 0 in stages, total - 1 in stages, microbatches(args)
        self.stages = [
            pipelining.PipelineStage(module, stage, total, device, group=group)
            for module, stage in zip(modules, stages)
        ]
        self._loss: Callable | None = None  # the current call's loss of (output, target)
        schedule = getattr(pipelining, SCHEDULES[args.pp_schedule])
        held = self.stages if args.pp_schedule in MULTI_STAGE else self.stages[0]
        # scale_grads=False: the loss of each micro-batch is divided by the micro-batches itself, so
        # gradients accumulated over several steps of the schedule are not divided again
        self.schedule = schedule(held, self.n_microbatches, loss_fn=self._loss_of, scale_grads=False)
        # for evaluation in stage order (`_forward_in_stage_order`): each stage's module and rank
        self.group, self.device, self.pp_rank = group, device, dist.get_rank(group)
        self.modules = dict(zip(stages, modules))
        self.owner = {stage: rank for rank in range(args.pp) for stage in local_stages(args, rank)}
        self.in_stage_order = args.pp_schedule == "zbv"

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
        """The model's output for the batch `x` on the last stage's rank (None on the others), forward only
        (the schedule's eval: the same micro-batches and stages, no backward). Under zbv the batch goes
        through the stages in their order (`_forward_in_stage_order`): torch 2.14's ZBV eval hands a
        backward between a rank's two stages that it did not run ("can't steal_bwd_input")."""
        if self.in_stage_order:
            return self._forward_in_stage_order(x)
        self._loss = lambda output, target: output.new_zeros(())  # evaluation computes its own loss
        args, kwargs = self._inputs(x, y)
        return self.schedule.eval(*args, **kwargs)

    def _forward_in_stage_order(self, x: torch.Tensor) -> torch.Tensor | None:
        """The whole batch `x` through stage 0, 1, ... in turn, each on its rank: a stage's output sent
        to the next stage's rank (its shape and dtype first), or kept where that rank is this one."""
        h = x if self.first else None
        for stage in range(len(self.owner)):
            before = self.owner.get(stage - 1, self.owner[stage])
            if self.owner[stage] == self.pp_rank:
                if before != self.pp_rank:
                    h = self._recv(before)
                h = self.modules[stage](h)
            elif before == self.pp_rank:
                self._send(h, self.owner[stage])
        return h if self.last else None

    def _send(self, tensor: torch.Tensor, rank: int) -> None:
        import torch
        import torch.distributed as dist

        dst = dist.get_global_rank(self.group, rank)
        meta = [_dtypes().index(tensor.dtype), tensor.dim(), *tensor.shape]
        dist.send(torch.tensor(meta + [0] * (8 - len(meta)), device=tensor.device), dst, group=self.group)
        dist.send(tensor.contiguous(), dst, group=self.group)

    def _recv(self, rank: int) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        src = dist.get_global_rank(self.group, rank)
        meta = torch.zeros(8, dtype=torch.int64, device=self.device)
        dist.recv(meta, src, group=self.group)
        code, ndim, *shape = meta.tolist()
        tensor = torch.empty(shape[:ndim], dtype=_dtypes()[code], device=self.device)
        dist.recv(tensor, src, group=self.group)
        return tensor


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
