"""Communication per step and per rank, by kind, for a run spec on a mesh.

Each kind has a payload (the bytes of the collective's whole tensor, summed over its calls in one optimizer step,
as torch.distributed is handed them: an all-gather's output, a reduce-scatter's input, an all-reduce's buffer)
and the bytes one rank sends on the wire, ring algorithms assumed: (G - 1) / G of the payload for an all-gather or
a reduce-scatter over G ranks, twice that for an all-reduce, and for an all-to-all the (G - 1) / G of its own
tokens that leave it.

- FSDP all-gather: every unit (each transformer block, then the root) gathered in the compute dtype: bf16 under
  precision=bf16 (fp16 under fp16), k3train's FSDP passing MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32) to every fully_shard (k3train/train/precision.py's fsdp_policy), else fp32 (the master
  weights themselves), padded to dp_shard rows: forward, and again in the backward with reshard_after_forward
  (the default, the root included, as k3train passes True explicitly); every micro-batch. The routed experts of a
  unit over the dp_shard / ep ranks that share them, E / ep of them.
- FSDP reduce-scatter: the gradients of every unit once per step (no_sync holds them for the earlier
  micro-batches), fp32 under every precision (the policy's reduce_dtype); frozen parameters have none.
- DDP all-reduce: all gradients once per step (no_sync), fp32.
- HSDP all-reduce (dp_replicate x dp_shard): after each unit's reduce-scatter within a replica group, its padded
  gradient shard all-reduced across the dp_replicate groups, once per step, fp32 (FSDP2 over a 2-D mesh).
- EP all-to-all (k3train/models/k3/moe/dispatch.py): per MoE layer and micro-batch, dispatch and combine in the
  forward and their gradients in the backward (4; 6 when checkpointing recomputes the routed experts), each tokens
  x top-k x the routed width (the latent width for a latent MoE: k3train projects before dispatch) x the activation
  bytes; beside them the gate weights (fp32, forward and backward) and the per-expert slot counts (int64). Summed
  over an ep group's ranks these are exact; one rank's share of the returns depends on the routing.
- Expert gradient all-reduce (DDP with ep): each rank's experts over the ranks that hold the same ones (expert_replicas:
  a stage's ranks / ep under pipeline parallelism, the other stages holding other layers), one all-reduce a weight,
  after the backward (k3train/train/parallel.average_expert_gradients; under pp after the schedule, per stage).
- Newton-Schulz (MuonAdamW over several ranks, k3train/plan/muon.py): under DDP per Muon group one all-gather of the
  orthogonalised updates (ranks x the largest owner's share, in the Newton-Schulz dtype); under FSDP2 two
  all-to-alls a round, the busiest rank's inputs: its shard of every matrix to the owners, then the whole updates
  of the matrices it owns back to their shards' ranks (routed experts sliced on dim 1: over the ranks holding them).
- Quantile Balancing (the MoE's router over several ranks, k3train/models/k3/moe/balancing.py): per MoE layer and
  training forward, an all-gather of the loads (n + 1 fp64 per rank); an all-to-all of each rank's m + 1 smallest
  required biases per expert (fp32; all its tokens once m + 1 exceeds them, m = global tokens x k / n), each
  expert's to the rank that takes its block (ceil(n / W) experts); an all-gather of the blocks' biases (fp32, padded
  to the widest).
  The other routers gather only the loads.
- Context parallelism (k3train/models/common/context_parallel.py), per layer and micro-batch over the cp ranks
  that split a row, each an all-gather (again in a recompute when checkpointing recomputes the mixer) whose backward
  reduce-scatters a tensor of the same size: KDA's slice summaries [M | F], B x heads x K x (K + V) fp32 a rank
  (k3train/models/kda/context_parallel.py); its short convs' tails, the last conv_size - 1 positions of q, k, v
  side by side (B x (conv_size - 1) x 3 heads x K in the activation dtype); MLA's latent, B x T_l x (kv_lora_rank +
  rope) in the activation dtype. With document masking the ids travel too (int64, no gradient), once a micro-batch:
  the forward's Documents gathers every rank's B x T_l ids for all the layers, a recompute reads them again
  (k3train/models/common/documents.py).
- Pipeline parallelism (parallel.pp: each pp rank's stages planned over the stage's ranks, k3train/plan/pipeline.py):
  the data-parallel kinds above over a stage's ranks and its parameters, but FSDP2's all-gathers as torch's
  PipelineStage leaves them (a unit gathered only when sharded at a forward or backward: pipeline.fsdp_gathers) and
  its reduce-scatter (and HSDP's all-reduce) once an update, after the schedule; under DDP the stage's gradients
  all-reduced one at a time after the schedule (k3train/train/pipeline.Pipeline.reduce_gradients: not overlapped);
  "PP activations send" and "PP gradients send", what the rank sends to the stages after and before it (payload
  and wire alike, waited for).
Not counted: scalars (the loss, the gradient norm, QK-Clip's per-head maxima, Muon's weight norms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3train.plan.activations import F32
from k3train.plan.memory import gather_bytes, shard_bytes
from k3train.plan.mesh import Mesh, rank_rows
from k3train.plan.muon import muon_groups, muon_shares
from k3train.plan.spec import RunSpec


@dataclass(frozen=True)
class Collective:
    kind: str
    payload: float  # bytes per step, summed over its calls (see the module docstring)
    wire: float  # bytes one rank sends per step
    ranks: int  # the group's size
    calls: int  # per step
    overlapped: bool  # runs beside compute (FSDP2's prefetch, DDP's buckets) rather than waiting for it
    all_to_all: bool = False


def ring(payload: float, ranks: int, factor: float = 1.0) -> float:
    return factor * payload * (ranks - 1) / ranks


def fsdp_gather_payload(spec: RunSpec, mesh: Mesh, trainable_only: bool = False) -> tuple[float, float]:
    """(dense, routed) bytes of one pass of every FSDP unit's all-gather (in the gathered dtype: bf16 under
    precision=bf16) or reduce-scatter (trainable_only: fp32, MixedPrecisionPolicy's reduce_dtype), as FSDP2 pads
    them: ranks x the padded shard."""
    element = F32 if trainable_only else gather_bytes(spec, mesh)
    dense = routed = 0.0
    for p in spec.params:
        if trainable_only and p.kind == "frozen":
            continue
        if p.routed:
            routed += mesh.expert_shard * shard_bytes(p, mesh, element)
        else:
            dense += mesh.dp_shard * shard_bytes(p, mesh, element)
    return dense, routed


def plan_comm(spec: RunSpec, mesh: Mesh) -> list[Collective]:
    c, A = spec.model, spec.accumulation
    units = len(spec.units)
    out: list[Collective] = []
    if mesh.dp_shard > 1:
        passes = 2 if spec.reshard_after_forward else 1
        dense, routed = fsdp_gather_payload(spec, mesh)
        for name, payload, ranks in (("", dense, mesh.dp_shard), (" (routed experts)", routed, mesh.expert_shard)):
            if payload and ranks > 1:
                total = A * passes * payload
                kind = f"FSDP all-gather{name}"
                out.append(Collective(kind, total, ring(total, ranks), ranks, A * passes * units, True))
        dense, routed = fsdp_gather_payload(spec, mesh, trainable_only=True)
        for name, payload, ranks in (("", dense, mesh.dp_shard), (" (routed experts)", routed, mesh.expert_shard)):
            if payload and ranks > 1:
                out.append(Collective(f"FSDP reduce-scatter{name}", payload, ring(payload, ranks), ranks, units, True))
    if mesh.dp_replicate > 1 and mesh.dp_shard > 1:  # HSDP: each unit's reduce-scattered (padded) shard, once
        grads = sum(shard_bytes(p, mesh) for p in spec.params if p.kind != "frozen")
        R = mesh.dp_replicate
        out.append(Collective("HSDP all-reduce", grads, ring(grads, R, 2), R, units, True))
    elif mesh.dp_replicate > 1:
        split = mesh.ep > 1  # DDP leaves the expert-parallel shards out of its all-reduce
        reduced = [p for p in spec.params if p.kind != "frozen" and not (split and p.routed)]
        grads = sum(shard_bytes(p, mesh) for p in reduced)
        R = mesh.dp_replicate
        if spec.pp > 1:  # a pipeline's stages: a gradient at a time, after the schedule (Pipeline.reduce_gradients)
            out.append(Collective("DDP all-reduce", grads, ring(grads, R, 2), R, len(reduced), False))
        else:
            out.append(Collective("DDP all-reduce", grads, ring(grads, R, 2), R, 1, True))
        held = [p for p in spec.params if p.kind != "frozen" and split and p.routed]
        experts = sum(shard_bytes(p, mesh) for p in held)
        if experts and mesh.expert_replicas > 1:  # finish_gradients: over the ranks holding the same experts
            G = mesh.expert_replicas
            out.append(Collective("expert gradient all-reduce", experts, ring(experts, G, 2), G, len(held), False))
    moe_layers = sum(1 for i in spec.layer_ids if c.is_moe_layer(i))
    if mesh.ep > 1 and moe_layers:
        slots = spec.rank_tokens(mesh.cp) * c.experts_per_token
        forwards = 2 if spec.checkpointing != "none" else 1  # the recompute exchanges again
        per_layer = (2 * forwards + 2) * slots * (c.expert_latent_dim or c.d_model) * spec.act_bytes
        per_layer += (forwards + 1) * slots * F32 + forwards * c.n_routed_experts * 8  # gate weights, counts
        calls = A * moe_layers * (4 * forwards + 3)  # forward: counts, slots, gate weights, results; backward: 3
        payload = A * moe_layers * per_layer
        out.append(Collective("EP all-to-all", payload, ring(payload, mesh.ep), mesh.ep, calls, False, True))
    if spec.optimizer == "muon_adamw" and mesh.world > 1:
        for group in muon_groups(spec):
            for share in muon_shares(spec, mesh, group):
                name = f"Newton-Schulz {'update all-gather' if share.how == 'all-gather' else 'all-to-all'} ({group})"
                wire = ring(share.payload, share.ranks)
                if share.how != "own":
                    out.append(
                        Collective(
                            name, share.payload, wire, share.ranks, share.calls, False, share.how != "all-gather"
                        )
                    )
    if mesh.cp > 1:
        out += context_parallel_comm(spec, mesh)
    if moe_layers and mesh.world > 1:  # every training forward sums the loads over ranks, whatever the router
        n, W, N = c.n_routed_experts, mesh.world, spec.rank_tokens(mesh.cp)
        per_layer = W * (n + 1) * 8  # the loads, fp64
        if c.router == "quantile_balancing":
            m = spec.costs.quantile_rank(N * W, c.experts_per_token, n)
            sent = A * moe_layers * min(m + 1, N) * n * F32  # each rank's candidates, by expert block
            out.append(Collective("Quantile Balancing all-to-all", sent, ring(sent, W), W, A * moe_layers, False, True))
            per_layer += W * rank_rows(n, W, 0) * F32  # the blocks' biases, padded to the widest
        calls = A * moe_layers * (2 if c.router == "quantile_balancing" else 1)
        payload = A * moe_layers * per_layer
        out.append(Collective(f"{_router_name(c.router)} all-gather", payload, ring(payload, W), W, calls, False))
    return out


def context_parallel_comm(spec: RunSpec, mesh: Mesh) -> list[Collective]:
    """The cp exchanges of one step (module docstring): an all-gather and its backward's reduce-scatter per kind."""
    c, A, G, act = spec.model, spec.accumulation, mesh.cp, spec.act_bytes
    B, T = spec.batch_size, spec.seq_len // mesh.cp
    forwards = 2 if spec.checkpointing != "none" else 1  # checkpointing recomputes the mixers, exchanges included
    kda = spec.held_kinds().count("kda")
    mla = len(spec.layer_ids) - kda
    H, K, n = c.kda_n_heads, c.kda_head_dim, c.kda_conv_size - 1
    kinds = [  # name, layers, a rank's share per call (the backward returns as much)
        ("CP KDA state", kda, H * K * 2 * K * F32 * B),
        ("CP conv tails", kda, n * 3 * H * K * act * B),
        ("CP MLA latent", mla, T * (c.kv_lora_rank + c.qk_rope_head_dim) * act * B),
    ]
    out = []
    if spec.documents:  # int64 [B, T_l] a rank, once a micro-batch for every layer (no gradient, no recompute)
        payload = A * G * B * T * 8
        out.append(Collective("CP document ids all-gather", payload, ring(payload, G), G, A, False))
    for name, layers, sent in kinds:
        if not layers:
            continue
        payload = A * layers * G * forwards * sent
        calls = A * layers * forwards
        out.append(Collective(f"{name} all-gather", payload, ring(payload, G), G, calls, False))
        payload = A * layers * G * sent
        out.append(Collective(f"{name} reduce-scatter", payload, ring(payload, G), G, A * layers, False))
    return out


def _router_name(router: str) -> str:
    return "Quantile Balancing" if router == "quantile_balancing" else "MoE load"


def seconds(coll: Collective, mesh: Mesh, hw, world: int | None = None) -> float:
    """Wire time of a collective on `hw`: inside a node at the link's one-way bandwidth, across nodes at the
    network's; an all-to-all splits its bytes between the two. Groups are laid out with ep innermost, then the
    rest of dp_shard, then dp_replicate, then pp, so a group of G consecutive ranks stays in a node while G fits
    one. world: the run's devices, when `mesh` is one pipeline stage's (a pipeline's peers are a stage apart)."""
    node = hw.node_size(world or mesh.world)
    link, network = hw.link_one_way, hw.network_one_way
    if coll.ranks <= 1:
        return 0.0
    spans = _span(coll, mesh) > node
    if coll.all_to_all:
        inside = min(node, coll.ranks) - 1
        off = (coll.ranks - 1 - inside) / (coll.ranks - 1)
        t_in = coll.wire * (1 - off) / link if link else math.inf
        t_off = coll.wire * off / network if off and network else (math.inf if off else 0.0)
        return max(t_in, t_off)
    bandwidth = network if spans else link
    if bandwidth is None:
        return math.inf
    return coll.wire / bandwidth


def _span(coll: Collective, mesh: Mesh) -> int:
    """How many consecutive ranks the group covers: routed experts' FSDP groups stride over ep."""
    if "routed experts" in coll.kind or "muon_experts" in coll.kind:
        return coll.ranks * mesh.ep
    if coll.kind.startswith("HSDP"):  # across the replica groups, dp_shard ranks apart
        return coll.ranks * mesh.dp_shard
    if coll.kind.startswith("PP "):  # to the next or the previous stage's rank: a stage's ranks apart
        return mesh.world + 1
    return coll.ranks
