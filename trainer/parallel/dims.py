"""The named degrees of a run's parallelism (torchtitan's `ParallelDims`): how many ranks each
dimension of the device mesh spans, derived once from the config's parallel section and the world.

    dp_replicate  copies of each parameter shard (DDP: of the whole model; hybrid sharding: its groups)
    dp_shard      ranks one parameter is sharded over (FSDP: all data-parallel ranks, hybrid: a group)
    cp            context parallelism: ranks that split each sequence (parallel.cp: planned, refused at start)
    tp            tensor parallelism: ranks of one node that split each block's matmuls (parallel.tp)
    pp            pipeline parallelism: stages that hold consecutive blocks (parallel.pp)

Their product is the world. The mesh's dimensions go outer to inner in torchtitan's order, pp,
dp_replicate, dp_shard, cp, tp: tp innermost, so that the ranks of a tensor-parallel group are
consecutive (one node's). A dimension of degree 1 is left out of the mesh, except the data-parallel
ones the strategy names (`named`): FSDP shards over "dp_shard" even on one rank, and hybrid
sharding's mesh is 2-D ("dp_replicate", "dp_shard") even with one group.

Torch-free: the config check reads the degrees on a login node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import ParallelArgs

# The mesh's dimensions, outer to inner.
ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DATA_PARALLEL = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one run: `ParallelDims.of(args, world_size)`. Where the config does not divide
    the world, the degrees are what integer division gives, and the plan's checks say why."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    named: tuple[str, ...] = ()  # dimensions the mesh has even at degree 1 (see the module's docstring)

    @classmethod
    def of(cls, args: ParallelArgs, world_size: int, ranks_per_node: int | None = None) -> ParallelDims:
        """The degrees of the parallel section `args` on `world_size` ranks. Hybrid sharding's groups
        are parallel.shard_size ranks, else the data-parallel ranks of one node's share of a stage:
        the node's ranks (`ranks_per_node`; else torchrun's LOCAL_WORLD_SIZE; else the world), at most
        a stage's (the world over pp), over cp x tp (the ranks inside a node that share samples)."""
        tp, pp, cp = args.tp, args.pp, getattr(args, "cp", 1)
        dp = world_size // (tp * pp * cp)
        if args.strategy != "fsdp":  # DDP, or one plain process: every rank holds the whole model
            return cls(world_size, dp_replicate=dp, cp=cp, tp=tp, pp=pp, named=("dp_replicate",))
        if args.sharding == "hybrid":
            node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            shard = args.shard_size or max(1, min(node, world_size // pp) // (cp * tp))
            return cls(world_size, dp_replicate=dp // shard, dp_shard=shard, cp=cp, tp=tp, pp=pp, named=DATA_PARALLEL)
        return cls(world_size, dp_shard=dp, cp=cp, tp=tp, pp=pp, named=("dp_shard",))

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one data-parallel rank's samples: cp x tp x pp."""
        return self.cp * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Ranks that take different samples: the global batch is divided over them."""
        return self.world_size // self.non_data_parallel_size

    def dp_rank(self, rank: int) -> int:
        """Rank `rank`'s place among them: the cp and tp ranks inside it share its samples, and each
        pipeline stage (outermost) holds every data-parallel rank once."""
        return rank % (self.world_size // self.pp) // (self.cp * self.tp)

    def pp_rank(self, rank: int) -> int:
        """Rank `rank`'s pipeline stage: the mesh's outermost coordinate."""
        return rank // (self.world_size // self.pp)

    def mesh_dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh's shape and dimension names, outer to inner."""
        dims = [(getattr(self, name), name) for name in ORDER if getattr(self, name) > 1 or name in self.named]
        return tuple(d for d, _ in dims), tuple(n for _, n in dims)

    def dp_dims(self) -> tuple[str, ...]:
        """The mesh's data-parallel dimensions: what FSDP shards (and hybrid replicates) over."""
        return tuple(name for name in self.mesh_dims()[1] if name in DATA_PARALLEL)

    def problems(self, seq_len: int | None = None, strategy: str = "fsdp") -> list[tuple[str, str]]:
        """What a planned context-parallel degree needs (key, message), as the plan's checks say them:
        FSDP (torchtitan shards over dp_shard x cp), cp x tp x pp dividing the world, and, given the
        model's `seq_len`, a sequence that splits into 2 x cp equal chunks (the head-tail load
        balancer of causal attention gives rank i chunks i and 2cp-1-i). That cp cannot run is said
        by every start (`not_built`), not here: make check plans with it."""
        if self.cp == 1:
            return []
        found = []
        if strategy != "fsdp":
            found.append(("parallel.cp", f"is {self.cp} but needs parallel.strategy=fsdp (it is {strategy}); set cp=1"))
        split = self.cp * self.tp * self.pp
        if self.world_size % split:
            of = " x ".join(f"{name}={n}" for name, n in (("cp", self.cp), ("tp", self.tp), ("pp", self.pp)) if n > 1)
            found.append(("parallel.cp", f"{of} does not divide the {self.world_size} processes; choose a divisor"))
        if seq_len is not None and seq_len % (2 * self.cp):
            found.append(
                (
                    "parallel.cp",
                    f"is {self.cp} but model.seq_len {seq_len} does not split into 2 x cp = {2 * self.cp} equal "
                    f"chunks (each rank takes two, one from each end, so causal attention's work is even); use a "
                    f"seq_len that is a multiple of {2 * self.cp}",
                )
            )
        return found


# Why a start refuses parallel.cp > 1 (docs/parallelism.md#context-parallelism says it in full).
CP_NOT_BUILT = (
    "is {cp} but context parallelism is planned, not built: make check estimates it, no start runs it (torch "
    "2.14's context_parallel rings only the CUDA attention kernels, flash, efficient and cuDNN, so nothing of it "
    "runs or is tested on CPU ranks here); set parallel.cp=1"
)


def not_built(cp: int) -> str | None:
    """The one line every start gives a context-parallel degree (parallel.cp > 1), or None."""
    return CP_NOT_BUILT.format(cp=cp) if cp > 1 else None
