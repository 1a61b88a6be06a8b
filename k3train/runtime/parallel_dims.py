"""ParallelDims: how a run's processes divide the work, built once and handed to everything that communicates.

    dp_replicate x dp_shard == world size;   ep and cp each divide it

The degrees, their rules and the sizes they imply are a ParallelLayout (k3train/runtime/parallel_layout.py), the
planner's too (k3train/plan/mesh.py); this adds the rank, the device and the meshes. dp_replicate ranks hold whole
copies of the model (DDP); dp_shard ranks each hold a slice of every parameter (FSDP2); both at once is HSDP
(`parallel=hsdp`, or parallel=fsdp with parallel.dp_replicate=R): R groups of world / R consecutive ranks, each group
sharding the whole model as FSDP2 does, its shards replicated across the groups (FSDP2 over the 2-D shard_mesh:
gradients reduce-scattered within a group, then all-reduced across the groups, torchtitan's HSDP).
ep (parallel.ep) splits the routed experts: groups of ep consecutive ranks each hold 1/ep of them and exchange
token slots (k3train/models/k3/moe/dispatch.py); the world / ep ranks holding the same experts (expert_dp) average those
experts' gradients: DDP keeps a whole copy of its share on each, FSDP2 shards it again over them.

    expert_mesh (ep, expert_dp), world 4, ep 2:   ep groups {0, 1} {2, 3};  expert_dp groups {0, 2} {1, 3}

cp (parallel.cp) splits each row's sequence: groups of cp consecutive ranks read the same rows and hold consecutive
slices of them (k3train/models/common/context_parallel.py); gradients and losses still average over every rank, each
rank's tokens being different ones. The other world / cp ranks read their own rows of the global batch.
Modules never ask torch.distributed who they are: the model's parallelize function,
Muon's distributed Newton-Schulz, Quantile Balancing's global quantiles, QK-Clip's max-logit reduction, the loaders,
the checkpointer and evaluation all take the group or rank they need from here. In one process every group is None
and nothing communicates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from k3train.runtime.parallel_layout import ParallelLayout

STRATEGIES = ("ddp", "fsdp")


class ParallelDims:
    """A run's ParallelLayout (the degrees, their rules and the sizes they imply), this rank, and the meshes and
    groups built from them on first use."""

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = 1,
        rank: int = 0,
        device_type: str = "cpu",
        ep: int = 1,
        cp: int = 1,
        pp: int = 1,
    ) -> None:
        self.layout = ParallelLayout(dp_replicate, dp_shard, ep, cp, pp)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        self.rank = rank
        self.device_type = device_type
        self._mesh: DeviceMesh | None = None
        self._cp_mesh: DeviceMesh | None = None
        self._expert_mesh: DeviceMesh | None = None
        self._expert_hsdp_mesh: DeviceMesh | None = None
        self._pp_mesh: DeviceMesh | None = None

    def __repr__(self) -> str:
        return f"ParallelDims({self.layout}, rank={self.rank}, device_type={self.device_type!r})"

    @classmethod
    def for_strategy(
        cls,
        strategy: str,
        world_size: int,
        rank: int,
        device_type: str,
        ep: int = 1,
        cp: int = 1,
        dp_replicate: int = 1,
        pp: int = 1,
    ) -> ParallelDims:
        """All ranks data-parallel: replicas under DDP, shards under FSDP2 (in dp_replicate replica groups: HSDP
        when > 1); routed experts split over ep; each row's sequence over cp; the blocks over pp pipeline stages,
        each held by world / pp ranks."""
        if not isinstance(pp, int) or pp < 1 or world_size % pp:
            raise ValueError(
                f"parallel.pp={pp!r} must be a positive integer dividing the {world_size} process(es): each of the pp "
                "pipeline stages is held by world / pp of them"
            )
        world_size //= pp
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown parallel strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if strategy == "fsdp":
            if not isinstance(dp_replicate, int) or dp_replicate < 1 or world_size % dp_replicate:
                raise ValueError(
                    f"parallel.dp_replicate={dp_replicate!r} must be a positive integer dividing the {world_size} "
                    "process(es): each replica group shards the model over world / dp_replicate of them"
                )
            shard = world_size // dp_replicate
            if shard == 1 and (pp > 1 or dp_replicate > 1):  # one process alone is a run FSDP2 leaves unsharded
                raise ValueError(
                    f"parallel=fsdp shards over processes / (parallel.pp x parallel.dp_replicate) = "
                    f"{world_size * pp} / ({pp} x {dp_replicate}) = 1 process: nothing to shard over; use "
                    f"parallel=ddp for this layout, or run on {2 * pp * dp_replicate} processes or more"
                )
            return cls(dp_replicate, shard, rank=rank, device_type=device_type, ep=ep, cp=cp, pp=pp)
        if dp_replicate != 1:
            raise ValueError(
                f"parallel.dp_replicate={dp_replicate} is FSDP2's replica groups (HSDP): under parallel=ddp every "
                "process is a replica; use parallel=hsdp"
            )
        return cls(dp_replicate=world_size, rank=rank, device_type=device_type, ep=ep, cp=cp, pp=pp)

    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.layout.dp_shard

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def several_ranks(self) -> bool:
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """Ranks that read different rows of the global batch: cp consecutive ranks share theirs."""
        return self.layout.dp_size

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def pp_rank(self) -> int:
        """Which pipeline stage(s) this rank holds: ranks number stages first (rank = pp_rank x stage_world +
        its place among the stage's ranks), as torchtitan puts pp outermost."""
        return self.rank // self.layout.stage_world

    @property
    def dp_rank(self) -> int:
        return (self.rank % self.layout.stage_world) // self.cp

    @property
    def cp_rank(self) -> int:
        """Which slice of its rows' sequence this rank holds."""
        return self.rank % self.cp

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The cp consecutive ranks that split the same rows' sequence (None: cp == 1)."""
        if self.cp == 1:
            return None
        if self._cp_mesh is None:  # built on first use, a collective on every rank
            shape = (self.world_size // self.cp, self.cp)
            self._cp_mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=("cp_dp", "cp"))
        return self._cp_mesh["cp"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Every rank holding the same layers, whose tokens all differ (gradient, loss and balancing reductions:
        with cp, the ranks of a row hold different positions of it): every rank, or under pipeline parallelism the
        ranks of this rank's stage; None when there is no other."""
        if self.pp == 1:
            return dist.group.WORLD if self.several_ranks else None
        return self.pp_mesh["dp"].get_group() if self.layout.stage_world > 1 else None

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank (the decisions all must take together: stopping), or None in one process."""
        return dist.group.WORLD if self.several_ranks else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline, one a stage in pp order (None: pp == 1)."""
        return self.pp_mesh["pp"].get_group() if self.pp > 1 else None

    @property
    def pp_mesh(self) -> DeviceMesh:
        """(pp, dp): the pipelines' stages and each stage's data-parallel ranks; built on first use, a collective
        on every rank."""
        if self.pp == 1:
            raise ValueError("no pipeline mesh: parallel.pp is 1")
        if self._pp_mesh is None:
            shape = (self.pp, self.layout.stage_world)
            self._pp_mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=("pp", "dp"))
        return self._pp_mesh

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: 1-D (dp_shard), or under HSDP 2-D (dp_replicate, dp_shard), whose replica
        groups are consecutive ranks; under pipeline parallelism the same within this rank's stage (a view of the
        (pp, dp_replicate, dp_shard) mesh). Built on first use, a collective on every rank."""
        if self.dp_shard == 1:
            raise ValueError("no dp_shard dimension to shard over (dp_shard == 1)")
        if self._mesh is None:
            dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)]
            dims = [(name, size) for name, size in dims if size > 1 or name == "dp_shard"]
            names = tuple(name for name, _ in dims)
            mesh = init_device_mesh(self.device_type, tuple(size for _, size in dims), mesh_dim_names=names)
            self._mesh = mesh[names[1:]] if self.pp > 1 else mesh
        return self._mesh

    @property
    def shard_placements(self) -> list:
        """How FSDP2 holds a parameter on shard_mesh: dim 0 over dp_shard, whole over dp_replicate (HSDP)."""
        return [Shard(0)] if self.dp_replicate == 1 else [Replicate(), Shard(0)]

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks that share out the routed experts and exchange token slots (None: ep == 1)."""
        return None if self.ep == 1 else self.expert_mesh["ep"].get_group()

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold the same experts and average their gradients (None: one such rank)."""
        return None if self.expert_dp == 1 else self.expert_mesh["expert_dp"].get_group()

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same routed experts (a stage's, under pipeline parallelism)."""
        return self.layout.expert_dp

    @property
    def stage_world(self) -> int:
        """The ranks holding this rank's pipeline stage, over which its gradients average: all without a pipeline."""
        return self.layout.stage_world

    @property
    def expert_mesh(self) -> DeviceMesh:
        """(ep, expert_dp): ep consecutive ranks split the experts, the world / ep ranks at the same place in their
        groups hold the same ones. Dimension ep first, so a routed-expert weight is a DTensor sharded (Shard(0))
        over ep and then, under FSDP2, again over expert_dp, each rank's rows one contiguous block of experts
        (k3train/checkpoint/expert_shards.py). Built on first use, a collective on every rank."""
        if self.ep == 1:
            raise ValueError("no expert mesh: parallel.ep is 1")
        if self._expert_mesh is None:
            ranks = torch.arange(self.world_size).view(self.pp, self.expert_dp, self.ep).transpose(1, 2)
            self._expert_mesh = self._within_stage(ranks, ("ep", "expert_dp"))  # [ep, expert_dp]
        return self._expert_mesh

    def _within_stage(self, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
        """The mesh of `ranks` [pp, *dims], named `names`, that holds this rank's stage: under pipeline parallelism
        a view of the whole (pp, *names) mesh (every rank builds every stage's groups, a collective)."""
        if self.pp == 1:
            return DeviceMesh(self.device_type, ranks[0], mesh_dim_names=names)
        return DeviceMesh(self.device_type, ranks, mesh_dim_names=("pp", *names))[names]

    @property
    def expert_shard(self) -> int:
        """The ranks FSDP2 shards each rank's experts over (ParallelLayout.expert_shard): expert_dp under FSDP2,
        the dp_shard / ep of them in its replica group under HSDP, 1 under DDP."""
        return self.layout.expert_shard

    @property
    def expert_hsdp_mesh(self) -> DeviceMesh:
        """Under HSDP: expert_mesh with expert_dp unflattened into (expert_replicate, expert_shard), the replica
        groups and the dp_shard / ep ranks within one that hold the same experts (expert_dp's index is replica x
        expert_shard + shard, as ranks number replicas first). Built on first use, a collective on every rank."""
        if self.ep == 1 or self.layout.strategy != "hsdp":
            raise ValueError("no expert HSDP mesh: it needs parallel.ep > 1 under HSDP")
        if self._expert_hsdp_mesh is None:
            shape = (self.pp, self.dp_replicate, self.expert_shard, self.ep)
            ranks = torch.arange(self.world_size).view(shape).permute(0, 3, 1, 2)  # [pp, ep, replicas, expert_shard]
            names = ("ep", "expert_replicate", "expert_shard")
            self._expert_hsdp_mesh = self._within_stage(ranks, names)
        return self._expert_hsdp_mesh

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards each rank's experts over: expert_dp (FSDP2), or (expert_replicate, expert_shard)
        (HSDP: sharded within a replica group, replicated across them)."""
        if self.layout.strategy == "hsdp":
            return self.expert_hsdp_mesh["expert_replicate", "expert_shard"]
        return self.expert_mesh["expert_dp"]

    def describe(self) -> str:
        if not self.several_ranks:
            return "one process"
        stages = f"{self.pp} pipeline stages, each " if self.pp > 1 else ""
        if self.dp_shard > 1 and self.dp_replicate > 1:
            data = f"HSDP: {self.dp_replicate} replica groups, each FSDP2 over {self.dp_shard} process(es)"
        elif self.dp_shard > 1:
            data = f"FSDP2 over {self.dp_shard} process(es)"
        else:
            data = f"DDP over {self.dp_replicate} process(es)"
        experts = f", routed experts split over {self.ep} ranks (expert parallel)" if self.ep > 1 else ""
        experts += f", each sequence split over {self.cp} ranks (context parallel)" if self.cp > 1 else ""
        return stages + data + experts
