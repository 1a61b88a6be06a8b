"""Routed experts in a checkpoint under expert parallelism: written by the ranks that hold them, read at any ep.

Each rank holds 1/ep of every routed-expert weight (MoE.shard_experts), and FSDP2 may split that
again over expert_dp. In a checkpoint each such weight, and each optimizer state tensor shaped like it (Muon's
momentum), is the whole [E, ...] tensor it is part of: a DTensor over the run's expert mesh (ep first, then
expert_dp), whose local part is this rank's experts, no copy. Which mesh and placements is the model family's to say:
its parallelize returns them (`ExpertLayout`, under ROUTED_EXPERTS: k3train/models/k3/parallelize.py), and the
parts here are handed that, nothing worked out again. DCP writes every rank's own
experts, nothing is gathered, and reads them back resharded: on another ep, or whole in one process (consolidate,
export, generate, a resume without expert parallelism). A whole plain tensor (a single-file checkpoint of a run
without expert parallelism) loads too: each rank keeps its rows.

The model and optimizer parts of the Checkpointer are wrapped (`with_expert_shards`); everything else in them is
as the unwrapped parts give it. torchtitan keeps expert weights as DTensors on its expert mesh throughout for the
same reason (torchtitan/distributed/expert_parallel.py); here they stay plain tensors in the forward, and only a
checkpoint sees the DTensor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from k3train.models.layout import expert_shards

# (mesh, placements) of a whole routed-expert weight: the mesh's first dimension is "ep", split Shard(0)
ExpertLayout = tuple[DeviceMesh, list]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def to_whole(value: torch.Tensor, p: nn.Parameter, layout: ExpertLayout) -> DTensor:
    """`value` (p itself, or a state tensor laid out like it) as the DTensor of the whole [E, ...] over the expert
    mesh: ep first, then expert_dp as p is placed there (FSDP2's shard of each ep rank's experts, else the same rows
    on every expert_dp rank)."""
    mesh, placements = layout
    shape = torch.Size((p.shape[0] * mesh.size(0), *p.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(_local(value), mesh, placements, shape=shape, stride=stride)


def to_rank(value: torch.Tensor, p: nn.Parameter, layout: ExpertLayout) -> torch.Tensor:
    """A checkpoint's value of p (a DTensor over the expert mesh, or the whole tensor) as this rank holds p: its ep
    rank's experts, sharded like p under FSDP2."""
    mesh, ep = layout[0], layout[0].size(0)
    if isinstance(value, DTensor) and value.device_mesh.mesh_dim_names == mesh.mesh_dim_names:
        local = value.to_local()  # allocated in this run's layout (the strategy's shard_layouts)
        if not isinstance(p, DTensor):
            return local
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    if isinstance(value, DTensor):
        value = value.full_tensor()  # saved without expert parallelism, read on FSDP2's mesh: a collective
    if value.shape[0] != p.shape[0] * ep:
        raise ValueError(
            f"a routed-expert tensor of shape {tuple(value.shape)} where this run holds {p.shape[0] * ep} "
            "experts: the checkpoint is of another model"
        )
    start = mesh.get_local_rank(0) * p.shape[0]
    rows = value[start : start + p.shape[0]]
    if isinstance(p, DTensor):  # every rank holds the rows: each keeps its shard, no communication
        return distribute_tensor(rows, p.device_mesh, p.placements, src_data_rank=None)
    return rows.clone()


def _is_like(value, p: nn.Parameter) -> bool:
    """A per-weight tensor of p (a momentum, not a step count): p's shape but for the number of experts."""
    return torch.is_tensor(value) and value.dim() == p.dim() and value.shape[1:] == p.shape[1:]


class ExpertShardedModel:
    """The model as a checkpoint part: its state_dict with each routed-expert weight whole (to_whole)."""

    def __init__(self, model: nn.Module, layout: ExpertLayout):
        self.model, self.layout = model, layout
        shards = {id(p) for p in expert_shards(model)}
        self.experts = {name: p for name, p in model.named_parameters() if id(p) in shards}

    def state_dict(self) -> dict:
        state = self.model.state_dict()
        for name, p in self.experts.items():
            state[name] = to_whole(state[name], p, self.layout)
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        with torch.no_grad():
            for name, p in self.experts.items():
                if name in state:  # else load_state_dict names it missing
                    _local(p).copy_(_local(to_rank(state[name], p, self.layout)))
                    state[name] = p.detach()
        self.model.load_state_dict(state)


class ExpertShardedOptimizer:
    """An optimizer part (ConfiguredOptimizer) whose routed-expert state tensors are whole in a checkpoint."""

    def __init__(self, part, optimizer: torch.optim.Optimizer, model: nn.Module, layout: ExpertLayout):
        self.part, self.layout = part, layout
        experts = {id(p) for p in expert_shards(model)}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # torch.optim numbers the parameters in its state_dict in param-group order
        self.experts = {i: p for i, p in enumerate(params) if id(p) in experts}

    @property
    def changed(self) -> dict:
        return self.part.changed

    def state_dict(self) -> dict:
        out = self.part.state_dict()
        state = out["state"] = dict(out["state"])
        for i, p in self.experts.items():
            if i in state:  # a new dict: the optimizer's own state stays as it is
                state[i] = {k: to_whole(v, p, self.layout) if _is_like(v, p) else v for k, v in state[i].items()}
        return out

    def load_state_dict(self, saved: dict) -> None:
        saved = dict(saved)
        state = saved["state"] = dict(saved.get("state", {}))
        for i, p in self.experts.items():
            if i in state:
                state[i] = {k: to_rank(v, p, self.layout) if _is_like(v, p) else v for k, v in state[i].items()}
        self.part.load_state_dict(saved)


def with_expert_shards(parts: dict, model: nn.Module, optimizer: torch.optim.Optimizer, layout) -> dict:
    """The Checkpointer's parts, the model and optimizer wrapped when `model` holds expert-parallel weights;
    `layout` the ExpertLayout the model's parallelize returned (None without expert parallelism)."""
    return {
        **parts,
        "model": expert_sharded_model(model, layout),
        "optimizer": expert_sharded_optimizer(parts["optimizer"], optimizer, model, layout),
    }


def expert_sharded_model(model: nn.Module, layout):
    """`model` as a checkpoint part: ExpertShardedModel when it holds expert-parallel weights, else itself (a
    pipeline's stages are wrapped one by one)."""
    return ExpertShardedModel(model, _held(model, layout)) if expert_shards(model) else model


def expert_sharded_optimizer(part, optimizer: torch.optim.Optimizer, model: nn.Module, layout):
    """The optimizer part over `model`'s parameters: ExpertShardedOptimizer when it holds expert-parallel weights."""
    return ExpertShardedOptimizer(part, optimizer, model, _held(model, layout)) if expert_shards(model) else part


def _held(model: nn.Module, layout) -> ExpertLayout:
    if layout is None:
        raise ValueError(
            f"{type(model).__name__} holds expert-parallel weights but its parallelize returned no "
            "routed-expert checkpoint layout (k3train/models/protocol.py's Parallelizes)"
        )
    return layout
