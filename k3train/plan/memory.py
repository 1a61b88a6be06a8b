"""Memory per device for a run spec on a mesh: what is stored all along, what one micro-batch keeps, the largest
transients, and the peak of each phase of a step.

Stored (fp32, k3train's dtype for parameters, gradients and optimizer state under every precision; autocast only
casts): parameters, their gradients from the backward to the update (set to None after it), Muon's one momentum
buffer and AdamW's two moments per parameter as k3train/optim/param_groups.py assigns them; DDP's gradient buckets
(DistributedDataParallel's default keeps the gradients a second time in its buckets). Sharding as FSDP2 does it:
dim 0 of every parameter split over dp_shard, padded to a multiple (so a tensor shorter than dp_shard costs a row
on every rank); the routed experts first split over ep (E / ep whole experts per rank), then over dp_shard / ep.
Under DDP every rank holds everything, MuonAdamW's state included. FSDP2 with gradient accumulation keeps the
gradients unsharded between micro-batches (k3train's no_sync: set_requires_gradient_sync(False)).

A step's phases, each the stored bytes plus what is alive then:
- forward end: every layer's saved activations and weight copies (k3train/plan/activations.py), the root's, and
  the largest forward transient (the LM head's logits chunk in k3train/models/common/loss.py; FSDP2's gathered
  root, gathered from the embedding to the loss, with two blocks, the current one and the prefetched next; QK-Clip's
  max logit, measured one tile of logits [heads, tile, tile] at a time; Quantile Balancing's exchanged candidates;
  EP's dispatch buffers);
- backward, layer by layer from the last: the activations of the layers below, the finished layers' gradients,
  and the current layer's working set: gradients as large as what it saved, plus its recompute under checkpointing,
  plus, under FSDP, the gathered root and two blocks, one block's unsharded gradients (the reduce-scatter's input)
  and the root's unsharded gradients (reduce-scattered when the backward ends);
- optimizer step: the gradients and the update's temporaries (AdamW's in MuonAdamW: 3 x the largest parameter;
  Muon's: the momentum's Nesterov copy and Newton-Schulz's iterates of the largest matrix; over several ranks, the
  all-gathered updates of a whole group (DDP) or an owner's exchange buffers (FSDP2), k3train/plan/muon.py).
A pipeline rank (parallel.pp, k3train/plan/pipeline.py) is its stages' plan (no DDP buckets: the pipeline reduces
its gradients itself) plus what the schedule holds: the other micro-batches in flight (forward end and backward),
torch's receive buffers (every phase) and autocast's cached weight casts through the backward (pipeline.rank_memory).
The optimizer state exists through every phase, except on the first step (it is made in the first update), which
is what `first_step_added` describes: the bytes one first step adds to a process that has built the model and the
optimizer (benchmarks/bench_plan.py measures that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from k3train.models.common.loss import default_chunk_size
from k3train.plan.activations import F32, I64, ContextSlice, LayerActivations, layer_activations, root_activations
from k3train.plan.mesh import Mesh, rank_rows
from k3train.plan.muon import NS_BYTES, muon_groups, muon_shares
from k3train.plan.spec import Param, RunSpec
from k3train.runtime.parallel_layout import expert_shard_dim


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: dict[str, float]  # "Muon momentum", "AdamW moments"
    ddp_buckets: float
    activations: float  # one micro-batch: every layer's and the root's saved tensors
    weight_copies: float  # held at the forward's end
    transients: dict[str, float]  # the largest of each kind
    phases: dict[str, float] = field(default_factory=dict)  # phase -> bytes per device
    first_step_added: float = 0.0
    in_flight: float = 0.0  # a pipeline rank: the activations of the micro-batches in flight beyond one a stage
    pipeline_buffers: float = 0.0  # a pipeline rank: torch's receive buffers, one a micro-batch and tensor
    pipeline_gathered: float = 0.0  # a pipeline rank under FSDP2: its stages' parameters gathered, fp32

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


HALF = ("bf16", "fp16")


def gather_bytes(spec: RunSpec, mesh: Mesh) -> int:
    """The element FSDP2 gathers (and computes with): bf16 / fp16 under precision bf16 / fp16 over dp_shard > 1
    ranks (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): k3train/train/precision.py's fsdp_policy),
    else the fp32 master weights themselves."""
    return spec.act_bytes if spec.precision in HALF and mesh.dp_shard > 1 else F32


def half_gathers(spec: RunSpec, mesh: Mesh) -> tuple[bool, bool]:
    """(the FSDP units' weights, the routed experts') gathered in bf16 / fp16: the experts only where FSDP2 shards
    them (expert_shard > 1; otherwise it ignores them and they stay fp32 for autocast to cast)."""
    half = gather_bytes(spec, mesh) < F32
    return half, half and mesh.expert_shard > 1


def shard_bytes(p: Param, mesh: Mesh, element: int = F32) -> float:
    """Bytes of `p` one rank stores: FSDP2's dim-0 shard, padded to a whole row per rank. The routed experts are
    first split over ep; when fewer local experts remain than ranks to shard them over, dim 1 is split instead (as
    torchtitan's shard_placement_fn does), not padded to an expert per rank."""
    dim0, rest = p.shape[0], p.numel // p.shape[0]
    shards = mesh.dp_shard
    if p.routed:
        dim0, shards = dim0 // mesh.ep, mesh.expert_shard
        if expert_shard_dim(dim0, shards) == 1:
            return dim0 * math.ceil(p.shape[1] / shards) * (rest // p.shape[1]) * element
    return math.ceil(dim0 / shards) * rest * element


def local_bytes(p: Param, mesh: Mesh, element: int = F32) -> float:
    """Bytes of `p` a rank computes with (gathered): the whole tensor, its ep share of the routed experts."""
    return p.numel * element / (mesh.ep if p.routed else 1)


def unit_bytes(spec: RunSpec, mesh: Mesh, trainable_only: bool = False, element: int = F32) -> dict[str, float]:
    """Each FSDP unit's parameters as gathered on one rank (`element` bytes each), in one pass over the parameters
    (a unit at a time is units x parameters: a tenth of a second for K3, which the recipe search pays per plan)."""
    out = dict.fromkeys(spec.units, 0.0)
    for p in spec.params:
        if not (trainable_only and p.kind == "frozen"):
            out[p.unit] += local_bytes(p, mesh, element)
    return out


def stored(spec: RunSpec, mesh: Mesh) -> tuple[float, dict[str, float], dict[str, float]]:
    """(parameters, each trainable parameter's gradient, the optimizer state by kind): bytes per device kept
    through the step, whatever the micro-batch, precision or checkpointing."""
    trainable = [p for p in spec.params if p.kind != "frozen"]
    params = sum(shard_bytes(p, mesh) for p in spec.params)
    unsharded_grads = mesh.dp_shard > 1 and spec.accumulation > 1  # no_sync keeps FSDP2's gradients whole
    grad_of = {p.name: (local_bytes(p, mesh) if unsharded_grads else shard_bytes(p, mesh)) for p in trainable}
    optimizer = {
        "Muon momentum": sum(shard_bytes(p, mesh) for p in trainable if p.kind == "muon"),
        "AdamW moments": sum(2 * shard_bytes(p, mesh) for p in trainable if p.kind == "adamw"),
    }
    return params, grad_of, {k: v for k, v in optimizer.items() if v}


def stored_floor(spec: RunSpec, mesh: Mesh) -> float:
    """Parameters, gradients and optimizer state: the optimizer step holds all three, so no plan of `spec` on
    `mesh` peaks lower. The recipe search (search.py) skips a mesh whose floor is over budget unplanned."""
    params, grad_of, optimizer = stored(spec, mesh)
    return params + sum(grad_of.values()) + sum(optimizer.values())


def plan_memory(spec: RunSpec, mesh: Mesh, device_type: str) -> Memory:
    c, act = spec.model, spec.act_bytes
    sharded = mesh.dp_shard > 1
    trainable = [p for p in spec.params if p.kind != "frozen"]
    params, grad_of, optimizer = stored(spec, mesh)
    grads = sum(grad_of.values())
    # DDP's buckets: every gradient but the expert-parallel shards', which DDP leaves out (k3train/train/parallel.py)
    ddp_buckets = 0.0
    if mesh.world > 1 and not sharded and spec.pp == 1:  # a pipeline reduces its stages' gradients without DDP
        ddp_buckets = sum(grad_of[p.name] for p in trainable if not (p.routed and mesh.ep > 1))

    layers = planned_layers(spec, mesh, device_type)
    tokens = rank_slice(spec, mesh)[0]
    root = root_activations(c, tokens, act, spec.first, spec.last)
    activations = sum(la.saved for la in layers) + root
    copies = sum(la.copies_saved + la.copies_cached for la in layers)
    forward = forward_transients(spec, mesh, device_type)
    memory = Memory(params, grads, optimizer, ddp_buckets, activations, copies, dict(forward))

    stored_without_state = params + ddp_buckets
    state = sum(optimizer.values())
    grads_along = grads if spec.accumulation > 1 else 0.0  # earlier micro-batches' gradients
    fwd = activations + copies + grads_along + max(forward.values(), default=0.0)
    bwd = backward_peak(spec, mesh, layers, grad_of, device_type)
    opt_transients = optimizer_transients(spec, mesh, device_type)
    memory.transients.update(opt_transients)
    opt = grads + max(opt_transients.values(), default=0.0)
    memory.phases = {
        "forward end": stored_without_state + state + fwd,
        "backward": stored_without_state + state + bwd,
        "optimizer step": stored_without_state + state + opt,
    }
    # DDP's buckets exist before the first step; on a CPU their pages become resident only when the first backward
    # writes them (bench_plan.py: a 2-rank DDP step grew by the gradients plus the buckets)
    untouched = ddp_buckets if device_type == "cpu" else 0.0
    memory.first_step_added = max(fwd, bwd + untouched, opt + state + untouched)
    return memory


def planned_layers(spec: RunSpec, mesh: Mesh, device_type: str) -> list[LayerActivations]:
    """What each layer planned (spec.layer_ids) keeps for one micro-batch on one rank."""
    tokens, length, context = rank_slice(spec, mesh)
    local_experts = spec.model.n_routed_experts // mesh.ep
    half_weights, half_experts = half_gathers(spec, mesh)
    return [
        layer_activations(
            spec.model, i, tokens, length, spec.checkpointing, spec.act_bytes, device_type, local_experts, context,
            spec.documents, half_weights, half_experts,
        )
        for i in spec.layer_ids
    ]  # fmt: skip


def rank_slice(spec: RunSpec, mesh: Mesh) -> tuple[int, int, ContextSlice | None]:
    """(tokens of a micro-batch on one rank, positions of each row it holds, its slice of the rows or None): under
    cp the last rank of a group, whose MLA keys are the whole row (the most any rank keeps)."""
    if mesh.cp == 1:
        return spec.tokens, spec.seq_len, None
    return spec.rank_tokens(mesh.cp), spec.seq_len // mesh.cp, ContextSlice.last(mesh.cp)


def forward_transients(spec: RunSpec, mesh: Mesh, device_type: str) -> dict[str, float]:
    """The largest short-lived allocations of a forward, by kind (bytes per device)."""
    c, act = spec.model, spec.act_bytes
    N, length, context = rank_slice(spec, mesh)
    V, d = c.vocab_size, c.d_model
    out = {}
    if spec.last:  # the loss's stage
        rows = min(default_chunk_size(V, "cpu" if device_type == "cpu" else "cuda"), N)
        loss = rows * V * F32
        if act < F32:  # fp32 accumulator, the weight's cast, a chunk's product; the logits chunk's cast
            loss += V * d * (F32 + 2 * act) + rows * V * act
        out["LM head logits chunk (loss)"] = loss
    if mesh.dp_shard > 1:
        out["FSDP gathered root + two blocks"] = fsdp_gathered(spec, mesh)
    kinds = spec.held_kinds()
    if spec.qk_clip and "mla" in kinds:  # one tile of causal_max_logit (k3train/models/k3/mla.py)
        h, q = c.mla_n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        side = spec.costs.max_logit_tile(h, "cpu" if device_type == "cpu" else "cuda")
        rows, keys = min(side, length), min(side, spec.seq_len)  # under cp the keys reach past a rank's queries
        # bool: the diagonal's causal mask, made once; a tile's mask and its negation, with documents their ids'
        # equality too
        masks = rows * rows + (3 * rows * keys if spec.documents else rows * rows)
        casts = h * (rows + keys) * q * F32 if act < F32 else 0  # the tile's queries and keys in fp32
        out["QK-Clip max-logit tile [heads, tile, tile]"] = h * rows * keys * F32 + masks + casts
    if context is not None and "mla" in kinds:  # the gathered latent and the bool mask of a layer
        latent = spec.batch_size * spec.seq_len * (c.kv_lora_rank + c.qk_rope_head_dim) * act
        mask = (spec.batch_size if spec.documents else 1) * length * spec.seq_len  # bool
        out["CP MLA gathered latent + mask"] = latent + mask
    moe = any(c.is_moe_layer(i) for i in spec.layer_ids)
    if moe and c.router == "quantile_balancing":
        n = c.n_routed_experts
        m = spec.costs.quantile_rank(N * mesh.world, c.experts_per_token, n)
        if mesh.world > 1:  # r; this rank's candidates (top-k values, indices) and their copy by expert block;
            # the block's candidates from every rank, received and transposed; the quantile's top-k over them
            cands, block = min(m + 1, N), rank_rows(n, mesh.world, 0)
            received = mesh.world * cands * block * F32
            out["Quantile Balancing candidates"] = (
                N * n * F32 + cands * n * (2 * F32 + I64) + 2 * received + (m + 1) * block * (F32 + I64)
            )
        else:  # the required biases and the scores they are made from; the quantile's top-k
            out["Quantile Balancing candidates"] = 2 * N * n * F32 + (m + 1) * n * (F32 + I64)
    if moe and mesh.ep > 1:
        r = c.expert_latent_dim or d
        out["EP dispatch + combine buffers"] = 2 * N * c.experts_per_token * r * act
    return out


def fsdp_gathered(spec: RunSpec, mesh: Mesh) -> float:
    """FSDP2's gathered parameters at once: the root's (gathered for the whole forward and the whole backward: it
    wraps them) and two blocks' (the current one and the next, prefetched), in the gathered dtype (gather_bytes)."""
    gathered = unit_bytes(spec, mesh, element=gather_bytes(spec, mesh))
    return gathered["root"] + 2 * max(b for unit, b in gathered.items() if unit != "root")


def backward_peak(
    spec: RunSpec, mesh: Mesh, layers: list[LayerActivations], grad_of: dict[str, float], device: str
) -> float:
    """The most the backward holds beyond the stored bytes: layer by layer from the last, the layers below still
    saved, the layers done as gradients, and the current layer's gradients and recompute."""
    c, act = spec.model, spec.act_bytes
    grads_by_unit: dict[str, float] = {}
    for p in spec.params:
        if p.name in grad_of:
            grads_by_unit[p.unit] = grads_by_unit.get(p.unit, 0.0) + grad_of[p.name]
    sharded = mesh.dp_shard > 1
    fsdp = 0.0
    if sharded:  # the root's gradients stay unsharded until the backward ends (its unit's post-backward)
        trainable_by_unit = unit_bytes(spec, mesh, trainable_only=True)
        fsdp = fsdp_gathered(spec, mesh) + max(b for unit, b in trainable_by_unit.items() if unit != "root")
        root_grads = [p for p in spec.params if p.unit == "root" and p.name in grad_of]
        grads_by_unit["root"] = sum(local_bytes(p, mesh) for p in root_grads)
    loss_backward = 0.0
    if spec.last and (
        device != "cpu" or spec.accumulation > 1
    ):  # the loss's gradients scaled by 1 / accumulation: copies
        loss_backward = c.vocab_size * c.d_model * act + rank_slice(spec, mesh)[0] * c.d_model * act
    below = sum(la.saved + la.copies_saved for la in layers)
    # the LM head's gradient, made by the loss in the forward; a pipeline's first stage makes the embedding's last
    done = grads_by_unit.get("root", 0.0) if spec.last else 0.0
    peak = 0.0
    recomputes = spec.checkpointing != "none"
    local_experts = c.n_routed_experts // mesh.ep
    last = spec.layer_ids[-1]
    for i, la in reversed(list(zip(spec.layer_ids, layers))):
        below -= la.saved + la.copies_saved
        work = la.full  # the gradients of what it saved
        if recomputes:
            work += la.full - la.saved
            work += _recompute_copies(spec, mesh, i, act, device, local_experts)
        held = below + la.saved + la.copies_saved + work + done + fsdp + (loss_backward if i == last else 0)
        peak = max(peak, held)
        done += grads_by_unit.get(f"layers.{i}", 0.0)
    if not spec.last:
        peak = max(peak, done + grads_by_unit.get("root", 0.0) + fsdp)
    if getattr(c, "tie_embeddings", False):  # the embedding's own gradient before it joins the LM head's
        peak = max(peak, done + c.vocab_size * c.d_model * F32 + fsdp)
    return peak


def _recompute_copies(spec: RunSpec, mesh: Mesh, layer: int, act: int, device: str, local_experts: int) -> float:
    """The weight copies a recomputed layer makes again (its none-mode copies; no per-token part, so no slice)."""
    half = half_gathers(spec, mesh)
    la = layer_activations(spec.model, layer, 1, spec.seq_len, "none", act, device, local_experts, None, False, *half)
    return la.copies_saved


def optimizer_transients(spec: RunSpec, mesh: Mesh, device_type: str = "cuda") -> dict[str, float]:
    """The update's largest temporaries, by kind (bytes per device)."""
    trainable = [p for p in spec.params if p.kind != "frozen"]
    adamw = [p for p in trainable if p.kind == "adamw"]
    muon = [p for p in trainable if p.kind == "muon"]
    out: dict[str, float] = {}
    if spec.optimizer == "adamw":
        fused = mesh.dp_shard == 1  # torch's fused kernel on plain tensors; foreach on FSDP2's DTensors
        out["AdamW update"] = 0.0 if fused else sum(shard_bytes(p, mesh) for p in adamw)
        return out
    if adamw:  # MuonAdamW's AdamW: denominator, update, its square, per parameter
        out["AdamW update (largest parameter)"] = 3 * max(shard_bytes(p, mesh) for p in adamw)
    if muon:
        ns = NS_BYTES[spec.ns_dtype]
        largest = max(local_bytes(p, mesh, 1) for p in muon)  # elements of the whole matrix (an owner's, FSDP2)
        per_element = F32 + 3 * ns + (F32 if ns < F32 else 0) + F32  # Nesterov, iterates, fp32 copy, square
        out["Muon Newton-Schulz (largest matrix)"] = largest * per_element
        shares = [s for group in muon_groups(spec) for s in muon_shares(spec, mesh, group, device_type=device_type)]
        exchanged = [s for s in shares if s.transient]
        if exchanged:  # one group at a time: the largest exchange's buffers (k3train/plan/muon.py)
            s = max(exchanged, key=lambda s: s.transient)
            name = (
                "Muon gathered updates (largest group)"
                if s.how == "all-gather"
                else "Muon owner exchange (largest round)"
            )
            out[name] = s.transient
    return out
