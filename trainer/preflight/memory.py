"""How much memory one rank needs, estimated without allocating anything (the model runs on the meta
device), and how much a machine or a GPU has: the memory preflight of `trainer.check` and
`trainer.submit` (issue #18).

The estimate of one rank's peak, by part (`estimate`):

* parameters, gradients, optimizer state: float32, each rank holding 1/S of them under FSDP (S: the
  ranks a parameter is sharded over: all of them for full and grad_op, `shard_size` for hybrid), all
  of them under DDP and without a strategy. With CPU offload they live in host memory (`host`).
* unsharded: what FSDP all-gathers, in the compute dtype (param_dtype): the root's parameters
  (embeddings, head: kept unsharded from forward to backward), the largest unit being computed and
  the next one, prefetched; grad_op keeps every unit unsharded between forward and backward.
  Without FSDP under bfloat16/float16: autocast's low-precision copies of the weights.
* reduce buffers: the unsharded gradients of the largest unit before reduce-scatter (in the compute
  dtype, plus a copy in reduce_dtype when it differs); DDP's gradient buckets (a second copy of the
  gradients).
* activations: the memory one micro-batch adds at the highest point of forward, loss and backward:
  what autograd saves for backward, plus what backward holds at once beside it (the float32 gradient
  of the logits at its start, the gradients flowing back through a block). Measured by running the
  model on the meta device with every storage's bytes counted until it is freed, attention counted as
  the fused kernels (flash, memory-efficient, CPU flash) keep it: q, k, v, output and log-sum-exp, not
  the seq x seq scores. On a GPU RMSNorm is counted as its fused CUDA kernel keeps it (input and
  a float32 rstd); on the CPU, and on the meta device unless told, torch runs its composite, which
  saves float32 copies of a bfloat16 input: counting those on a GPU was the estimate's 17-28% excess
  in eager bfloat16 (#33). With activation checkpointing the blocks are wrapped as the trainer wraps
  them (full; selective by operator, or every Nth block: parallel.selective_ac), so their
  recomputation in backward is measured too, each mode on its own. Compiled runs: COMPILED_ACTIVATIONS of it.
* tensor parallelism (parallel.tp > 1): parameters, gradients and optimizer state are split over
  dp_shard x tp ranks, and what is all-gathered, reduced or accumulated is 1/tp of each unit. Of the
  activations, tp splits each block's (heads and the MLP's hidden units; with sequence parallelism the
  norms and the residual stream along the sequence), and the logits and their float32 gradient over
  the vocabulary (loss parallel): 1/tp of what is measured on one rank. Not split: the sequence
  all-gathered before the attention's and the MLP's column-wise projections, which they keep for
  backward, two block inputs (`Profile.block_input`) per block: every block's without activation
  checkpointing, the one block being recomputed with it. Those count whole.
* pipeline parallelism (parallel.pp > 1): a rank holds one stage: 1/pp of the blocks' parameters and,
  counted on every stage, the root's (the first stage's embedding, the last's norm and head); of the
  activations 1/pp of one sample's (the blocks' share), for as many micro-batches as the first stage
  holds at once (1F1B: pp, GPipe: all of them). Approximate: the last stage's logits are not split.
* pipeline schedules: the micro-batches in flight on the first stage are the schedule's
  (trainer/parallel/pp_plan.py: 1F1B pp, GPipe all, interleaved 1F1B pp + (pp-1)/v, ...), each 1/pp of
  a sample's activations; it may be a fraction of a stage's micro-batch (interleaved chunks are 1/v).
* context parallelism (parallel.cp > 1, planned: every start refuses it): FSDP shards over dp_shard x
  cp, so the state is as without it; every activation is 1/cp (the sequence split), plus the ring's
  buffers while one block's attention runs (cp_ring_bytes: the whole sequence's keys and values,
  all-gathered, and float32 partial results of the rank's own queries).
* gradients at the peak: the peak is at the start of backward. Without gradient accumulation none
  exist then (set to None after each step; backward makes them as it frees the activations), so
  they count only where they outgrow the activations. With accumulation the earlier micro-batches'
  gradients are held through the last one's backward: parallel.grad_sync=every_micro_batch, as
  float32 shards (1/S: each micro-batch's are reduce-scattered into them); last_micro_batch (and auto
  until the preflight decides it: choose_grad_sync), under FSDP unsharded, every parameter's, in
  reduce_dtype (FSDP2 reduces nothing while gradient sync is off).
* overhead: on a GPU the caching allocator's, ALLOCATOR_OVERHEAD of the above, and the CUDA context
  with NCCL's buffers, CUDA_CONTEXT_BYTES; on the CPU the freed blocks glibc keeps,
  CPU_ALLOCATOR_OVERHEAD, and the process itself, CPU_PROCESS_BYTES (see there for the sources).

Left out: a kernel's workspace (cuBLAS, the optimizer's foreach temporaries), DataLoader workers,
pinned host buffers, torch.compile's caches. bench/memory_calibration.py compares what is allocated
(the estimate without its overhead) with measured peaks.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass

import torch

from trainer import torch_compat
from trainer.parallel import pp as pipeline
from trainer.parallel import pp_plan
from trainer.parallel.plan import Plan
from trainer.parallel.plan import dtype as torch_dtype

# The one table of bytes per parameter, float32 throughout: the weight, its gradient, and the
# optimizer's state (Adam(W) and Adadelta keep two tensors, SGD one: its momentum buffer, none without
# momentum). A checkpoint holds the weight and the state (checkpoint_bytes: trainer/checkpoint/manager.py).
WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "adadelta": 8, "sgd": 4}


def checkpoint_bytes(optimizer: str) -> int:
    """Bytes a checkpoint holds per parameter with optimizer `optimizer`: the weight and the state."""
    return WEIGHT_BYTES + OPTIMIZER_BYTES[optimizer]


# The CUDA caching allocator reserves more than it hands out: blocks are rounded (512 B, 2 MB
# segments) and freed blocks fragment. 10% of what is allocated is the usual reserved/allocated
# ratio of steady training loops; an assumption until bench/memory_calibration.py --device cuda
# has measured it (it records max_memory_reserved / max_memory_allocated).
ALLOCATOR_OVERHEAD = 0.10
# The CUDA context (kernels of torch, cuBLAS, cuDNN loaded: 0.3-0.5 GB on an H100 with torch 2.x) and
# NCCL's communicator buffers, outside torch's allocator: counted as 0.5 GB, the figure nvidia-smi
# shows for a process that has only initialised CUDA and NCCL.
CUDA_CONTEXT_BYTES = 500 * 2**20
# On the CPU, glibc's allocator keeps freed blocks in its heap (its mmap threshold grows with the
# blocks freed), and the process itself holds Python, torch and gloo: measured 2026-11-24 with
# bench/memory_calibration.py, peak RSS beyond the process was 1.38x what was allocated (1.67 GB
# against 1.21 GB with glibc's threshold fixed; small model, 16 samples of 512), the process 0.75 GB.
CPU_ALLOCATOR_OVERHEAD = 0.40
CPU_PROCESS_BYTES = 750 * 10**6
# torch.compile (parallel.compile=true) keeps fewer activations than eager: it fuses element-wise ops
# and recomputes cheap ones in backward, and the compiled loss keeps no float32 copy of the logits.
# Measured: the 1b model, bf16, seq 2048, compiled, one GPU, no accumulation: 8 sequences on an H100
# allocated at most 36.8 GB (2026-11-26, bench/results/2026-11-26-h100-memory-calibration.json), 16 on
# an H200 60.0 GB (2026-11-23). Beyond the 14.1 GB of parameters, optimizer state and gathered weights
# that is 2.84 and 2.87 GB per sequence, 0.72 of the 3.96 GB `measure` finds for eager on a GPU.
COMPILED_ACTIVATIONS = 0.72
# Memory of the GPUs Slurm names in gres (gpu:<type>:<count>), in MiB as nvidia-smi reports it for
# each card (what torch's total_memory says, divided by 2**20). Lower case; a site's own names need
# GPU_MEM_GB (--gpu-mem-gb).
GPU_MEMORY_MIB = {
    "h200": 143771,
    "gh200": 97871,
    "h100-nvl": 95830,
    "h100nvl": 95830,
    "h100-94gb": 95830,
    "h100": 81559,
    "h100-80gb": 81559,
    "a100-80gb": 81920,
    "a100_80gb": 81920,
    "a100-sxm4-80gb": 81920,
    "a100": 40960,
    "a100-40gb": 40960,
    "a100_40gb": 40960,
    "l40s": 46068,
    "l40": 46068,
    "a40": 46068,
    "a10": 23028,
    "a10g": 23028,
    "l4": 23034,
    "v100": 16384,
    "v100-32gb": 32768,
    "v100_32gb": 32768,
    "rtx6000": 24576,
    "rtx8000": 49152,
    "a6000": 49140,
    "t4": 15360,
    "b200": 183359,
}


@dataclass(frozen=True)
class Profile:
    """What the estimate needs to know of a model, measured once on the meta device."""

    params: int  # parameters in all
    root_params: int  # parameters in no FSDP unit: the root's (embeddings, final norm, head)
    largest_unit: int  # parameters of the largest FSDP unit (a block)
    activations: int  # bytes autograd saves for one sample, in the compute dtype
    activations_checkpointed: int  # the same with full activation checkpointing of the blocks
    compute_dtype: torch.dtype  # what FSDP all-gathers and computes in (float32 for BatchNorm models)
    blocks: int = 0  # the model's repeated blocks (family.blocks)
    block_input: int = 0  # bytes of one block's input for one sample (the LM: seq_len x dim), compute dtype
    activations_selective: int = 0  # the same with selective checkpointing (the config's parallel.selective_ac)

    def per_sample(self, mode: str) -> int:
        """One sample's activation bytes under activation_checkpointing `mode` (none, full, selective)."""
        return {"none": self.activations, "full": self.activations_checkpointed}.get(mode, self.activations_selective)


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank holds at its peak while it trains, by part (see the module's docstring)."""

    parameters: int
    gradients: int
    optimizer: int
    unsharded: int
    reduce_buffers: int
    activations: int  # what one micro-batch keeps for backward
    activations_per_sample: int  # the same for one sample, to size the micro-batch
    overhead: int = 0  # GPU only: the allocator's overhead and the CUDA context
    host: int = 0  # moved to host memory by CPU offload (not in total)
    notes: dict = dataclasses.field(default_factory=dict, compare=False)  # part -> how it was counted

    PARTS = ("parameters", "gradients", "optimizer", "unsharded", "reduce_buffers", "activations", "overhead")

    @property
    def total(self) -> int:
        return sum(getattr(self, part) for part in self.PARTS)

    def breakdown(self, indent: str = "  ") -> str:
        """One line per part: name, GB, how it was counted."""
        lines = [
            f"{indent}{part.replace('_', ' '):<15} {gb(getattr(self, part)):>9}  {self.notes.get(part, '')}".rstrip()
            for part in self.PARTS
        ]
        if self.host:
            lines.append(f"{indent}{'(host memory)':<15} {gb(self.host):>9}  {self.notes.get('host', '')}")
        lines.append(f"{indent}{'total':<15} {gb(self.total):>9}  per rank")
        return "\n".join(lines)


# measure()'s profiles in this process, by what they depend on: a check measures the same model again
# for each target and each change it offers, and each forward and backward on the meta device takes
# seconds for an 8B model.
_PROFILES: dict[tuple, tuple[object, Profile]] = {}
_PROFILES_KEPT = 16


def measure(cfg, gpu: bool = False) -> Profile:
    """Build the model on the meta device and count: its parameters and FSDP units, and the
    activation memory of one sample (`_activation_peak`), without and with activation checkpointing;
    `gpu`: with the kernels a GPU runs (RMSNorm fused), else the CPU's. Measured once per process for
    the same family, model keys, parallel keys and `gpu`."""
    from trainer import models

    family = models.spec(cfg.model)
    # The family by identity (a user's family may be replaced under the same name); the sections by
    # their repr: every field, nested ones included, as they are now.
    key = (id(family), repr(cfg.model), repr(cfg.parallel), gpu)
    held = _PROFILES.get(key)
    if held is not None and held[0] is family:
        return held[1]
    profile = _measure(family, cfg, gpu)
    if len(_PROFILES) >= _PROFILES_KEPT:
        _PROFILES.pop(next(iter(_PROFILES)))
    _PROFILES[key] = (family, profile)
    return profile


def _measure(family, cfg, gpu: bool) -> Profile:
    from trainer.parallel import activation_checkpointing
    from trainer.parallel import fsdp as parallel_fsdp
    from trainer.parallel import plan as parallel

    with torch.device("meta"):
        model = family.build(cfg.model)
    batchnorm = parallel.has_batchnorm(model)
    dtype = torch.float32 if batchnorm else torch_dtype(cfg.parallel.param_dtype)
    units = parallel_fsdp.wrap_units(model, cfg.parallel, family.blocks)
    in_units = {id(p) for u in units for p in u.parameters()}
    plain = _activation_peak(model.to(dtype), cfg.model, dtype, gpu)
    checkpointed = {}
    for mode in ("full", "selective"):  # the blocks wrapped as the trainer wraps them (selective: its option)
        with torch.device("meta"):
            wrapped = family.build(cfg.model).to(dtype)
        args = dataclasses.replace(cfg.parallel, activation_checkpointing=mode)
        activation_checkpointing.checkpoint_units(wrapped, parallel.units_of(wrapped, args, family.blocks), args)
        checkpointed[mode] = _activation_peak(wrapped, cfg.model, dtype, gpu)
    blocks = family.blocks(model)
    return Profile(
        params=sum(p.numel() for p in model.parameters()),
        root_params=sum(p.numel() for p in model.parameters() if id(p) not in in_units),
        largest_unit=max((sum(p.numel() for p in u.parameters()) for u in units), default=0),
        activations=plain,
        activations_checkpointed=checkpointed["full"],
        activations_selective=checkpointed["selective"],
        compute_dtype=dtype,
        blocks=len(blocks),
        block_input=_block_input_bytes(model, blocks, cfg.model, dtype) if blocks else 0,
    )


def _block_input_bytes(model, blocks, m, dtype: torch.dtype) -> int:
    """Bytes of the first block's input (its first tensor argument) for one sample: one forward of
    two samples (BatchNorm refuses one value per channel) on the meta device, no autograd."""
    seen = []
    hook = blocks[0].register_forward_pre_hook(lambda _, args: seen.extend(args[:1]))
    try:
        with torch.no_grad():
            model(_inputs(m, dtype, 2)[0])
    finally:
        hook.remove()
    first = seen[0] if seen else None  # a block called with keywords only: not known, counted as 0
    return first.numel() * first.element_size() // 2 if isinstance(first, torch.Tensor) else 0


def tp_activations(per_sample: int, pr: Profile, tp: int, parallel_args) -> int:
    """One sample's activation bytes on one of `tp` tensor-parallel ranks, from what one rank keeps
    without tensor parallelism (`per_sample`): 1/tp of it, but the all-gathered inputs of each
    block's attention and MLP count whole (see the module's docstring): every block's that keeps
    its activations, and the one being recomputed (`parallel_args`: how the blocks are checkpointed;
    the operator policy keeps matmul outputs, not the gathered inputs, which it recomputes)."""
    if tp == 1:
        return per_sample
    gathered = min(per_sample, 2 * pr.block_input * kept_block_inputs(pr.blocks, parallel_args))
    return (per_sample - gathered) // tp + gathered


def cp_ring_bytes(m, pr: Profile, cp: int, tp: int) -> int:
    """Bytes one sample adds on a rank of `cp` context-parallel ranks while one block's attention runs
    (torch's context_parallel, its default rotate method allgather): the keys and values of the whole
    sequence all-gathered (2 x seq x the keys' width, which grouped-query attention makes n_kv_heads /
    n_heads of dim), and the float32 partial output its merger keeps and the float32 gradient of its
    queries (2 x seq/cp x dim x 4 bytes); 1/tp of it under tensor parallelism (the heads split)."""
    if not pr.block_input:
        return 0
    heads, kv_heads = getattr(m, "n_heads", None), getattr(m, "n_kv_heads", None)
    kv = kv_heads / heads if heads and kv_heads else 1.0
    whole = pr.block_input  # seq x dim, the compute dtype
    return int(2 * whole * kv + 2 * whole // cp * 4 // pr.compute_dtype.itemsize) // tp


def kept_block_inputs(blocks: int, parallel_args) -> int:
    """Blocks whose inputs are alive at once in backward: all without checkpointing, the one being
    recomputed with it, and with every Nth block checkpointed the others and that one."""
    mode, option = parallel_args.ac_mode, parallel_args.selective_ac
    if mode == "none":
        return blocks
    if mode == "selective" and option != "op":
        return blocks - blocks // option + 1
    return 1


def ac_words(parallel_args) -> str:
    """How the blocks are checkpointed, in words."""
    mode, option = parallel_args.ac_mode, parallel_args.selective_ac
    if mode == "none":
        return "without activation checkpointing"
    if mode == "full":
        return "with full activation checkpointing"
    if option == "op":
        return "with selective activation checkpointing (matmul and attention outputs kept, the rest recomputed)"
    return f"with every {option}th block checkpointed (selective_ac={option})"


def _activation_peak(model, m, dtype: torch.dtype, gpu: bool = False) -> int:
    """Bytes per sample of the highest point, over forward, loss and backward, of the memory held
    beside the parameters: what autograd saves plus what is alive at once in backward (the float32
    gradient of the logits at its start, the gradients flowing back through a block). Measured on the
    meta device, for 2 and for 4 samples (BatchNorm refuses one value per channel): the difference
    is what samples add, without what any batch holds (the parameters' gradients). `gpu`: RMSNorm as
    its fused CUDA kernel keeps it (torch dispatches rms_norm to it on CUDA, to its composite elsewhere)."""
    from trainer import models

    loss = models.spec(m).loss
    params = {torch_compat.storage_key(p.untyped_storage()) for p in model.parameters()}
    peaks = []
    real_sdpa, real_rms_norm = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.rms_norm
    torch.nn.functional.scaled_dot_product_attention = _fused_attention
    if gpu:
        torch.nn.functional.rms_norm = _fused_rms_norm
    # Each parameter's gradient is dropped once backward has made it: the gradients of a whole large
    # model (141 GB for 70B in bfloat16) outgrow its checkpointed activations, and the peak of both
    # batches was then the end of backward, where the difference is no sample's (70B: 3.9 GB a
    # sample with 40 or 80 layers, 12.0 with 16). The estimate counts gradients itself.
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in model.parameters() if p.requires_grad]
    try:
        for batch in (2, 4):
            model.zero_grad(set_to_none=True)
            x, y = _inputs(m, dtype, batch)
            with _LiveBytes(params) as live:
                loss(model(x), y).backward()
            peaks.append(live.peak)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real_sdpa
        torch.nn.functional.rms_norm = real_rms_norm
        for hook in hooks:
            hook.remove()
    model.zero_grad(set_to_none=True)
    return max(0, (peaks[1] - peaks[0]) // 2)


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


class _LiveBytes(torch_compat.dispatch_mode_base()):
    """Counts the bytes of the storages that operations create while it is active, until each is
    freed (a weak reference's callback), and their highest total (`peak`); `skip`: storages not
    to count (the parameters)."""

    def __init__(self, skip: set[int]):
        super().__init__()
        self.skip, self.alive, self.live, self.peak = skip, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch_compat.leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = torch_compat.storage_key(storage)
                if key not in self.skip and key not in self.alive:
                    self.live += storage.nbytes()
                    self.alive[key] = weakref.ref(storage, functools.partial(self._freed, key, storage.nbytes()))
        self.peak = max(self.peak, self.live)
        return out

    def _freed(self, key: int, nbytes: int, _ref) -> None:
        self.live -= nbytes
        self.alive.pop(key, None)


def _inputs(m, dtype: torch.dtype, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    from trainer import models

    family = models.spec(m)
    if family.kind == "lm":
        x = torch.zeros(batch, *family.input_shape(m), dtype=torch.long, device="meta")
        return x, x
    return (
        torch.zeros(batch, *family.input_shape(m), device="meta", dtype=dtype),
        torch.zeros(batch, dtype=torch.long, device="meta"),
    )


class _FusedAttention(torch.autograd.Function):
    """Attention as the fused kernels save it for backward: inputs, output and log-sum-exp (meta only)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # what the fused kernels' backward allocates: dq, dk, dv
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fused_attention(q, k, v, *args, **kwargs):
    return _FusedAttention.apply(q, k, v)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as CUDA's fused kernel (aten._fused_rms_norm) saves it for backward: its input and the
    float32 reciprocal RMS of each row, not the composite's float32 copies of the input (meta only)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):  # what the fused backward allocates: the input's and the weight's gradients
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight)


def _fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    return _FusedRMSNorm.apply(x, weight)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shard_count(cfg, world_size: int, ranks_per_node: int | None = None) -> int:
    """The ranks one parameter is sharded over."""
    return Plan(cfg.parallel, world_size, ranks_per_node=ranks_per_node).memory_factors().shards


def estimate(
    cfg,
    world_size: int,
    micro_batch: int,
    ranks_per_node: int | None = None,
    gpu: bool = False,
    profile: Profile | None = None,
) -> Estimate:
    """The peak memory of one rank training `cfg` on `world_size` ranks (`ranks_per_node` of them per
    node), `micro_batch` samples at a time; `gpu`: on a GPU (allocator and CUDA context added, CPU
    offload moves state to the host), else on the CPU. `profile`: measure(cfg, gpu), when known."""
    pr = profile or measure(cfg, gpu)
    plan = Plan(cfg.parallel, world_size, ranks_per_node=ranks_per_node)
    factors = plan.memory_factors()
    fsdp, s, tp = factors.gathers, factors.shards, factors.tp
    cp = plan.dims.cp  # context parallelism (planned): FSDP shards over dp_shard x cp, as torchtitan's
    s *= cp if fsdp else 1
    # What one rank computes with: under tensor parallelism 1/tp of every parameter (the norms' few
    # weights, replicated over tp, are left out), so 1/tp of what is gathered, reduced and accumulated.
    pp = factors.pp
    stage = (pr.params - pr.root_params) // pp + pr.root_params  # a stage's parameters (the root's counted whole)
    p, n, full = cfg.parallel, stage // tp, stage
    root_params, largest_unit = pr.root_params // tp, pr.largest_unit // tp
    b = pr.compute_dtype.itemsize
    state = OPTIMIZER_BYTES[cfg.optim.name] if cfg.optim.name != "sgd" or cfg.optim.momentum else 0
    notes = {}
    over = " x ".join([str(s // tp // cp)] + [f"{name} {n}" for name, n in (("cp", cp), ("tp", tp)) if n > 1])
    of = f"{full / 1e6:,.1f}M" + (f" (one of {pp} stages)" if pp > 1 else "")
    what = f"1/{s} of {of} (sharded over {over} ranks)" if s > 1 else f"all {of}"
    parameters, gradients, optimizer = WEIGHT_BYTES * full // s, GRADIENT_BYTES * full // s, state * full // s
    notes["parameters"] = f"float32, {what}"
    notes["gradients"] = f"float32, {what}, held through the next micro-batch's backward (accumulation)"
    notes["optimizer"] = f"{state} bytes per parameter ({cfg.optim.name}), {what}"
    if factors.keeps_gathered:
        unsharded = n * b
        notes["unsharded"] = f"every unit all-gathered in {_name(pr.compute_dtype)} from forward to backward (grad_op)"
    elif fsdp:
        split = f" (1/{tp} of each: tp)" if tp > 1 else ""
        unsharded = (root_params + 2 * largest_unit) * b
        notes["unsharded"] = (
            f"all-gathered in {_name(pr.compute_dtype)}: the root's {root_params / 1e6:,.1f}M + the largest "
            f"unit ({largest_unit / 1e6:,.1f}M) and the next one, prefetched{split}"
        )
    elif b < 4:
        unsharded = n * b
        notes["unsharded"] = f"autocast's {_name(pr.compute_dtype)} copies of the weights"
    else:
        unsharded = 0
        notes["unsharded"] = "none: no FSDP, float32"
    reduce_bytes = torch_dtype(p.reduce_dtype).itemsize
    if fsdp:
        reduce_buffers = largest_unit * (b + (reduce_bytes if reduce_bytes != b else 0))
        notes["reduce_buffers"] = "the largest unit's unsharded gradients before reduce-scatter"
    elif factors.bucket_copy:
        reduce_buffers = 4 * n
        notes["reduce_buffers"] = "DDP's gradient buckets (a copy of the gradients)"
    else:
        reduce_buffers = 0
        notes["reduce_buffers"] = "none"
    per_sample = tp_activations(pr.per_sample(p.ac_mode), pr, tp, p)
    if p.compile:
        per_sample = int(per_sample * COMPILED_ACTIVATIONS)
    per_sample //= pp  # a stage's blocks (1 without a pipeline)
    ring = 0
    if cp > 1:  # each rank keeps 1/cp of the sequence's activations, and the ring's buffers of one block
        per_sample //= cp
        ring = cp_ring_bytes(cfg.model, pr, cp, tp)
    held = pp_plan.in_flight(p)  # a stage's micro-batches in flight on the first stage (the schedule's)
    activations = int(per_sample * micro_batch * held) + ring * micro_batch
    offloaded = gpu and factors.can_offload and p.cpu_offload
    accumulating = accumulation(cfg, plan.dp_size, micro_batch) > 1
    if not accumulating and not offloaded:  # see the module's docstring: gradients at the peak
        gradients = max(0, gradients - activations)
        notes["gradients"] = (
            f"float32, {what}: made in backward as the activations are freed (no accumulation), "
            f"counted only beyond them"
        )
    flight = f"{float(held):g} micro-batches in flight x " if pp > 1 else ""
    ring_words = f", cp {cp} (1/{cp} of the sequence, and {gb(ring)} a sample of the ring's buffers)" if cp > 1 else ""
    notes["activations"] = (
        f"{flight}{micro_batch} sample(s) x {gb(per_sample)}{f' (1/{pp}: a stage)' if pp > 1 else ''}, {ac_words(p)}"
        f"{f', tp {tp} (the gathered block inputs whole, the rest 1/{tp})' if tp > 1 else ''}"
        f"{ring_words}"
        f"{f', compiled ({COMPILED_ACTIVATIONS:.0%} of eager)' if p.compile else ''}"
    )
    host = 0
    if offloaded:
        host = parameters + gradients + optimizer
        parameters = gradients = optimizer = 0
        notes["host"] = "parameters, gradients and optimizer state offloaded to host memory"
    if fsdp and accumulating and factors.sharded_accumulation:
        # parallel.grad_sync=every_micro_batch: each micro-batch's gradients are reduce-scattered (the
        # largest unit's unsharded ones in the reduce buffers) and added into the sharded float32 ones
        notes["gradients"] = (
            notes["gradients"]
            if offloaded
            else (
                f"float32, {what}: reduce-scattered every micro-batch and accumulated sharded "
                f"(grad_sync=every_micro_batch), held through the next micro-batch's backward"
            )
        )
    elif fsdp and accumulating:
        # FSDP2 without gradient sync (the trainer's set_requires_gradient_sync(False) on all but the
        # last micro-batch) keeps every unit's gradients unsharded on the device, in reduce_dtype
        # (FSDPParam.to_accumulated_grad_if_needed), until the last micro-batch's reduce-scatter.
        grad_bytes = reduce_bytes if reduce_bytes != b else b
        whole = f"all {n / 1e6:,.1f}M" if tp == 1 else f"the 1/{tp} (tp) of {full / 1e6:,.1f}M"
        gradients = n * grad_bytes
        notes["gradients"] = (
            f"{_name(torch_dtype(p.reduce_dtype)) if reduce_bytes != b else _name(pr.compute_dtype)}, "
            f"{whole} unsharded: FSDP keeps the micro-batches' gradients unsharded until the last one's "
            f"reduce-scatter (grad_sync=last_micro_batch; every_micro_batch keeps 1/{s})"
        )
    allocated = parameters + gradients + optimizer + unsharded + reduce_buffers + activations
    if gpu:
        overhead = int(ALLOCATOR_OVERHEAD * allocated) + CUDA_CONTEXT_BYTES
        notes["overhead"] = (
            f"the allocator's {ALLOCATOR_OVERHEAD:.0%} + the CUDA context and NCCL ({gb(CUDA_CONTEXT_BYTES)})"
        )
    else:
        overhead = int(CPU_ALLOCATOR_OVERHEAD * allocated) + CPU_PROCESS_BYTES
        notes["overhead"] = (
            f"freed blocks glibc keeps ({CPU_ALLOCATOR_OVERHEAD:.0%}) + the process itself "
            f"(Python, torch, gloo: {gb(CPU_PROCESS_BYTES)})"
        )
    return Estimate(
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        unsharded=unsharded,
        reduce_buffers=reduce_buffers,
        activations=activations,
        activations_per_sample=per_sample,
        overhead=overhead,
        host=host,
        notes=notes,
    )


def choose_grad_sync(
    cfg, world_size: int, micro_batch: int, ranks_per_node: int | None, have: int | None, gpu: bool, profile=None
) -> tuple:
    """(cfg with parallel.grad_sync=auto decided, the line that says why, or None where nothing was
    decided). auto: last_micro_batch (one reduce-scatter a step) where its estimate fits `have`
    bytes, else every_micro_batch (1/N of the gradients held, a reduce-scatter each micro-batch).
    Only FSDP with accumulation has a choice; elsewhere auto means last_micro_batch, which is then
    what happens (no accumulation: one reduction a step either way; DDP: no_sync), or is not asked (a
    pipeline's stages reduce-scatter at the end of each schedule step)."""
    p = cfg.parallel
    if p.grad_sync != "auto":
        return cfg, None
    last = _with(cfg, parallel={"grad_sync": "last_micro_batch"})
    plan = Plan(p, world_size, ranks_per_node=ranks_per_node)
    if not plan.fsdp or plan.pp > 1 or accumulation(cfg, plan.dp_size, micro_batch) == 1 or not have:
        return last, None  # a pipeline's stage reduce-scatters at the end of each of its schedule's steps
    need = estimate(last, world_size, micro_batch, ranks_per_node, gpu=gpu, profile=profile).total
    if need <= have:
        return last, (
            f"parallel.grad_sync=auto: last_micro_batch (one reduce-scatter a step): its estimate, "
            f"{gb(need)}, fits the {gb(have)}"
        )
    every = _with(cfg, parallel={"grad_sync": "every_micro_batch"})
    return every, (
        f"parallel.grad_sync=auto: every_micro_batch (gradients sharded, a reduce-scatter each micro-batch): "
        f"last_micro_batch would need about {gb(need)}, more than the {gb(have)}"
    )


def accumulation(cfg, dp_size: int, micro_batch: int) -> int:
    """Forward/backward passes per step on each rank (1: no gradient accumulation), the global batch
    divided over the `dp_size` data-parallel ranks (the world over parallel.tp x parallel.pp), each
    of the pipeline's micro-batches (1 without one) of `micro_batch` samples."""
    per_pass = max(1, micro_batch) * pipeline.microbatches(cfg.parallel)
    return max(1, cfg.train.global_batch_size // dp_size // per_pass)


def dp_size(cfg, world_size: int) -> int:
    """The ranks that take different samples: the world over parallel.tp (the plan's)."""
    return Plan(cfg.parallel, world_size).dp_size


def preflight(
    cfg,
    world_size: int,
    ranks_per_node: int,
    have: int,
    target: str,
    nodes: int = 1,
    nodes_option: str = "--nnodes {}",
    ranks_option: str | None = None,
) -> Estimate:
    """The estimate of one GPU's peak; raise ConfigError when it exceeds `have` bytes (`target` names
    them: "h100 (gres)", "GPU_MEM_GB=80") with one line: by how much, and each change that would make it
    fit, computed (`nodes_option` and `ranks_option` spell a node count and a count of ranks per node
    the way the caller's user gives them; no ranks_option: not offered)."""
    from trainer.config import ConfigError

    pr = measure(cfg, gpu=True)
    micro = pipeline.micro_batch(
        cfg.parallel, cfg.train.global_batch_size // dp_size(cfg, world_size), cfg.train.micro_batch_size
    )
    cfg, chosen = choose_grad_sync(cfg, world_size, micro, ranks_per_node, have, True, pr)
    need = estimate(cfg, world_size, micro, ranks_per_node, gpu=True, profile=pr)
    if chosen:
        need.notes["gradients"] += f" [{chosen}]"
    if need.total <= have:
        return need
    fixes = changes_that_fit(cfg, world_size, ranks_per_node, have, nodes, nodes_option, ranks_option, pr)
    todo = (
        ("it would fit with " + ", or ".join(fixes))
        if fixes
        else (
            "no single change (gradients reduced every micro-batch, activation checkpointing, a smaller "
            "micro-batch, CPU offload, full sharding, tensor parallelism, pipeline stages, more ranks per node, up "
            "to 16x the nodes) makes it fit: use a smaller model or GPUs with more memory"
        )
    )
    raise ConfigError(
        f"memory: one GPU needs about {gb(need.total)} (estimated: parameters, gradients, optimizer, "
        f"all-gathered units, activations of {micro} sample(s), allocator and CUDA context), "
        f"{gb(need.total - have)} more than the {gb(have)} of {target}; {todo}"
    )


def changes_that_fit(
    cfg,
    world_size: int,
    ranks_per_node: int,
    have: int,
    nodes: int = 1,
    nodes_option: str = "--nnodes {}",
    ranks_option: str | None = None,
    profile: Profile | None = None,
) -> list[str]:
    """Each single change not already made (gradients reduced every micro-batch, selective or full
    activation checkpointing, a smaller micro-batch, CPU offload, full sharding, more tensor
    parallelism, pipeline stages, more ranks per node, more nodes) after which the GPU estimate is at most `have`
    bytes, with that estimate: "parallel.activation_checkpointing=selective (41.2 GB)"."""
    from trainer import models

    pr = profile or measure(cfg, gpu=True)
    tp, batch = cfg.parallel.tp, cfg.train.global_batch_size
    per_rank = batch // dp_size(cfg, world_size)
    micro = pipeline.micro_batch(cfg.parallel, per_rank, cfg.train.micro_batch_size)
    staged = cfg.parallel.pp > 1  # what pipeline parallelism does not compose with is not offered
    fixes = []

    def fits(changed, world: int = world_size, mb: int = micro, rpn: int = ranks_per_node) -> int | None:
        changed, _ = choose_grad_sync(changed, world, mb, rpn, have, True, pr)  # auto decides for the change too
        e = estimate(changed, world, mb, rpn, gpu=True, profile=pr)
        return e.total if e.total <= have else None

    plan = Plan(cfg.parallel, world_size, ranks_per_node=ranks_per_node)
    p, factors = cfg.parallel, plan.memory_factors()
    if factors.gathers and not factors.sharded_accumulation and accumulation(cfg, plan.dp_size, micro) > 1:
        total = fits(_with(cfg, parallel={"grad_sync": "every_micro_batch"}))
        if total:
            fixes.append(f"parallel.grad_sync=every_micro_batch ({gb(total)}, a reduce-scatter each micro-batch)")
    # selective first: torchtitan's default for its large models, full recompute costs about a third more compute
    for mode in {"none": ("selective", "full"), "selective": ("full",)}.get(p.ac_mode, ()):
        total = fits(_with(cfg, parallel={"activation_checkpointing": mode}))
        if total:
            fixes.append(f"parallel.activation_checkpointing={mode} ({gb(total)})")
    per_micro = pipeline.microbatches(p)  # a micro-batch divides the rank's samples with the pipeline's others
    smaller = [m for m in range(micro - 1, 0, -1) if per_rank % (m * per_micro) == 0 and fits(cfg, mb=m)]
    if smaller:
        fixes.append(f"train.micro_batch_size={smaller[0]} ({gb(fits(cfg, mb=smaller[0]))})")
    if factors.can_offload and not p.cpu_offload and not staged:
        total = fits(_with(cfg, parallel={"cpu_offload": True}))
        if total:
            fixes.append(f"parallel.cpu_offload=true ({gb(total)}, slower)")
    if factors.node_shards:
        total = fits(_with(cfg, parallel={"sharding": "full"}))
        if total:
            fixes.append(f"parallel.sharding=full ({gb(total)})")
    if models.spec(cfg.model).tp_plan is not None and not staged:  # tp inside a node, where the family has a plan
        for more in (2, 4, 8):
            dp = world_size // (more * p.cp)  # the data-parallel ranks with it (cp's ranks share samples too)
            if more <= tp or ranks_per_node % more or not dp or batch % dp:
                continue
            # the same micro-batch where it is set; else each data-parallel rank's samples, tp times more
            total = fits(_with(cfg, parallel={"tp": more}), mb=cfg.train.micro_batch_size or batch // dp)
            if total:
                fixes.append(f"parallel.tp={more} ({gb(total)})")
                break
    if not staged:  # pipeline stages, where the family has a split and pp composes with the rest
        offer = _pp_that_fits(cfg, world_size, fits)
        if offer:
            fixes.append(offer)
    split = p.cp * tp * p.pp  # ranks that share one data-parallel rank's samples

    def micro_on(world: int) -> int:
        """The micro-batch on `world` ranks: 0 where the degrees do not divide them, or the global batch
        does not divide over their data-parallel ranks, or a rank's samples do not fill the pipeline's
        micro-batches (a pipeline of 2 stages on as many data-parallel ranks as samples was offered
        with micro-batches of 0 samples)."""
        dp = world // split if world % split == 0 else 0
        if not dp or batch % dp:
            return 0
        if p.pp > 1 and pipeline.batch_problem(p, batch // dp, cfg.train.micro_batch_size, ""):
            return 0
        return min(micro, batch // dp // pipeline.microbatches(p))

    if ranks_option and factors.finer_per_node:
        for rpn in (2, 4, 8):
            world = rpn * nodes
            if rpn <= ranks_per_node or rpn % tp or not micro_on(world):
                continue
            total = fits(cfg, world, micro_on(world), rpn)
            if total:
                fixes.append(f"{ranks_option.format(rpn)} ({gb(total)})")
                break
    if factors.finer_with_nodes:
        for more in range(nodes + 1, 16 * nodes + 1):
            world = more * ranks_per_node
            if not micro_on(world):
                continue
            total = fits(cfg, world, micro_on(world))
            if total:
                fixes.append(f"{nodes_option.format(more)} ({gb(total)})")
                break
    return fixes


def _pp_that_fits(cfg, world_size: int, fits) -> str | None:
    """The fewest pipeline stages (parallel.pp, the schedule as configured) after which `fits` says the
    config fits, as a change: "parallel.pp=2 (61.0 GB, 1f1b: a bubble of 33%)"; None where the family
    has no split, pp does not compose with the config (trainer/parallel/pp.py's problems: tp, offload,
    compile, ...), or no number of stages dividing its blocks and the ranks fits."""
    from trainer import models

    family = models.spec(cfg.model)
    if family.pp_split is None or family.pp_blocks is None:
        return None
    blocks, batch, micro_size = family.pp_blocks(cfg.model), cfg.train.global_batch_size, cfg.train.micro_batch_size
    for stages in range(2, blocks + 1):
        changed = _with(cfg, parallel={"pp": stages})
        if blocks % stages or pipeline.problems(changed.parallel, world_size, cfg.model):
            continue
        dp = Plan(changed.parallel, world_size).dp_size
        if batch % dp or pipeline.batch_problem(changed.parallel, batch // dp, micro_size, ""):
            continue
        total = fits(changed, mb=pipeline.micro_batch(changed.parallel, batch // dp, micro_size))
        if total:
            idle = float(pp_plan.bubble(changed.parallel)[1])
            return f"parallel.pp={stages} ({gb(total)}, {pp_plan.schedule(changed.parallel)}: a bubble of {idle:.0%})"
    return None


# Below this share of a GPU's memory an estimate fits with headroom; above it the planning output
# warns (fragmentation, a longer sequence, a kernel's workspace can take the rest).
HEADROOM = 0.90


def headroom_warning(
    cfg,
    world_size: int,
    ranks_per_node: int,
    have: int,
    need: Estimate,
    nodes: int = 1,
    nodes_option: str = "--nnodes {}",
    ranks_option: str | None = None,
) -> str | None:
    """One line when the estimate `need` (which fits) takes more than HEADROOM of `have`: how much is
    left, and the changes not already made that would leave the headroom; None otherwise."""
    if need.total <= HEADROOM * have:
        return None
    fixes = changes_that_fit(cfg, world_size, ranks_per_node, int(HEADROOM * have), nodes, nodes_option, ranks_option)
    todo = ("; it would leave that with " + ", or ".join(fixes)) if fixes else ""
    return (
        f"less than {1 - HEADROOM:.0%} headroom: the estimate is {need.total / have:.0%} of the GPU "
        f"({gb(have - need.total)} left of {gb(have)}), and fragmentation or a longer sequence can run out of "
        f"memory{todo}"
    )


def _with(cfg, **sections):
    """`cfg` with some keys of some sections replaced: _with(cfg, parallel={"cpu_offload": True})."""
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    )


def gpu_type_bytes(name: str) -> int | None:
    """Memory of a GPU type as Slurm's gres names it (h100, a100-80gb, ...), or None if unknown."""
    mib = GPU_MEMORY_MIB.get(name.lower())
    return mib * 2**20 if mib else None


def local_gpu_bytes() -> int | None:
    """The smallest memory of this machine's GPUs, or None without one (creates a CUDA context: never
    call it from the launcher)."""
    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def machine_bytes() -> int | None:
    """This machine's memory (MemTotal of /proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 or n == 0 else f"{n / 1e9:.3f} GB"
