"""KimiK3's costs for the planner: what k3train/plan/costs.py's ModelCosts asks for, from the code that does the work.

The FLOP counts are k3train/models/k3/flops.py's (the MFU's count, so the plan and the run agree); the max-logit
tile side is the one k3train/models/k3/mla.py's causal_max_logit measures with, and the quantile rank the one
k3train/models/k3/moe/balancing.py balances with: handed on, not copied, so that a change there reaches the plan.
KimiK3.plan_costs() returns K3Costs; the planner imports none of this (k3train/plan never imports a model family).
"""

from __future__ import annotations

from k3train.models.k3.flops import chunk_state_macs, kda_macs, mla_macs
from k3train.models.k3.mla import max_logit_tile
from k3train.models.k3.moe import quantile_rank


def max_logit_pairs(T: int, S: int, side: int) -> int:
    """Query-key pairs causal_max_logit multiplies for T queries at the last T of S positions, for one batch row and
    head: the areas of its tiles (k3train/models/k3/mla.py's max_logit_tiles), the causal pairs and the masked ones
    in the diagonal tiles. What the plan counts as QK-Clip's work."""
    start = S - T
    return sum((min(i0 + side, T) - i0) * (start + min(i0 + side, T)) for i0 in range(0, T, side))


class K3Costs:
    """The KimiK3 family's ModelCosts (k3train/plan/costs.py); stateless: the config comes with each call."""

    kda_macs = staticmethod(kda_macs)
    mla_macs = staticmethod(mla_macs)
    chunk_state_macs = staticmethod(chunk_state_macs)
    max_logit_tile = staticmethod(max_logit_tile)
    max_logit_pairs = staticmethod(max_logit_pairs)
    quantile_rank = staticmethod(quantile_rank)
