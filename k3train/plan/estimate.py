"""A step's time and a run's throughput on a mesh, and the mesh to propose for N devices.

Compute: the model's training FLOPs per token (k3train/models/k3/flops.py, 3 x forward) x the tokens of a step on
one rank, plus what checkpointing recomputes (block: the whole forward; selective: the mixers' and routed experts'
forward), at peak x MFU (default 0.4: the fraction of the datasheet peak the step's matmuls reach, a stated
assumption, --mfu to change it). Newton-Schulz: each rank's largest share of the orthogonalisations (5 steps of
newton_schulz_cost per matrix, k3train/optim/muon_distributed.py) at the same fraction of the peak in its dtype.

Context parallelism (cp > 1): each rank computes for its seq_len / cp positions of its rows; the step waits for
the last rank of a group, whose queries see every key of the row (the first sees its own slice only), so that rank
is the one timed. Its MLA attention is what flops.py counts per token at seq_len (every query against all seq_len
keys, the dense mask computing the masked pairs too); added to the model's FLOPs: KDA's second chunked pass per
layer (from the identity, value width K: chunk_state_macs at the slice's length, as the main pass), the entering
state's read (Q S_in) and composition, and MLA's kv_b_proj over the seq_len - T_l keys before the slice. All in the
step time, none in the model TFLOP/s (the model's FLOPs are flops.py's, as for recompute).

QK-Clip (when its callback is on and the model has MLA): the max-logit matmuls of k3train/models/k3/mla.py's
causal_max_logit, every MLA layer's queries against the keys they see, tile by tile (the costs' max_logit_pairs,
k3train/plan/costs.py: the causal pairs and the diagonal tiles' masked halves, on the last rank of a cp group
against all seq_len keys), always in fp32 whatever the run's precision, at the same fraction of the fp32 peak; once
under checkpointing too (a recompute leaves the measurement out: model.py's measured_once). In the step time, not
in the model TFLOP/s (the framework's work, not the model's).

Overlap, assumed: FSDP's all-gathers and reduce-scatters and DDP's all-reduce run beside the forward and backward
(FSDP2 prefetches the next unit; DDP reduces buckets as the backward fills them), so only what exceeds the compute
adds to the step (QK-Clip's matmuls, forward work, count as compute there). The EP all-to-alls (a MoE waits for its
tokens), Quantile Balancing's gathers (its bias decides the routing), and the optimizer's gathers and Newton-Schulz
(after the backward, before the next forward) add in full. Elementwise work and kernel launch overheads are in the
MFU; latency per collective is not modelled.

Pipeline parallelism (parallel.pp > 1, k3train/plan/pipeline.py): each pp rank is planned as above as a run of its
own stages over a stage's ranks (its FLOPs are its layers', the head's on the last); the step is the slowest rank's
compute (recompute and QK-Clip included) stretched by the schedule's bubble, w / (1 - bubble), plus the most any
rank spends on Newton-Schulz and exposed communication (its sends included); the memory is the rank with the
largest peak. The proposal keeps the configured pp and tries its meshes over world / pp ranks a stage.

The proposal: one process for one device; otherwise every candidate (k3train/plan/mesh.py: DDP, then FSDP over all
devices, ep = 1, 2, 4, ...) is planned and the fastest that fits is proposed (the shortest step, then the smallest
peak), or with prefer="memory" the one with the smallest peak (then the shortest step), naming the other where it
differs; refused when none fits. "Fits": the peak of every phase under (1 - headroom) of the device's memory
(default 10% kept for the CUDA context, NCCL's buffers and the caching allocator's fragmentation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from k3train.plan.comm import Collective, plan_comm, seconds
from k3train.plan.extra_flops import context_flops_per_token, qk_clip_flops, recompute_flops_per_token
from k3train.plan.hardware import Hardware
from k3train.plan.memory import Memory, plan_memory
from k3train.plan.mesh import Mesh, candidates
from k3train.plan.muon import muon_groups, muon_shares
from k3train.plan.pipeline import PipelinePlan, plan_pipeline, rank_comm, rank_memory, stage_spec
from k3train.plan.settings import DEFAULT_SETTINGS, PlanSettings
from k3train.plan.spec import RunSpec

DAY = 86400.0


@dataclass
class Estimate:
    mesh: Mesh
    memory: Memory
    comm: list[Collective]
    comm_seconds: dict[str, float]
    compute_s: float
    recompute_s: float
    newton_schulz_s: float
    exposed_s: float  # communication that adds to the step
    step_s: float
    tokens_per_step: int
    fits: bool
    budget: float  # bytes per device the peak must stay under
    split_flops_per_token: float = 0.0  # training FLOPs per token the cp split adds on the last rank of a group
    qk_clip_s: float = 0.0  # QK-Clip's max-logit matmuls, fp32
    qk_clip_flops: float = 0.0  # theirs in a step on one rank
    pipeline: PipelinePlan | None = None  # parallel.pp > 1: the stages, micro-batches and schedule
    bubble_s: float = 0.0  # the pipeline's idle time in the step (the slowest rank's work x bubble / (1 - bubble))
    stage_ranks: list[RankEstimate] = field(default_factory=list)  # each pp rank's own plan (pipeline)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tokens_per_day(self) -> float:
        return self.tokens_per_s * DAY

    @property
    def days_per_trillion(self) -> float:
        """Days to train 1e12 tokens at this throughput (K2 pre-trained on 15.5 of them: docs/plan.md)."""
        return 1e12 / self.tokens_per_day

    def model_flops_per_s(self, spec: RunSpec) -> float:
        """Per device: the model's training FLOPs (recompute excluded) over the step."""
        return spec.flops_per_token["training"] * self.tokens_per_step / self.mesh.world / self.step_s


