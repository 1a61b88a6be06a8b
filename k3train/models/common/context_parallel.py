"""Context parallelism: each row's sequence split across the ranks of a group, rank r holding positions
[r T, (r + 1) T) of a row of cp T (parallel.cp; k3train/runtime/parallel_dims.py).

Only the layers that mix positions need the other ranks, and each moves the cheapest thing it can:
- KDA (k3train/models/kda/context_parallel.py): each rank summarises its slice as an affine map of the state it
  starts from (a [K, K] transition and a [K, V] state per head) and the maps are composed rank by rank; its short
  convs take the previous rank's last conv_size - 1 inputs (`previous_tail`).
- MLA (k3train/models/k3/mla.py): every rank gathers the compressed latent (kv_lora_rank + the rope key per
  position, far smaller than the keys and values it expands to) and attends causally by global position.
- Everything else (norms, projections, the MoE, the loss) is per position.

Every exchange is an all-gather with autograd (torch.distributed._functional_collectives.all_gather_single_autograd):
its backward reduce-scatters each rank's gradient of what it received back to the rank that sent it, summed, so a
loss on one rank reaches the activations of the ranks before it. FLA's `fla/ops/cp` and NeMo Automodel's kimi_k3
context parallelism split KDA and MLA the same way:
https://github.com/fla-org/flash-linear-attention/tree/main/fla/ops/cp
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_gather_single_autograd


@dataclass(frozen=True)
class ContextParallel:
    """The ranks that split each row's sequence, in order (rank r of the group holds the r-th slice)."""

    group: dist.ProcessGroup

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def offset(self, local_length: int) -> int:
        """The global position of this rank's first position (every rank holds local_length)."""
        return self.rank * local_length

    def gather(self, t: Tensor) -> list[Tensor]:
        """t from every rank of the group, in rank order; gradients flow back to the rank that sent each."""
        gathered = all_gather_single_autograd(t.contiguous(), gather_dim=0, group=self.group)
        return list(gathered.chunk(self.size, dim=0))

    def previous_tail(self, x: Tensor, n: int) -> Tensor:
        """The previous rank's last n positions of x [B, T, ...] (zeros on the first rank: a row's start; made from
        what it received, so that every rank takes part in the backward's collective)."""
        tails = self.gather(x[:, x.shape[1] - n :])
        return tails[self.rank - 1] if self.rank > 0 else tails[-1] * 0


def set_context_parallel(model: torch.nn.Module, cp: ContextParallel | None) -> int:
    """Hand `cp` to every module of `model` that mixes positions (a `context_parallel` attribute); returns how many
    took it (0: the model cannot split its sequence)."""
    taken = 0
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = cp
            taken += 1
    return taken
