"""The router: which k of the n routed experts each token goes to, and with what gate weight (DeepSeek-V3, arXiv
2412.19437, section 2.1.2; Kimi K3's KimiK3Gate).

    logits = router(x)                       [N, n], the matmul in fp32 even under a bf16 autocast
    s = sigmoid(logits)                      the scores
    chosen = top-k of s + b                  b: the balancing bias (balancing.py), which only steers the choice
    gate = s[chosen] / (sum s[chosen] + 1e-20) * routed_scaling_factor

The router's matmul and the sigmoid run in fp32 even under a bf16 autocast (as KimiK3Gate: a bf16 matmul rounds
logits to ~3 digits, enough to reorder near-tied experts). The gate weights are the UNBIASED scores of the chosen k,
renormalised to sum 1 (divided by their sum + 1e-20, as K3 does, so that k scores that all underflow to 0 give
weights 0, not NaN), so balancing never changes what a chosen expert's output is weighted by.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Linear):
    """The router's weight [n, d] (an nn.Linear without bias: `router.weight` in state_dict, initialised as the
    model's other Linears), with the routing steps as methods; k experts a token, gate weights times
    `scaling_factor`."""

    def __init__(self, d_model: int, n_experts: int, k: int, scaling_factor: float = 1.0) -> None:
        super().__init__(d_model, n_experts, bias=False)
        self.k, self.scaling_factor = k, scaling_factor
        # MoE.route_evenly (a dry run): token i chooses experts (i k + j) mod n, j < k, whatever its scores
        self.evenly = False

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> router logits [N, n] in fp32 (float64 for float64 x), whatever autocast is on: the router
        matmul is K3's one fp32 matmul of the FFN. Without autocast and in fp32 it is exactly self(x)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.weight.to(dtype))

    @staticmethod
    def scores(logits: torch.Tensor) -> torch.Tensor:
        """logits [N, n] -> sigmoid scores [N, n], fp32 (float64 for float64 logits)."""
        return torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))

    def choose(self, scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """scores [N, n], bias [n] -> the k chosen experts of each token [N, k]: the top-k of scores + bias. Detached:
        indices carry no gradient, and a graph node here would be one a checkpointed recompute (which replays the
        choice instead) lacks."""
        if self.evenly:
            slots = torch.arange(scores.shape[0] * self.k, device=scores.device).view(-1, self.k)
            return slots % scores.shape[-1]
        return torch.topk((scores + bias).detach(), self.k, dim=-1).indices

    def gate_weights(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """scores [N, n], chosen experts [N, k] -> their gate weights [N, k]: the unbiased scores renormalised."""
        weights = scores.gather(-1, experts)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling_factor


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """experts [S] (indices) -> how many slots chose each expert [n_experts] (int64). A scatter-add, not bincount: on
    CUDA bincount reads its input's maximum back to the host to size its output, a sync every MoE layer."""
    return torch.zeros(n_experts, dtype=torch.int64, device=experts.device).index_add_(
        0, experts, torch.ones_like(experts, dtype=torch.int64)
    )