def usable_bytes(hw: Hardware, mesh: Mesh, headroom: float = 0.1) -> float:
    """What a device's peak must stay under: its memory less the headroom; a CPU's is shared by every process."""
    return hw.memory_bytes / (1 if hw.devices_per_node else mesh.world) * (1 - headroom)


def estimate(spec: RunSpec, mesh: Mesh, hw: Hardware, settings: PlanSettings = DEFAULT_SETTINGS) -> Estimate:
    if mesh.pp > 1:
        return _pipelined(spec, mesh, hw, settings)
    return _one_rank(spec, mesh, plan_comm(spec, mesh), hw, settings)


def _one_rank(
    spec: RunSpec,
    mesh: Mesh,
    comm: list[Collective],
    hw: Hardware,
    settings: PlanSettings,
    world: int | None = None,
) -> Estimate:
    """The plan of one rank running `spec` on `mesh` with the collectives `comm` (world: the run's devices when
    `mesh` is a pipeline stage's)."""
    mfu, headroom, device_type = settings.mfu, settings.headroom, settings.device_type
    memory = plan_memory(spec, mesh, device_type)
    peak = hw.peak_flops(spec.precision) * mfu
    tokens_rank = spec.rank_tokens(mesh.cp) * spec.accumulation
    split = 3 * context_flops_per_token(spec, mesh.cp)  # training: forward and backward
    compute = (spec.flops_per_token["training"] + split) * tokens_rank / peak
    recompute = recompute_flops_per_token(spec, mesh.cp) * tokens_rank / peak
    ns = 0.0
    if spec.optimizer == "muon_adamw":
        ns_peak = hw.peak_flops("fp32" if spec.ns_dtype == "fp32" else "bf16") * mfu
        ns = sum(s.flops_per_rank for g in muon_groups(spec) for s in muon_shares(spec, mesh, g)) / ns_peak
    max_logit_flops = qk_clip_flops(spec, mesh.cp, device_type)
    max_logit_s = max_logit_flops / (hw.peak_flops("fp32") * mfu)
    times = {coll.kind: seconds(coll, mesh, hw, world) for coll in comm}
    overlapped = sum(times[coll.kind] for coll in comm if coll.overlapped)
    waited = sum(times[coll.kind] for coll in comm if not coll.overlapped)
    exposed = max(0.0, overlapped - compute - recompute - max_logit_s) + waited
    step = compute + recompute + ns + max_logit_s + exposed
    budget = usable_bytes(hw, mesh, headroom)
    return Estimate(
        mesh, memory, comm, times, compute, recompute, ns, exposed, step, tokens_rank * mesh.world,
        memory.peak <= budget, budget, split, max_logit_s, max_logit_flops,
    )  # fmt: skip


