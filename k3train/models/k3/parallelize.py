"""How a KimiK3 is spread over a run's ranks (the model's `parallelize`, called by the parallel strategy:
k3train/train/parallel.py), as torchtitan's models/deepseek_v3/infra/parallelize.py is DeepSeek-V3's.

Every MoE balances over the data-parallel group (Quantile Balancing reduces over the global batch: MoE.balance_over), in
one process too (None: its own tokens). With ep > 1 each MoE keeps this rank's 1/ep of its routed experts
(MoE.shard_experts; their layout says `expert_parallel`, k3train/models/layout.py). Under FSDP2 those are not sharded
over all ranks but over the expert_dp ranks that hold the same experts, as their own unit (torchtitan's llama4
parallelize does the same), whose reduce-scatter divides by the world size (a pipeline stage's ranks), not by expert_dp
(the strategy's average_expert_gradients says why): on dim 0 (whole experts per rank) when each rank gets at least one,
else on dim 1, whose Newton-Schulz then gathers them (k3train/optim/muon.py), as torchtitan's shard_placement_fn does
(k3train/runtime/parallel_layout.expert_shard_dim, which the planner asks too). With expert_dp 1 there is nothing to
shard them over: FSDP2 ignores them and the strategy's average_expert_gradients divides them. The blocks and the root
are then FSDP2 units as any model's (k3train/models/common/parallelize.py).

The sharded-checkpoint layout of the routed experts is K3's too, and parallelize returns it (ROUTED_EXPERTS): the
whole [E, ...] weight over the expert mesh, Shard(0) over ep, then each ep rank's experts as FSDP2 placed them over
expert_dp (k3train/checkpoint/expert_shards.py assembles it from what this returns, and works nothing out again).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard

from k3train.models.common.parallelize import FullyShard, fully_shard_blocks
from k3train.models.k3.moe import MoE
from k3train.models.layout import ROUTED_EXPERTS, expert_shards
from k3train.runtime.parallel_layout import expert_shard_dim


def parallelize(model, dims, options: FullyShard | None) -> dict:
    """KimiK3.parallelize (k3train/models/protocol.py's Parallelizes): `options` FSDP2's under FSDP2, None under
    DDP. Returns the routed experts' sharded-checkpoint layout when ep > 1, {ROUTED_EXPERTS: (mesh, placements)}."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.balance_over(dims.dp_group)
    if options is not None and dims.world_size == 1:
        return {}
    if dims.ep > 1:
        if not moes:
            raise ValueError(f"parallel.ep={dims.ep}: {type(model).__name__} has no MoE layer to split")
        for moe in moes:
            moe.shard_experts(dims.ep_group)
    placement = Replicate()  # DDP: each ep rank's experts whole on every expert_dp rank
    if options is not None:
        placement = _fully_shard(model, moes, dims, options)
    if dims.ep == 1:
        return {}
    return {ROUTED_EXPERTS: _expert_checkpoint_layout(dims, placement)}


def _expert_checkpoint_layout(dims, placement) -> tuple[DeviceMesh, list]:
    """(mesh, placements) of a whole routed-expert weight in a checkpoint: Shard(0) over ep, then each rank's
    experts as `placement` (FSDP2's shard, or Replicate) over expert_dp, or under HSDP whole over the replica
    groups and `placement` over expert_shard."""
    if dims.layout.strategy == "hsdp":
        return dims.expert_hsdp_mesh, [Shard(0), Replicate(), placement]
    return dims.expert_mesh, [Shard(0), placement]


def _fully_shard(model, moes: list[MoE], dims, options: FullyShard):
    """The routed experts' units over the ranks holding the same ones (when there are several to shard them over:
    expert_dp, or under HSDP expert_shard within a replica group, replicated across the groups), then the blocks and
    the root; returns the experts' placement over those ranks."""
    experts = set(expert_shards(model))
    placement, ignored = Replicate(), None
    if experts and dims.expert_shard > 1:
        for moe in moes:
            placement = Shard(expert_shard_dim(moe.experts.w_gate.shape[0], dims.expert_shard))
            fully_shard(
                moe.experts,
                mesh=dims.expert_fsdp_mesh,
                shard_placement_fn=lambda p, placement=placement: placement,
                **options.kwargs,
            )
            moe.experts.set_gradient_divide_factor(float(dims.stage_world))
            if dims.device_type == "cpu":  # gloo has no PREMUL_SUM: a sum, divided after
                moe.experts.set_force_sum_reduction_for_comms(True)
    elif experts:  # each rank's own, whole (HSDP: on each replica): average_expert_gradients averages them
        ignored = experts
    fully_shard_blocks(model, dims.shard_mesh, options, ignored)
    return placement
