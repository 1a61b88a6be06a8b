"""ParallelLayout: how N ranks divide the work, as degrees and the sizes they imply, with one set of rules; the run's
ParallelDims (k3train/runtime/parallel_dims.py) holds one and the planner's Mesh (k3train/plan/mesh.py) is one, so
what k3train.plan plans and what a run builds cannot disagree.

    world = pp x dp_replicate x dp_shard  pp pipeline stages (outermost), each over world / pp ranks (stage_world)
    ep | world / pp, and ep | dp_shard    groups of ep consecutive ranks split the routed experts (parallel.ep)
      under FSDP2 or HSDP
    cp | world / pp                       groups of cp consecutive ranks split each row's sequence (parallel.cp)

dp_replicate ranks hold whole copies (DDP, parallel=ddp); dp_shard ranks each hold a slice of every parameter
(FSDP2, parallel=fsdp); both at once is HSDP (parallel=hsdp; the planner: --mesh RxSxE).

The ep rule is the runtime's expert mesh: ParallelDims.expert_mesh takes a stage's ranks in order, ep consecutive ones
splitting the experts and the stage_world / ep ranks at the same place in their groups (expert_dp) holding the same
ones, so ep must divide a stage's ranks (the world without pipeline parallelism; each stage holds other layers, so other
stages' ranks never hold the same experts). Ranks number replicas first (rank = replica x dp_shard + shard), so under
HSDP ep consecutive ranks lie within one replica's dp_shard ranks only when ep divides dp_shard: the experts are carved
out of the sharded ranks, as torchtitan does, and each rank's experts FSDP-sharded over the dp_shard / ep ranks holding
them (expert_shard) and replicated over dp_replicate. Under FSDP2 dp_shard is the world, so the two rules are one.
cp changes no parameter's placement: gradients still average over every rank, each rank's tokens being different.

The pipeline's geometry is here too, the run's (k3train/train/pipeline.py) and the planner's (k3train/plan/pipeline.py):
    PipelineSettings            parallel.pp, pp_schedule, pp_virtual_stages, pp_microbatches, checked
    stage_bounds(n_layers, S)   the layers of each of S stages, as even as they split (the first get the extra)
    stages_of(rank, settings)   which stages a rank holds: one; v of them, loop-style (rank, rank + pp, ...) for the
                                interleaved schedules; two, V-shaped (rank, 2 pp - 1 - rank), for zero-bubble V
    owner_of(stage, settings)   the pp rank that holds a stage
"""

from __future__ import annotations

from dataclasses import dataclass

# What sets each degree, for the refusals: a run's dp_replicate and dp_shard come from parallel=ddp or
# parallel=fsdp over its processes, the planner's from --mesh.
_SET_BY = {
    "dp_replicate": "dp_replicate (the processes under parallel=ddp; --mesh R x S x E)",
    "dp_shard": "dp_shard (the processes under parallel=fsdp; --mesh R x S x E)",
    "ep": "parallel.ep",
    "cp": "parallel.cp",
    "pp": "parallel.pp",
}


@dataclass(frozen=True)
class ParallelLayout:
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1  # pipeline stages over which the model's blocks are cut (parallel.pp): outermost, world = pp x the rest

    def __post_init__(self) -> None:
        for name, key in _SET_BY.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a positive integer")
        if self.stage_world % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must divide the {self.stage_world} process(es) of a pipeline stage: experts "
                "split over ep ranks; choose an ep that divides them"
            )
        if self.dp_shard > 1 and self.dp_shard % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must divide dp_shard={self.dp_shard}: under FSDP the expert-parallel ranks "
                "are taken from the sharded ones; choose an ep that divides dp_shard"
            )
        if self.stage_world % self.cp:
            raise ValueError(
                f"parallel.cp={self.cp} must divide the {self.stage_world} process(es) of a pipeline stage: each "
                "row's sequence is split over cp ranks; choose a cp that divides them"
            )

    @property
    def world(self) -> int:
        return self.pp * self.stage_world

    @property
    def stage_world(self) -> int:
        """The ranks that hold one pipeline stage (all of them without pipeline parallelism)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_size(self) -> int:
        """Ranks that read different rows of the global batch: cp consecutive ranks share theirs, and the pp ranks
        of a pipeline the same ones."""
        return self.stage_world // self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same routed experts (within a pipeline stage): expert_shard x expert_replicas."""
        return self.stage_world // self.ep

    @property
    def expert_shard(self) -> int:
        """The FSDP degree of each rank's experts: the dp_shard / ep ranks that hold the same ones (1 under DDP;
        expert_dp under FSDP2)."""
        return self.dp_shard // self.ep if self.dp_shard > 1 else 1

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts' shard: they average its gradients."""
        return self.stage_world // (self.ep * self.expert_shard)

    @property
    def strategy(self) -> str:
        if self.world == 1:
            return "one process"
        if self.dp_shard == 1:
            return "ddp"
        return "fsdp" if self.dp_replicate == 1 else "hsdp"


