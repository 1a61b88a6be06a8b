"""The layout table: what a parameter's shape does not say, declared by the module that owns it.

A module with such parameters has a `param_layouts()` method giving a ParamLayout by its own parameter names
("q_proj.weight"); `parameter_layouts(model)` gathers them under the model's names. The optimizer (Muon's per-head
views), the gradient norm, DDP, the checkpoint and the planner read this table, never attributes on tensors:
FSDP2's fully_shard replaces every parameter by a new DTensor, which a tensor attribute would not survive, while
module attributes and parameter names do (so does copy.deepcopy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    # (n_heads, dim): a 2D weight Muon may treat as n_heads matrices split along dim (0: rows [H*dh, d];
    # 1: columns [d, H*dh]); None: one matrix.
    head_split: tuple[int, int] | None = None
    # > 1: this rank holds 1/expert_parallel of the weight (its own routed experts), the rest held by the ranks
    # of `expert_group`: its gradient, norm and checkpoint need them (k3train/models/k3/parallelize.py sets it).
    expert_parallel: int = 1
    expert_group: Any = None  # a torch.distributed ProcessGroup

    def __deepcopy__(self, memo: dict) -> ParamLayout:  # immutable, and a ProcessGroup cannot be copied
        return self


WHOLE = ParamLayout()

# The key of the expert shards' sharded-checkpoint layout, (mesh, placements), in what a model's parallelize returns
# (k3train/models/protocol.py's Parallelizes): the whole [E, ...] weight over the expert mesh, ep first.
ROUTED_EXPERTS = "routed_experts"


def parameter_layouts(model: nn.Module) -> dict[str, ParamLayout]:
    """The ParamLayout of every parameter of `model` whose module declares one, by its name in `model`."""
    table = {}
    for prefix, module in model.named_modules():
        declared = getattr(type(module), "param_layouts", None)
        if declared is None:
            continue
        for name, layout in module.param_layouts().items():
            table[f"{prefix}.{name}" if prefix else name] = layout
    return table


def expert_shards(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that hold this rank's slice of a whole weight split over expert-parallel ranks:
    DDP leaves them out, their gradients are averaged apart, and a checkpoint writes each rank's own
    (k3train/checkpoint/expert_shards.py)."""
    table = parameter_layouts(model)
    return [p for name, p in model.named_parameters() if table.get(name, WHOLE).expert_parallel > 1]


def expert_group(model: nn.Module) -> Any:
    """The process group over which `model`'s expert shards are split (None without expert parallelism)."""
    groups = {id(layout.expert_group): layout.expert_group for layout in parameter_layouts(model).values()}
    groups.pop(id(None), None)
    if len(groups) > 1:
        raise ValueError(f"{type(model).__name__} splits its experts over {len(groups)} groups; one is supported")
    return next(iter(groups.values()), None)