@dataclass(frozen=True)
class RankEstimate:
    """One pp rank of a pipeline: its stages and layers, its peak, its work and its sends."""

    rank: int
    stages: list[int]
    layers: tuple[int, ...]
    peak: float
    peak_phase: str
    work_s: float  # compute, recompute and QK-Clip of its micro-batches
    waits_s: float  # its Newton-Schulz and exposed communication, the sends included
    sent: float  # p2p bytes an update
    in_flight: int  # the most micro-batches whose activations it holds at once, on one of its stages


def _pipelined(spec: RunSpec, mesh: Mesh, hw: Hardware, settings: PlanSettings) -> Estimate:
    """parallel.pp > 1 (k3train/plan/pipeline.py): each pp rank planned as a run of its own stages over a stage's
    ranks; the step is the slowest rank's work stretched by the bubble, then the most any rank spends on its
    optimizer and exposed communication; the memory is the rank with the largest peak."""
    plan = plan_pipeline(dataclasses.replace(spec, pp=mesh.pp))
    budget = usable_bytes(hw, mesh, settings.headroom)
    per_rank, ranks = [], []
    for r in range(mesh.pp):
        staged = stage_spec(spec, plan, r)
        comm = rank_comm(staged, plan, mesh.stage, r)
        e = _one_rank(staged, mesh.stage, comm, hw, settings, mesh.world)
        e.memory, most = rank_memory(staged, plan, mesh.stage, r, e.memory, settings.device_type)
        sent = sum(c.payload for c in e.comm if c.kind.startswith("PP "))
        work = e.compute_s + e.recompute_s + e.qk_clip_s
        waits = e.newton_schulz_s + e.exposed_s
        per_rank.append(e)
        ranks.append(
            RankEstimate(r, plan.stages(r), plan.layers(r), e.memory.peak, e.memory.peak_phase, work, waits, sent, most)
        )
    slowest = max(ranks, key=lambda x: x.work_s)
    bubble_s = slowest.work_s * plan.bubble / (1 - plan.bubble)
    waiting = max(ranks, key=lambda x: x.waits_s)
    shown = per_rank[waiting.rank]  # its communication is the table's
    largest = per_rank[max(ranks, key=lambda x: x.peak).rank]
    timed = per_rank[slowest.rank]
    return Estimate(
        mesh, largest.memory, shown.comm, shown.comm_seconds, timed.compute_s, timed.recompute_s,
        shown.newton_schulz_s, shown.exposed_s, slowest.work_s + bubble_s + waiting.waits_s, shown.tokens_per_step,
        largest.memory.peak <= budget, budget, timed.split_flops_per_token, timed.qk_clip_s, timed.qk_clip_flops,
        plan, bubble_s, ranks,
    )  # fmt: skip


PREFER = ("step", "memory")  # what a proposal minimises first: the step time, or the peak memory


def propose(
    spec: RunSpec,
    devices: int,
    hw: Hardware,
    settings: PlanSettings = DEFAULT_SETTINGS,
    prefer: str = "step",
) -> tuple[Estimate | None, list[Estimate]]:
    """(the chosen estimate or None, every candidate in the order tried); every candidate splits rows over
    settings.cp ranks (1 unless asked: --cp or the config's parallel.cp). Chosen: the fitting candidate with the
    shortest step (ties: the smaller peak), or with prefer="memory" the smallest peak (ties: the shorter step)."""
    meshes = [Mesh()] if devices == 1 else candidates(devices, spec.model.n_routed_experts, settings.cp, spec.pp)
    tried = [estimate(spec, mesh, hw, settings) for mesh in meshes]
    return best_fit(tried, prefer), tried