def expert_shard_dim(local_experts: int, ranks: int) -> int:
    """The dim FSDP2 shards a routed-expert weight [experts, ...] on over the `ranks` holding the same experts
    (expert_shard; expert_dp under FSDP2): 0, whole experts per rank, when each rank gets at least one, else 1, a
    slice of every expert (torchtitan's shard_placement_fn), which Muon's owners then gather
    (k3train/optim/muon_distributed.muon_placement)."""
    return 0 if local_experts >= ranks else 1


# parallel.pp_schedule -> torch's schedule name, and whether a rank holds several stages (the virtual ones)
SCHEDULES = {
    "gpipe": ("GPipe", False),
    "1f1b": ("1F1B", False),
    "interleaved_1f1b": ("Interleaved1F1B", True),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", True),
    "zbv_zero_bubble": ("ZBVZeroBubble", True),  # exactly 2 stages a rank, V-shaped
    "dualpipev": ("DualPipeV", True),  # DeepSeek's DualPipe in torch's V form: 2 stages a rank, V-shaped
}
V_SHAPED = ("zbv_zero_bubble", "dualpipev")


@dataclass(frozen=True)
class PipelineSettings:
    """parallel.pp, pp_schedule, pp_virtual_stages (stages a rank holds under an interleaved schedule) and
    pp_microbatches (None: the update's gradient_accumulation_steps)."""

    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pp, int) or self.pp < 1:
            raise ValueError(f"parallel.pp={self.pp!r} must be a positive integer")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"parallel.pp_schedule={self.schedule!r} is not a schedule; choose one of {', '.join(SCHEDULES)}"
            )
        multi = SCHEDULES[self.schedule][1]
        if self.schedule in V_SHAPED and self.virtual_stages != 2:
            raise ValueError(
                f"parallel.pp_schedule={self.schedule} holds 2 stages a rank (a V); got pp_virtual_stages="
                f"{self.virtual_stages}: set parallel.pp_virtual_stages=2"
            )
        if not multi and self.virtual_stages != 1:
            raise ValueError(
                f"parallel.pp_schedule={self.schedule} holds one stage a rank; pp_virtual_stages="
                f"{self.virtual_stages} needs an interleaved schedule (interleaved_1f1b, interleaved_zero_bubble)"
            )
        if multi and self.virtual_stages < 2:
            raise ValueError(
                f"parallel.pp_schedule={self.schedule} interleaves several stages a rank: set "
                "parallel.pp_virtual_stages to 2 or more"
            )

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    def n_microbatches(self, rows: int, accumulation: int) -> int:
        """The micro-batches an update's `rows` split into; refused when they do not divide the rows, or are too
        few to fill the pipeline's schedule."""
        n = accumulation if self.microbatches is None else self.microbatches
        if not isinstance(n, int) or n < 1 or rows % n:
            raise ValueError(
                f"parallel.pp_microbatches={n!r} must divide the update's {rows} rows a rank "
                "(train.batch_size x train.gradient_accumulation_steps); choose a divisor"
            )
        if self.pp > 1 and self.schedule != "gpipe" and n < self.pp:
            raise ValueError(
                f"parallel.pp_schedule={self.schedule} needs at least pp={self.pp} micro-batches an update, got {n}: "
                "raise train.gradient_accumulation_steps or parallel.pp_microbatches"
            )
        return n


def stage_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """[first, last) layers of each stage: n_layers split as evenly as they go, the first stages taking the extra."""
    if n_stages > n_layers:
        raise ValueError(
            f"{n_stages} pipeline stages (parallel.pp x pp_virtual_stages) for {n_layers} layers: every stage needs "
            "a layer; lower parallel.pp or pp_virtual_stages"
        )
    per, extra = divmod(n_layers, n_stages)
    bounds, first = [], 0
    for s in range(n_stages):
        last = first + per + (1 if s < extra else 0)
        bounds.append((first, last))
        first = last
    return bounds


def stages_of(pp_rank: int, settings: PipelineSettings) -> list[int]:
    """The stage indices rank `pp_rank` of the pipeline holds, in the order its schedule wants them."""
    pp, v = settings.pp, settings.virtual_stages
    if settings.schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(v)]


def owner_of(stage: int, settings: PipelineSettings) -> int:
    """The pp rank that holds `stage` (stages_of's inverse)."""
    return next(r for r in range(settings.pp) if stage in stages_of(r, settings))
