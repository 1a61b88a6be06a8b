"""Pipeline parallelism planned (parallel.pp; the run: k3train/train/pipeline.py, k3train/models/k3/pipeline.py).

The run's own rules (k3train/runtime/parallel_layout.py), imported rather than restated: PipelineSettings (the
schedules, virtual stages, the micro-batches an update splits into and the refusals), stage_bounds (the layers of
each stage, as even as they split, the first stages taking the extra) and stages_of (the stages each pp rank holds:
one; v loop-style for the interleaved schedules; two V-shaped for zbv_zero_bubble).

A pp rank is planned as a run of its own stages (stage_spec): the parameters of its layers, with the embedding on the
first stage and the final norm, head and loss on the last (the rest of the model is on the meta device there), over
the stage's world / pp ranks (DDP, FSDP or HSDP over them: the mesh without pp); its micro-batch is the update's
rows / m (rows = train.batch_size x gradient_accumulation_steps per data-parallel rank, m = pp_microbatches or the
accumulation), run m times an update. What pipelining adds to that plan:

- The bubble (bubble): the fraction of an update a rank waits, from the schedule's own order of work. gpipe and
  1f1b: (p - 1) / (m + p - 1); interleaved_1f1b with v stages a rank: (p - 1) / (v m + p - 1) when p divides m.
  For every schedule the figure is what the order torch runs leaves idle (simulate): each rank runs its actions in
  torch's order (torch.distributed.pipelining.schedules builds it: the same functions the run's schedule calls),
  each waiting for what it needs (a forward for the stage before's forward of the micro-batch, a backward for the
  stage after's), with equal stages and F = 1, a whole backward B = 2 + r (r: what checkpointing recomputes, in
  forwards), split by the zero-bubble schedules into I = 1 + r (the inputs' gradients) and W = 1 (the weights');
  nothing for the sends. The step's pipelined work (the slowest rank's compute) is stretched by 1 / (1 - bubble).
  With these costs torch's zero-bubble orders are not bubble-free: with F = I = W (no recompute) and m >= 2p both
  leave (p - 1) / (3 v m + p - 1), the first forwards' fill of the last rank (p = 8, m = 16: 0.068 against 1f1b's
  0.304); with fewer micro-batches more (ZB-V at m = p: 0.226 at p = 8).
- Activations of the micro-batches in flight: a micro-batch's are held from its forward until its backward ends (the
  W pass under the zero-bubble schedules); the simulation's most at once on each rank, by stage (gpipe: all m;
  1f1b: min(m, p - i) on stage i, p on the first).
- FSDP2 and HSDP over a stage's ranks (the run cuts the model first and spreads each stage over its ranks: each
  stage its own FSDP2 root, its blocks the units) as torch's PipelineStage drives them: every backward but the
  schedule's last leaves the units gathered and their gradients whole (set_reshard_after_backward(False),
  set_requires_gradient_sync(False)); after the schedule perform_reduce_grad runs their post-backward once (reshard,
  the reduce-scatter, HSDP's all-reduce). So a unit is gathered only when it is sharded at one of its stage's
  forwards or backwards (fsdp_gathers: every forward before the first backward, a backward after a forward; with
  reshard_after_forward, a forward reshards it again), and from a backward to the update's end the stage's whole
  parameters are gathered (fp32; bf16 under precision=bf16's MixedPrecisionPolicy) beside its whole gradients:
  the backward phase holds them (pipeline_gathered).
  Measured on 4 gloo ranks, pp 2 x FSDP2 2, 1f1b (tests/test_plan_pp.py).
- Expert parallelism within a stage (the run carves the expert mesh out of each stage's ranks: ep consecutive ranks
  of a stage split its MoE layers' routed experts, and the stage's ranks / ep at the same place in their groups hold
  the same ones; other stages hold other layers). So the stage's plan is the plain ep plan over its ranks: the EP
  all-to-alls of its MoE layers every micro-batch (and again in a recompute), the experts left out of DDP's
  all-reduce of the stage's gradients and averaged after the schedule over the stage's ranks holding the same
  experts (the strategy's finish_gradients, per stage: an all-reduce only when more than ep ranks hold the stage),
  Muon orthogonalising a rank's whole experts where they are (own) or over the ranks of the stage sharing their
  slices, Quantile Balancing over the stage's ranks. Measured on 4 gloo ranks, pp 2 x ep 2 under DDP, 1f1b
  (tests/test_plan_pp.py).
- The p2p bytes (p2p): what crosses each cut between ranks, every micro-batch: the residual stream h and, with
  attention residuals, the block sums finished before the cut (k3train/models/k3/pipeline.py's blocks_before:
  the layers 0, S, 2S, ... below it), each [rows, seq_len, d] in fp32 (the stream's dtype, autocast or not), forward;
  their gradients, as many bytes, backward. Cuts within a rank (zbv's middle) send nothing. torch also allocates a
  receive buffer for every micro-batch and input (and gradient) at the first step and keeps it: buffers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

from torch.distributed.pipelining import schedules as torch_schedules

from k3train.plan.activations import F32, root_activations
from k3train.plan.comm import Collective, fsdp_gather_payload, plan_comm, ring
from k3train.plan.extra_flops import recompute_flops_per_token
from k3train.plan.memory import Memory, fsdp_gathered, gather_bytes, planned_layers, rank_slice, unit_bytes
from k3train.plan.mesh import Mesh
from k3train.plan.spec import RunSpec
from k3train.runtime.parallel_layout import SCHEDULES, PipelineSettings, owner_of, stage_bounds, stages_of


@dataclass(frozen=True)
class P2P:
    """One pp rank's point-to-point bytes an update: sent and received, forward (activations) and backward
    (their gradients)."""

    sent_forward: float
    sent_backward: float
    received_forward: float
    received_backward: float
    sends_forward: int  # tensors sent an update
    sends_backward: int


@dataclass(frozen=True)
class Schedule:
    makespan: float  # an update, in the unit costs
    busy: float  # a rank's work in the same units
    alive: tuple[tuple[tuple[int, float, float], ...], ...]  # per rank: (stage, forward start, release) each

    @property
    def bubble(self) -> float:
        return 1 - self.busy / self.makespan

    def in_flight(self, rank: int, bytes_of: dict[int, float]) -> float:
        """The most bytes of micro-batches' activations alive at once on `rank` (bytes_of: one micro-batch's, by
        stage)."""
        spans = self.alive[rank]
        return max(sum(bytes_of[s] for s, start, end in spans if start <= t < end) for _, t, _ in spans)

    def most_in_flight(self, rank: int, stage: int) -> int:
        return int(self.in_flight(rank, {s: float(s == stage) for s, _, _ in self.alive[rank]}))


@dataclass(frozen=True)
class PipelinePlan:
    settings: PipelineSettings
    microbatches: int
    rows: int  # rows of a micro-batch, per data-parallel rank
    bounds: tuple[tuple[int, int], ...]  # [first, last) layers of each stage
    schedule: Schedule

    @property
    def pp(self) -> int:
        return self.settings.pp

    @property
    def bubble(self) -> float:
        return self.schedule.bubble

    def stages(self, rank: int) -> list[int]:
        return stages_of(rank, self.settings)

    def layers(self, rank: int) -> tuple[int, ...]:
        return tuple(i for s in sorted(self.stages(rank)) for i in range(*self.bounds[s]))


def settings_of(spec: RunSpec) -> PipelineSettings:
    """The run's PipelineSettings for `spec` (its refusals are the run's: a schedule that does not exist, virtual
    stages the schedule cannot hold)."""
    settings = PipelineSettings(spec.pp, spec.pp_schedule, spec.pp_virtual_stages, spec.pp_microbatches)
    if settings.schedule == "dualpipev":  # its actions include OVERLAP_F_B, which `simulate` has no cost for
        raise ValueError(
            "parallel.pp_schedule=dualpipev runs, but the planner does not model its overlapped forward-and-backward "
            "actions yet: plan its V layout (the same stages a rank) with parallel.pp_schedule=zbv_zero_bubble"
        )
    return settings


def plan_pipeline(spec: RunSpec) -> PipelinePlan:
    """The stages, micro-batches and schedule of `spec`'s pipeline; ValueError (the run's words) for one the run
    refuses: more stages than layers, micro-batches that do not divide the rows or are too few."""
    settings = settings_of(spec)
    bounds = tuple(stage_bounds(spec.model.n_layers, settings.n_stages))
    rows = spec.batch_size * spec.accumulation
    m = settings.n_microbatches(rows, spec.accumulation)
    recompute = {"none": 0.0, "block": 1.0}.get(spec.checkpointing, _selective_share(spec))
    return PipelinePlan(settings, m, rows // m, bounds, simulate(settings, m, recompute))


def _selective_share(spec: RunSpec) -> float:
    """What selective checkpointing recomputes, in forwards (estimate's recompute over the forward)."""
    return recompute_flops_per_token(spec) / spec.flops_per_token["forward"]


# ---- the schedule ---------------------------------------------------------------------------------------------------
def orders(settings: PipelineSettings, m: int) -> list[list[tuple[int, str, int]]]:
    """Each pp rank's work in the order torch runs it: (stage, "F" | "B" | "I" | "W", micro-batch). gpipe and 1f1b
    as their _step_microbatches run (gpipe every forward, then every backward; 1f1b min(m, p - stage) forwards, then
    a backward and a forward in turn, then the backwards left); the others from the schedule classes' own
    _calculate_single_rank_operations (the order their runtime executes), empty slots dropped."""
    p, v = settings.pp, settings.virtual_stages
    name = SCHEDULES[settings.schedule][0]
    if name == "GPipe":
        return [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)]
    if name == "1F1B":
        out = []
        for r in range(p):
            warmup = min(m, p - r)
            ops = [(r, "F", i) for i in range(warmup)]
            for i in range(m - warmup):
                ops += [(r, "B", i), (r, "F", warmup + i)]
            out.append(ops + [(r, "B", i) for i in range(m - warmup, m)])
        return out
    cls = torch_schedules.get_schedule_class(name)
    rounds = max(1, m // p)
    if name != "ZBVZeroBubble" and m % rounds:
        raise ValueError(
            f"parallel.pp_schedule={settings.schedule} needs micro-batches a multiple of max(1, m // pp) = {rounds} "
            f"(torch's rounds); got {m}: choose parallel.pp_microbatches a multiple of pp={p}"
        )
    fake = SimpleNamespace(
        pp_group_size=p, n_local_stages=v, _n_microbatches=m, microbatches_per_round=m // rounds, num_stages=p * v
    )
    return [
        [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in ops if a is not None]
        for ops in (cls._calculate_single_rank_operations(fake, r) for r in range(p))
    ]


def simulate(settings: PipelineSettings, m: int, recompute: float = 0.0) -> Schedule:
    """Run every rank's order (orders) with equal stages: F 1, B 2 + recompute, I 1 + recompute, W 1, each action
    as soon as its rank is free and what it needs is done; sends take no time."""
    order = orders(settings, m)
    S = settings.n_stages
    cost = {"F": 1.0, "B": 2.0 + recompute, "I": 1.0 + recompute, "W": 1.0}
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(order)
    at = [0] * len(order)
    started: dict[tuple[int, int], float] = {}
    while any(at[r] < len(ops) for r, ops in enumerate(order)):
        moved = False
        for r, ops in enumerate(order):
            while at[r] < len(ops):
                s, kind, i = ops[at[r]]
                need = _needs(s, kind, i, S)
                if any(n not in done for n in need):
                    break
                start = max([free[r], *(done[n] for n in need)])
                free[r] = done[(s, kind, i)] = start + cost[kind]
                if kind == "B" or kind == "I":  # the zero-bubble I also stands for a whole backward downstream
                    done.setdefault((s, "BI", i), free[r])
                if kind == "F":
                    started[(s, i)] = start
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the {settings.schedule} order deadlocks on pp={settings.pp}, m={m}")
    release = {(s, i): t for (s, kind, i), t in done.items() if kind in ("B", "W")}
    alive = tuple(tuple((s, started[(s, i)], release[(s, i)]) for s, kind, i in ops if kind == "F") for ops in order)
    busy = max(sum(cost[kind] for _, kind, _ in ops) for ops in order)
    return Schedule(max(free), busy, alive)


def _needs(stage: int, kind: str, mb: int, n_stages: int) -> list[tuple[int, str, int]]:
    if kind == "F":
        return [(stage - 1, "F", mb)] if stage else []
    if kind == "W":
        return [(stage, "I", mb)]
    # a backward (whole, or the inputs' gradients): the next stage's, or on the last the forward's loss
    return [(stage, "F", mb)] if stage == n_stages - 1 else [(stage + 1, "BI", mb)]


# ---- a rank's stages -------------------------------------------------------------------------------------------------
def stage_spec(spec: RunSpec, plan: PipelinePlan, rank: int) -> RunSpec:
    """`spec` as pp rank `rank` runs it: its layers' parameters (the root's on the first and last stages), one
    micro-batch of plan.rows rows, m of them an update, and its own FLOPs per token."""
    layers = plan.layers(rank)
    stages = plan.stages(rank)
    first, last = 0 in stages, plan.settings.n_stages - 1 in stages
    held = {f"layers.{i}" for i in layers}
    params = tuple(p for p in spec.params if p.unit in held or (p.unit == "root" and _root_part(p.name, first, last)))
    forward = sum(layer_forward_flops(spec, i) for i in layers) + (head_forward_flops(spec) if last else 0.0)
    return dataclasses.replace(
        spec,
        params=params,
        layers=layers,
        first=first,
        last=last,
        batch_size=plan.rows,
        accumulation=plan.microbatches,
        flops_per_token={"forward": forward, "training": 3.0 * forward},
    )


def _root_part(name: str, first: bool, last: bool) -> bool:
    """Whether a root parameter is on a stage: the embedding on the first, everything else (the final norm, the
    LM head, the output mix) on the last (k3train/models/k3/pipeline.py)."""
    return first if name.startswith("embed_tokens.") else last


def layer_forward_flops(spec: RunSpec, layer: int) -> float:
    """Forward FLOPs per token of one layer, as the model's flops_per_token counts them (the mixer's from the
    model's costs; the MoE's router, chosen and shared experts and latent projections, or the dense FFN)."""
    c = spec.model
    mixer = spec.costs.kda_macs if c.layer_pattern[layer] == "kda" else spec.costs.mla_macs
    macs = mixer(c, spec.seq_len)
    if c.is_moe_layer(layer):
        r = c.expert_latent_dim or c.d_model
        macs += c.d_model * c.n_routed_experts + c.experts_per_token * 3 * r * c.expert_ffn_dim
        macs += c.n_shared_experts * 3 * c.d_model * c.expert_ffn_dim
        macs += 2 * c.d_model * r if c.expert_latent_dim else 0
    else:
        macs += 3 * c.d_model * c.dense_ffn_dim
    return 2.0 * macs


def head_forward_flops(spec: RunSpec) -> float:
    return 2.0 * spec.model.d_model * spec.model.vocab_size


# ---- what crosses the cuts -----------------------------------------------------------------------------------------
def blocks_before(spec: RunSpec, layer: int) -> int:
    """The block sums that reach layer `layer` with attention residuals (blocks of S layers start at 0, S, 2S, ...:
    k3train/models/k3/pipeline.py's blocks_before), 0 without."""
    S = spec.model.attn_res_block_size
    return 0 if S is None else math.ceil(layer / S)


def cut_bytes(spec: RunSpec, plan: PipelinePlan, stage: int) -> float:
    """Bytes that cross into `stage` from the one before, a micro-batch: h and the block sums, fp32."""
    first = plan.bounds[stage][0]
    tokens = plan.rows * spec.seq_len // spec.cp
    return (1 + blocks_before(spec, first)) * tokens * spec.model.d_model * F32


def tensors_at(spec: RunSpec, plan: PipelinePlan, stage: int) -> int:
    return 1 + blocks_before(spec, plan.bounds[stage][0])


def p2p(spec: RunSpec, plan: PipelinePlan, rank: int) -> P2P:
    """Rank `rank`'s sends and receives an update (module docstring)."""
    m, S = plan.microbatches, plan.settings.n_stages
    sent_f = sent_b = got_f = got_b = 0.0
    calls_f = calls_b = 0
    for s in plan.stages(rank):
        if s + 1 < S and owner_of(s + 1, plan.settings) != rank:  # its output forward, the gradient back
            sent_f += m * cut_bytes(spec, plan, s + 1)
            got_b += m * cut_bytes(spec, plan, s + 1)
            calls_f += m * tensors_at(spec, plan, s + 1)
        if s > 0 and owner_of(s - 1, plan.settings) != rank:  # its input received, its gradient sent back
            got_f += m * cut_bytes(spec, plan, s)
            sent_b += m * cut_bytes(spec, plan, s)
            calls_b += m * tensors_at(spec, plan, s)
    return P2P(sent_f, sent_b, got_f, got_b, calls_f, calls_b)


def fsdp_gathers(plan: PipelinePlan, rank: int, stage: int, reshard_after_forward: bool = True) -> int:
    """How many times an update FSDP2 all-gathers each unit of `stage` (on pp rank `rank`) under torch's
    PipelineStage, which keeps every backward but its last from resharding (set_reshard_after_backward(False)) or
    reducing (set_requires_gradient_sync(False)) and runs the units' post-backward (reshard and reduce-scatter) once,
    after the schedule (perform_reduce_grad): walking the stage's actions in the schedule's order, a unit is gathered
    when it is sharded at a forward or a backward (whole, or the zero-bubble schedules' inputs' part; the weights'
    part, W, gathers nothing); a forward leaves it sharded again with reshard_after_forward, a backward leaves it
    gathered. Measured on 4 gloo ranks (tests/test_plan_pp.py): 1f1b, pp 2, 4 micro-batches: 5 passes on either
    stage, against 8 (2m) for FSDP's own accumulation."""
    sharded, n = True, 0
    for s, kind, _ in orders(plan.settings, plan.microbatches)[rank]:
        if s != stage or kind == "W":
            continue
        n += sharded
        sharded = kind == "F" and reshard_after_forward
    return n


def stage_params(spec: RunSpec, plan: PipelinePlan, stage: int) -> RunSpec:
    """`spec` (a rank's stage_spec) with the parameters of `stage` alone: its layers', and the root's part it holds
    (each stage is its own FSDP2 root)."""
    held = {f"layers.{i}" for i in range(*plan.bounds[stage])}
    first, last = stage == 0, stage == plan.settings.n_stages - 1
    params = tuple(p for p in spec.params if p.unit in held or (p.unit == "root" and _root_part(p.name, first, last)))
    return dataclasses.replace(spec, params=params)


def rank_comm(spec: RunSpec, plan: PipelinePlan, mesh: Mesh, rank: int) -> list[Collective]:
    """Pipeline rank `rank`'s collectives an update: its stages' over the stage's ranks (`spec` its stage_spec,
    `mesh` a stage's), FSDP2's all-gathers as PipelineStage leaves them (fsdp_gathers), and its sends to the stages
    before and after (p2p: payload and wire alike, waited for)."""
    out = plan_comm(spec, mesh)
    if mesh.dp_shard > 1:
        out = [c for c in out if not c.kind.startswith("FSDP all-gather")] + _pipeline_gathers(spec, plan, mesh, rank)
    x = p2p(spec, plan, rank)
    for kind, sent, calls in (("activations", x.sent_forward, x.sends_forward), ("gradients", x.sent_backward,
                                                                                x.sends_backward)):  # fmt: skip
        if sent:
            out.append(Collective(f"PP {kind} send", sent, sent, 2, calls, False))
    return out


def _pipeline_gathers(spec: RunSpec, plan: PipelinePlan, mesh: Mesh, rank: int) -> list[Collective]:
    totals = {"": [0.0, 0, mesh.dp_shard], " (routed experts)": [0.0, 0, mesh.expert_shard]}
    for s in plan.stages(rank):
        held = stage_params(spec, plan, s)
        passes = fsdp_gathers(plan, rank, s, spec.reshard_after_forward)
        units = len({p.unit for p in held.params})
        for name, payload in zip(totals, fsdp_gather_payload(held, mesh)):
            totals[name][0] += passes * payload
            totals[name][1] += passes * units
    return [
        Collective(f"FSDP all-gather{name}", total, ring(total, ranks), ranks, calls, True)
        for name, (total, calls, ranks) in totals.items()
        if total and ranks > 1
    ]


def rank_memory(
    spec: RunSpec, plan: PipelinePlan, mesh: Mesh, rank: int, memory: Memory, device_type: str
) -> tuple[Memory, int]:
    """`memory` (plan_memory of `spec`, rank `rank`'s stage_spec, on a stage's `mesh`: one micro-batch of each of
    its stages) with what the pipeline adds: the other micro-batches in flight at the schedule's most (forward and
    backward), torch's receive buffers (throughout), and autocast's cached weight casts through the backward (the
    cast cache lives until autocast exits, which wraps the whole schedule); and the most micro-batches in flight
    on one of its stages."""
    layers = dict(zip(spec.layer_ids, planned_layers(spec, mesh, device_type)))
    tokens, S = rank_slice(spec, mesh)[0], plan.settings.n_stages
    one = {}
    for s in plan.stages(rank):
        first, last = plan.bounds[s]
        held = [layers[i] for i in range(first, last)]
        root = root_activations(spec.model, tokens, spec.act_bytes, s == 0, s == S - 1)
        one[s] = sum(la.saved + la.copies_saved for la in held) + root
    extra = max(0.0, plan.schedule.in_flight(rank, one) - sum(one.values()))
    buffers = receive_buffers(spec, plan, rank)
    cached = sum(la.copies_cached for la in layers.values())
    gathered = more = 0.0
    if mesh.dp_shard > 1:  # PipelineStage keeps the stages' units gathered from a backward to the update's end
        gathered = sum(unit_bytes(spec, mesh, element=gather_bytes(spec, mesh)).values())
        more = max(0.0, gathered - fsdp_gathered(spec, mesh))  # beyond FSDP's own root and two blocks
    phases = dict(memory.phases)
    phases["forward end"] += extra + buffers + (0.0 if spec.reshard_after_forward else more)
    phases["backward"] += extra + buffers + cached + more
    phases["optimizer step"] += buffers
    out = dataclasses.replace(
        memory, phases=phases, in_flight=extra, pipeline_buffers=buffers, pipeline_gathered=gathered,
        first_step_added=memory.first_step_added + extra + buffers + more,
    )  # fmt: skip
    return out, max(plan.schedule.most_in_flight(rank, s) for s in plan.stages(rank))


def receive_buffers(spec: RunSpec, plan: PipelinePlan, rank: int) -> float:
    """torch's receive buffers on `rank`, allocated for every micro-batch at the first step and kept: each
    non-first stage's inputs, and each non-last stage's output gradients, m of each."""
    m, S = plan.microbatches, plan.settings.n_stages
    out = 0.0
    for s in plan.stages(rank):
        if s > 0:
            out += m * cut_bytes(spec, plan, s)
        if s + 1 < S:
            out += m * cut_bytes(spec, plan, s + 1)
    return out
