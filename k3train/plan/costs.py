"""What the planner needs from a model family beyond its config's shapes: the costs only the family's own code knows.

The plan reads a model's shapes from its config (spec.model) and writes out most of its work from them; a few
counts are the model's own code, which the plan must agree with number for number: its mixers' multiply-adds,
QK-Clip's max-logit tiles, the router's quantile. Rather than import the model for them (dependency inversion, as
torchtitan's model specs hand their trainer what it needs), the plan states them here as a protocol and the model
hands its family's implementation over: `model.plan_costs()` (PlansCosts). k3train/models/k3/costs.py is KimiK3's;
a model without plan_costs is not planned (k3train/plan/spec.py says so). So k3train/plan imports no model family.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class ModelCosts(Protocol):
    """`config` is the model's config, spec.model (its shapes)."""

    def kda_macs(self, config: Any, seq_len: int) -> float:
        """Multiply-adds per token of one KDA layer at seq_len (projections, short convs, the recurrence)."""
        ...

    def mla_macs(self, config: Any, seq_len: int) -> float:
        """Multiply-adds per token of one MLA layer at seq_len (projections, attention over seq_len keys)."""
        ...

    def chunk_state_macs(self, K: int, V: int, C: int, seq_len: int) -> float:
        """Multiply-adds of KDA's chunked state work for one head over one sequence, chunks of C positions."""
        ...

    def max_logit_tile(self, n_heads: int, device_type: str) -> int:
        """The side of QK-Clip's max-logit tile for n_heads heads on a "cpu" or "cuda" device."""
        ...

    def max_logit_pairs(self, T: int, S: int, side: int) -> int:
        """Query-key pairs the max-logit tiles multiply for T queries at the last T of S positions, one row and head."""
        ...

    def quantile_rank(self, n_tokens: int, k: int, n_experts: int) -> int:
        """Quantile Balancing's m: the rank of the bias quantile over n_tokens tokens, top-k of n_experts."""
        ...


@runtime_checkable
class PlansCosts(Protocol):
    """A model the planner can plan: it hands over its family's costs."""

    def plan_costs(self) -> ModelCosts: ...