def best_fit(tried: list[Estimate], prefer: str = "step") -> Estimate | None:
    """The fitting estimate `prefer` ranks first (propose), or None."""
    if prefer not in PREFER:
        raise ValueError(f"prefer={prefer!r}: choose one of {', '.join(PREFER)}")
    fits = [e for e in tried if e.fits]
    if not fits:
        return None
    if prefer == "memory":
        return min(fits, key=lambda e: (e.memory.peak, e.step_s))
    return min(fits, key=lambda e: (e.step_s, e.memory.peak))


def why(chosen: Estimate | None, tried: list[Estimate], spec: RunSpec, prefer: str = "step") -> list[str]:
    """A few lines on the choice, or on why nothing fits."""
    gb = 1e9
    lines = []
    for family, label in ((lambda m: m.dp_shard == 1, "DDP"), (lambda m: m.dp_shard > 1, "FSDP")):
        planned = [e for e in tried if family(e.mesh) and e.mesh.world > 1]
        failed = [e for e in planned if not e.fits]
        if failed:
            best = min(failed, key=lambda e: e.memory.peak)
            lines.append(
                f"{label} with {_eps([e.mesh.ep for e in failed], [e.mesh.ep for e in planned])} does not fit: at "
                f"best {best.memory.peak / gb:,.1f} GB ({best.mesh}, {best.memory.peak_phase}) > "
                f"{best.budget / gb:,.1f} GB usable"
            )
    if chosen is None:
        best = min(tried, key=lambda e: e.memory.peak)
        items = ", ".join(f"{name} {value / gb:,.1f} GB" for name, value in _largest_items(best.memory))
        lines.append(
            f"nothing fits. Smallest peak: {best.mesh.describe()}, {best.memory.peak / gb:,.1f} GB in the "
            f"{best.memory.peak_phase}; largest items: {items}"
        )
        return lines
    lines.append(
        f"{chosen.mesh.describe()} fits: peak {chosen.memory.peak / gb:,.1f} GB of {chosen.budget / gb:,.1f} GB "
        f"usable ({chosen.memory.peak_phase}), {chosen.step_s:,.3g} s a step"
    )
    fits = [e for e in tried if e.fits]
    if len(fits) > 1:  # a proposal's choice among meshes that fit (a given mesh was not chosen)
        other = best_fit(tried, "memory" if prefer == "step" else "step")
        experts = spec.model.n_routed_experts // chosen.mesh.ep
        lines.append(
            f"the {'fastest' if prefer == 'step' else 'smallest peak'} of the {len(fits)} meshes that fit"
            + (f" (ep {chosen.mesh.ep}: {experts} experts a rank)" if chosen.mesh.ep > 1 else "")
        )
        if other is not chosen:
            lines.append(
                f"{'smallest peak' if prefer == 'step' else 'fastest'}: {other.mesh.describe()}, "
                f"{other.memory.peak / gb:,.1f} GB, {other.step_s:,.1f} s a step "
                f"(--prefer {'memory' if prefer == 'step' else 'step'} proposes it; --mesh {other.mesh} plans it)"
            )
    return lines


def _eps(failed: list[int], planned: list[int]) -> str:
    """'ep 1 to 128' where the eps that failed are a run of those planned, else each: 'ep 1, 4'."""
    start = planned.index(failed[0])
    if len(failed) > 1 and planned[start : start + len(failed)] == failed:
        return f"ep {failed[0]} to {failed[-1]}"
    return "ep " + ", ".join(map(str, failed))


def _largest_items(memory: Memory, count: int = 4) -> list[tuple[str, float]]:
    items = {"parameters": memory.params, "gradients": memory.grads, "activations": memory.activations,
             "weight copies": memory.weight_copies, **memory.optimizer, **memory.transients}  # fmt: skip
    if memory.pipeline_gathered:  # PipelineStage's FSDP2 units, gathered from a backward to the update's end
        items["FSDP2 weights gathered (pipeline)"] = memory.pipeline_gathered
    return sorted(items.items(), key=lambda kv: -kv[1])[:count]
