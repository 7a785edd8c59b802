"""The named degrees of a run's parallelism (torchtitan's `ParallelDims`): how many ranks each
dimension of the device mesh spans, derived once from the config's parallel section and the world.

    dp_replicate  copies of each parameter shard (DDP: of the whole model; hybrid sharding: its groups)
    dp_shard      ranks one parameter is sharded over (FSDP: all data-parallel ranks, hybrid: a group)
    cp            context parallelism: ranks that split each sequence (not built: 1)
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
        are parallel.shard_size ranks, else one node's (`ranks_per_node`; else torchrun's
        LOCAL_WORLD_SIZE; else the world)."""
        tp, pp = args.tp, args.pp
        dp = world_size // (tp * pp)
        if args.strategy != "fsdp":  # DDP, or one plain process: every rank holds the whole model
            return cls(world_size, dp_replicate=dp, tp=tp, pp=pp, named=("dp_replicate",))
        if args.sharding == "hybrid":
            shard = args.shard_size or ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            return cls(world_size, dp_replicate=dp // shard, dp_shard=shard, tp=tp, pp=pp, named=DATA_PARALLEL)
        return cls(world_size, dp_shard=dp, tp=tp, pp=pp, named=("dp_shard",))

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

    def problems(self) -> list[tuple[str, str]]:
        """What is not built: (key, message), as the plan's checks say them. Context parallelism
        needs NCCL's ring attention on GPUs (gloo cannot run it)."""
        if self.cp > 1:
            return [("parallel.cp", f"is {self.cp} but context parallelism is not built; set cp=1")]
        return []
