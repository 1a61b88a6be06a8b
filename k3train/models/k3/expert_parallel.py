"""Expert parallelism for the MoE: each rank of an expert-parallel group holds whole experts, 1/ep of them, and the
token slots travel to their experts' ranks and back by all-to-all.

    rank r of ep holds experts [r E/ep, (r+1) E/ep)             shard_experts(moe, group)

    slots sorted by expert (so by destination rank)  --all-to-all-->  each rank's slots for its experts, by source
    grouped by local expert -> the experts (GroupedSwiGLU)  -> ungrouped  --all-to-all-->  back in slot order
    -> times the gate weights (applied to the hidden, as in one process) -> summed per token

The router, the shared experts and the latent projections stay whole on every rank; only the routed experts'
weights are split. Both all-to-alls have variable splits (how many slots each rank sends each expert), exchanged
first as counts; they are autograd functions (torch.distributed._functional_collectives.all_to_all_single_autograd),
so the backward sends the gradients the same way in reverse. An expert's weight gradient on its rank is then the
sum over the tokens every rank of the group sent it. Reference: torchtitan's expert parallelism
(torchtitan/distributed/expert_parallel.py) and Megatron-Core's token dispatcher, which do the same exchange:
https://github.com/pytorch/torchtitan/blob/main/torchtitan/distributed/expert_parallel.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from k3train.models.k3.moe import MoE, expert_counts


def shard_experts(moe: MoE, group: dist.ProcessGroup) -> None:
    """Keep this rank's 1/ep of `moe`'s routed experts (whole experts) and dispatch across `group` from now on.
    Every rank must hold the same full experts before (the same seed, or a loaded checkpoint)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    if moe.n_experts % ep:
        raise ValueError(f"{moe.n_experts} routed experts do not split over parallel.ep={ep}: choose a divisor")
    per_rank = moe.n_experts // ep
    experts = moe.experts
    for name in ("w_gate", "w_up", "w_down"):
        full = getattr(experts, name)
        local = nn.Parameter(full.detach()[rank * per_rank : (rank + 1) * per_rank].clone())
        for key, value in vars(full).items():  # annotations such as head_split travel with the weight
            setattr(local, key, value)
        local.expert_parallel = ep  # 1/ep of the whole weight: its gradient, norm and checkpoint need the others
        local.expert_group = group  # the ranks holding the rest of it
        setattr(experts, name, local)
    moe.ep_group = group
    moe.first_local_expert = rank * per_rank


def expert_shards(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` that hold this rank's 1/ep of a routed-expert weight."""
    return [p for p in module.parameters() if getattr(p, "expert_parallel", 1) > 1]


def dispatch_across_ranks(moe: MoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """MoE.dispatch with the routed experts spread over moe.ep_group: x [N, w], weights/experts [N, k] -> [N, w]."""
    group = moe.ep_group
    ep = dist.get_world_size(group)
    per_rank = moe.n_experts // ep
    N, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots by expert, hence by the rank that holds it
    token_of_slot = order // k
    counts = expert_counts(flat, moe.n_experts)  # [E] slots this rank sends each expert
    received = torch.empty_like(counts)  # [ep * per_rank]: for each source rank, its slots for each local expert
    dist.all_to_all_single(received, counts, group=group)
    send_splits = counts.view(ep, per_rank).sum(1).tolist()
    recv_splits = received.view(ep, per_rank).sum(1).tolist()

    x_in = all_to_all_single_autograd(x.index_select(0, token_of_slot), recv_splits, send_splits, group)
    scale_in = all_to_all_single_autograd(weights.reshape(-1)[order].contiguous(), recv_splits, send_splits, group)
    # the received slots come source by source, each source's by expert: group them by local expert
    local_expert = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(received)
    grouped = torch.argsort(local_expert, stable=True)
    local_counts = received.view(ep, per_rank).sum(0)
    # through the module, so FSDP2 (which may shard these experts again over expert_dp) gathers them first
    y = moe.experts(x_in.index_select(0, grouped), local_counts, scale_in[grouped])
    y_back = all_to_all_single_autograd(y.index_select(0, torch.argsort(grouped)), send_splits, recv_splits, group)
    return y_back.new_zeros(N, y_back.shape[1]).index_add_(0, token_of_slot, y_back)
