"""ParallelDims: how a run's processes divide the work, built once and handed to everything that communicates.

    dp_replicate x dp_shard == world size

dp_replicate ranks hold whole copies of the model (DDP); dp_shard ranks each hold a slice of every parameter
(FSDP2). Today a run uses one of the two (`parallel=ddp` or `parallel=fsdp`); expert and context parallelism
arrive as further dimensions. Modules never ask torch.distributed who they are: the model's parallelize function,
Muon's distributed Newton-Schulz, Quantile Balancing's global quantiles, QK-Clip's max-logit reduction, the loaders,
the checkpointer and evaluation all take the group or rank they need from here. In one process every group is None
and nothing communicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

STRATEGIES = ("ddp", "fsdp")


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    rank: int = 0
    device_type: str = "cpu"
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_replicate > 1 and self.dp_shard > 1:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}: replicated shards (HSDP) are not "
                "supported yet; use parallel=ddp or parallel=fsdp"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @classmethod
    def for_strategy(cls, strategy: str, world_size: int, rank: int, device_type: str) -> ParallelDims:
        """All ranks data-parallel: replicas under DDP, shards under FSDP2."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown parallel strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if strategy == "fsdp":
            return cls(dp_shard=world_size, rank=rank, device_type=device_type)
        return cls(dp_replicate=world_size, rank=rank, device_type=device_type)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def several_ranks(self) -> bool:
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """Ranks that read different rows of the global batch."""
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel ranks (gradient, loss and balancing reductions), or None in one process."""
        return dist.group.WORLD if self.several_ranks else None

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh FSDP2 shards over (dp_shard); built on first use, a collective on every rank."""
        if self.dp_shard == 1:
            raise ValueError("no dp_shard dimension to shard over (dp_shard == 1)")
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        return self._mesh

    def describe(self) -> str:
        if not self.several_ranks:
            return "one process"
        if self.dp_shard > 1:
            return f"FSDP2 over {self.dp_shard} process(es)"
        return f"DDP over {self.dp_replicate} process(es)"
