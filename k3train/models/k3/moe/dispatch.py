"""Token dispatchers: how the N*k token slots reach the routed experts and come back. A dispatcher's `dispatch`
groups the slots by expert for RoutedExperts (rows, counts per expert, each row's gate weight) and `combine` sums
the experts' rows back into their tokens; the MoE runs its experts in between, so that FSDP2's hooks on the experts
module still gather their weights first.

    LocalDispatch         every expert on this rank: the slots sorted by expert (stable), then index_add back
    AllToAllDispatch      expert parallelism: each rank of `group` holds whole experts, 1/ep of them

        rank r of ep holds experts [r E/ep, (r+1) E/ep)             (MoE.shard_experts)

        slots sorted by expert (so by destination rank)  --all-to-all-->  each rank's slots for its experts, by source
        grouped by local expert -> the experts (GroupedSwiGLU)  -> ungrouped  --all-to-all-->  back in slot order
        -> (times the gate weights, applied to the hidden, as in one process) -> summed per token

Under expert parallelism the router, the shared experts and the latent projections stay whole on every rank; only
the routed experts' weights are split. Both all-to-alls have variable splits (how many slots each rank sends each
expert), exchanged first as counts; they are autograd functions (all_to_all_single_autograd), so the backward sends
the gradients the same way in reverse. An expert's weight gradient on its rank is then the sum over the tokens
every rank of the group sent it. The shape follows torchtitan's token dispatcher and expert parallelism
(torchtitan/distributed/expert_parallel.py) and Megatron-Core's token dispatcher, which do the same exchange:
https://github.com/pytorch/torchtitan/blob/main/torchtitan/distributed/expert_parallel.py
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from k3train.models.k3.moe.router import expert_counts


class Dispatched(NamedTuple):
    """What a dispatch hands the experts (rows grouped by expert, counts [E_local] per expert, each row's gate weight)
    and, in `back`, what its combine needs to return the rows to their tokens."""

    rows: torch.Tensor
    counts: torch.Tensor
    scale: torch.Tensor
    back: tuple


class Dispatcher(Protocol):
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> Dispatched: ...

    def combine(self, y: torch.Tensor, back: tuple) -> torch.Tensor: ...


class LocalDispatch:
    """All `n_experts` routed experts on this rank."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> Dispatched:
        """x [N, w], weights/experts [N, k] -> the N*k slots sorted by expert, so that each expert runs once on a
        contiguous slice."""
        N, k = experts.shape
        flat_experts = experts.reshape(-1)  # [N*k]
        order = torch.argsort(flat_experts, stable=True)
        token_of_slot = order // k  # [N*k]: which token each sorted slot belongs to
        counts = expert_counts(flat_experts, self.n_experts)
        # index_select, not x[token_of_slot]: its backward is an index_add rather than indexing's accumulating
        # index_put (why: docs/decisions/moe-experts.md)
        return Dispatched(x.index_select(0, token_of_slot), counts, weights.reshape(-1)[order], (N, token_of_slot))

    def combine(self, y: torch.Tensor, back: tuple) -> torch.Tensor:
        """y [N*k, w] (in the matmuls' dtype, each slot already weighted by its gate weight) -> per token sum [N, w]."""
        N, token_of_slot = back
        return y.new_zeros(N, y.shape[1]).index_add_(0, token_of_slot, y)


class AllToAllDispatch:
    """The `n_experts` routed experts spread over `group`, whole experts, 1/ep of them a rank (in rank order)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group, self.n_experts = group, n_experts
        self.ep = dist.get_world_size(group)
        self.per_rank = n_experts // self.ep
        self.first_local_expert = dist.get_rank(group) * self.per_rank
        # MoE.route_evenly (a dry run): every rank routes alike, so each sends this rank what it sends itself
        self.evenly = False

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> Dispatched:
        group, ep, per_rank = self.group, self.ep, self.per_rank
        N, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots by expert, hence by the rank that holds it
        token_of_slot = order // k
        counts = expert_counts(flat, self.n_experts)  # [E] slots this rank sends each expert
        if self.evenly:  # a fake process group's exchange would leave the counts undefined
            mine = counts.view(ep, per_rank)[self.first_local_expert // per_rank]
            received = mine.repeat(ep)
        else:
            received = torch.empty_like(counts)  # [ep * per_rank]: each source rank's slots for each local expert
            dist.all_to_all_single(received, counts, group=group)
        send_splits = counts.view(ep, per_rank).sum(1).tolist()
        recv_splits = received.view(ep, per_rank).sum(1).tolist()

        x_in = all_to_all_single_autograd(x.index_select(0, token_of_slot), recv_splits, send_splits, group)
        scale_in = all_to_all_single_autograd(weights.reshape(-1)[order].contiguous(), recv_splits, send_splits, group)
        # the received slots come source by source, each source's by expert: group them by local expert
        local_expert = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(received)
        grouped = torch.argsort(local_expert, stable=True)
        local_counts = received.view(ep, per_rank).sum(0)
        back = (N, token_of_slot, grouped, send_splits, recv_splits)
        return Dispatched(x_in.index_select(0, grouped), local_counts, scale_in[grouped], back)

    def combine(self, y: torch.Tensor, back: tuple) -> torch.Tensor:
        N, token_of_slot, grouped, send_splits, recv_splits = back
        y_back = all_to_all_single_autograd(
            y.index_select(0, torch.argsort(grouped)), send_splits, recv_splits, self.group
        )
        return y_back.new_zeros(N, y_back.shape[1]).index_add_(0, token_of_slot, y_back)
