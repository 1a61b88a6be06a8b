"""How the model is spread over the ranks of a run (conf/parallel/): DDP replicates it, FSDP2 shards it.

Each strategy has `shard(model, device, dims)` (called before the optimizer is built: both call the model's
parallelize, `parallelize` below; under FSDP2 it replaces the parameters), `wrap(model, device, dims)`
(the module the Trainer runs forward through), `no_sync(module)`, `finish_gradients(model, dims)` (after the last
backward of an update: the expert-parallel weights neither reduces) and `shard_layouts(dims)` (how a sharded
checkpoint's tensors are laid out on this run); `dims` is the run's ParallelDims (k3train/runtime/parallel_dims.py).
In one process `shard` and `wrap` return the model itself and `no_sync` does nothing: the update loop has one path.
DDP (torch.nn.parallel.DistributedDataParallel) all-reduces (averages) gradients during backward; under gradient
accumulation only the last micro-batch's backward does (`no_sync` for the others), so an update costs one
all-reduce however many micro-batches it has. Buffers are not broadcast from rank 0 before each forward: the
ones k3train's models keep (the MoE balancing bias) are computed from the global batch on every rank, so one sync
when the model is wrapped is enough.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from k3train.models.common.parallelize import FullyShard, parallelize_blocks
from k3train.models.layout import expert_shards
from k3train.models.protocol import Parallelizes
from k3train.runtime.parallel_dims import ParallelDims
from k3train.runtime.parallel_layout import PipelineSettings
from k3train.train.precision import Precision


@runtime_checkable
class ParallelStrategy(Protocol):
    """What build.py and the Trainer ask of conf/parallel/'s `_target_` (DDP and FSDP below are the two): typed
    members, not getattr with defaults, so a strategy that lacks one is refused by name when the run is built."""

    name: str  # ddp | fsdp: how ParallelDims lays out the ranks
    ep: int  # expert-parallel degree (parallel.ep)
    cp: int  # context-parallel degree (parallel.cp)
    dp_replicate: int  # FSDP2's replica groups (HSDP when > 1); 1 under DDP, where every rank is a replica
    pipeline: PipelineSettings  # parallel.pp and its schedule (k3train/runtime/parallel_layout.py)

    def shard(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module: ...

    def wrap(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module: ...

    def no_sync(self, module: nn.Module): ...

    def finish_gradients(self, model: nn.Module, dims: ParallelDims) -> None: ...

    def shard_layouts(self, dims: ParallelDims) -> dict: ...


def strategy_missing(strategy: object) -> list[str]:
    """The ParallelStrategy members `strategy` lacks (empty when it has them all)."""
    methods = [name for name, value in vars(ParallelStrategy).items() if callable(value) and not name.startswith("_")]
    return [name for name in [*ParallelStrategy.__annotations__, *methods] if not hasattr(strategy, name)]


def global_grad_norm(params: list[torch.Tensor], dims: ParallelDims, experts: frozenset[int] = frozenset()) -> float:
    """The L2 norm of every gradient of the model, over all ranks: FSDP2's shards summed (full_value), the
    pipeline's stages summed over its pp ranks, and the
    routed experts' shards of expert parallelism (`experts`: their ids, expert_shards), which differ by rank, summed
    over the expert-parallel group."""
    whole = [p.grad for p in params if p.grad is not None and id(p) not in experts]
    split = [p.grad for p in params if p.grad is not None and id(p) in experts]
    total = full_value(torch.nn.utils.get_total_norm(whole)).square() if whole else torch.zeros(())
    if split:  # FSDP2 may shard them again over expert_dp: full_value sums those shards first
        split_sq = full_value(torch.nn.utils.get_total_norm(split)).square()
        dist.all_reduce(split_sq, group=dims.ep_group)
        total = total + split_sq
    if dims.pp_group is not None:  # each rank of a pipeline holds its stages' gradients
        dist.all_reduce(total, group=dims.pp_group)
    return total.sqrt().item()


def clip_gradients(params: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale every gradient in place by max_norm / total_norm when that is < 1 (torch's clip_grads_with_norm_),
    one call per mesh: torch's refuses to mix FSDP2's DTensors, the expert-parallel weights sharded over expert_dp
    alone, and the plain tensors beside them (expert-parallel weights FSDP2 ignores)."""
    meshes: dict = {}
    for p in params:
        meshes.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    for some in meshes.values():
        torch.nn.utils.clip_grads_with_norm_(some, max_norm, torch.tensor(total_norm))


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A figure computed from FSDP2-sharded tensors (a DTensor, e.g. a gradient norm with a pending sum over
    shards) as a plain tensor; a plain tensor as it is. A collective for a DTensor: every rank must call it."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def average_expert_gradients(model: nn.Module, dims: ParallelDims) -> None:
    """After the last backward of an update: the routed-expert weights that neither DDP nor FSDP2 reduces (each
    rank's own) averaged as the rest are. An expert's gradient on its rank already sums every token of the ep group
    that chose it (the all-to-all's backward brought them), so it is divided by the world size, as the others'
    average divides (a pipeline stage's ranks), and summed over the ranks holding the same experts (expert_dp)."""
    for p in expert_shards(model):
        if p.grad is not None and not isinstance(p, DTensor):  # FSDP2's reduce-scatter does its own
            p.grad.div_(dims.stage_world)
            if dims.expert_dp_group is not None:
                dist.all_reduce(p.grad, group=dims.expert_dp_group)


def parallelize(model: nn.Module, dims: ParallelDims, fully_shard: FullyShard | None) -> dict:
    """The model spread over `dims` by its own parallelize (k3train/models/protocol.py's Parallelizes: KimiK3's is
    k3train/models/k3/parallelize.py), else by FSDP2 over its blocks (parallelize_blocks); the layouts of its
    sharded-checkpoint tensors beyond FSDP2's own."""
    if isinstance(model, Parallelizes):
        return model.parallelize(dims, fully_shard)
    return parallelize_blocks(model, dims, fully_shard)


_DDP_OPTIONS = inspect.signature(DistributedDataParallel.__init__).parameters


@dataclass(eq=False)
class ParallelConfig:
    """The layout settings every strategy takes, flat in its parallel node (`parallel.ep=2`, `parallel.pp=2`):
    ep (routed experts split over this many ranks, tokens exchanged by all-to-all), cp (each row's sequence split
    over this many ranks), and the pipeline's pp, pp_schedule, pp_virtual_stages and pp_microbatches, checked into a
    PipelineSettings (k3train/runtime/parallel_layout.py) when the strategy is built."""

    ep: int = 1
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_microbatches: int | None = None

    def __post_init__(self) -> None:
        self.pipeline = PipelineSettings(self.pp, self.pp_schedule, self.pp_virtual_stages, self.pp_microbatches)
        # the model's own sharded-checkpoint layouts, {what: (mesh, placements)}, as its parallelize returned them
        self.model_layouts: dict = {}


def _by_mesh(model_layouts: dict) -> dict:
    """The model's own layouts by the names of their mesh, as a sharded checkpoint records them."""
    return {tuple(mesh.mesh_dim_names): (mesh, placements) for mesh, placements in model_layouts.values()}


@dataclass(eq=False)
class DDP(ParallelConfig):
    """DDP, and with ep > 1 expert parallelism: the model's parallelize keeps each rank's 1/ep of its routed experts,
    DDP leaves those weights out of its all-reduce, and average_expert_gradients averages them instead."""

    name: ClassVar[str] = "ddp"
    dp_replicate: ClassVar[int] = 1  # not a setting: every rank is a replica
    bucket_cap_mb: int = 25

    def shard(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        """DDP keeps every parameter whole on every rank; with ep > 1 each rank keeps its routed experts only."""
        self.model_layouts = parallelize(model, dims, None)
        return model

    def finish_gradients(self, model: nn.Module, dims: ParallelDims) -> None:
        average_expert_gradients(model, dims)

    def shard_layouts(self, dims: ParallelDims) -> dict:
        """How this run holds each kind of sharded checkpoint tensor, by the names of the mesh it was saved on:
        (mesh, placements). DDP's are the model's own alone (KimiK3's routed experts under ep > 1)."""
        return _by_mesh(self.model_layouts)

    def wrap(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        if not dims.several_ranks or dims.pp > 1:  # a pipeline averages its stages' gradients itself
            return model
        experts = {id(p) for p in expert_shards(model)}
        if experts:  # each rank's differ: finish_gradients averages them, not DDP's all-reduce
            ignored = [name for name, p in model.named_parameters() if id(p) in experts]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        # Buffers are synced from rank 0 once, at wrap time, not before every forward (torch 2.13 renamed the option).
        no_buffer_sync = (
            {"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_OPTIONS else {"broadcast_buffers": False}
        )
        return DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            **no_buffer_sync,
        )

    def no_sync(self, module: nn.Module):
        """Backward without the gradient all-reduce (all but the last micro-batch of an update)."""
        return module.no_sync() if isinstance(module, DistributedDataParallel) else contextlib.nullcontext()


@dataclass(eq=False)
class FSDP(ParallelConfig):
    """FSDP2 (torch.distributed.fsdp.fully_shard): each rank holds a 1/N slice (dim 0) of every parameter, of its
    gradient and of the optimizer state, a unit per block (k3train/models/common/parallelize.py). The model's
    parallelize decides its units (KimiK3's also shards its routed experts over expert_dp under ep > 1:
    k3train/models/k3/parallelize.py). Buffers (the MoE balancing bias) stay whole on every rank.
    With dp_replicate = R > 1 (HSDP, conf/parallel/hsdp.yaml) the slices are 1/(N/R), each replica group of N/R
    consecutive ranks holding the whole model, and gradients are averaged across the groups too (FSDP2 over the
    2-D ParallelDims.shard_mesh).
    mixed_precision: the run's precision.dtype (conf/parallel/fsdp.yaml interpolates it from the precision group):
    under bf16 / fp16 every fully_shard gets Precision.fsdp_policy()'s MixedPrecisionPolicy (gathers in that
    dtype, gradients reduced in fp32; parameters and optimizer state fp32), pipeline stages' included; under fp32 and
    fp64 none (the gathered weights are the master weights).
    """

    name: ClassVar[str] = "fsdp"
    reshard_after_forward: bool = True
    dp_replicate: int = 1
    mixed_precision: str = "fp32"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mp_policy = Precision(dtype=self.mixed_precision).fsdp_policy()

    def shard(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        self.model_layouts = parallelize(model, dims, FullyShard(self.reshard_after_forward, self.mp_policy))
        return model

    def shard_layouts(self, dims: ParallelDims) -> dict:
        """How this run holds each kind of sharded checkpoint tensor, by the names of the mesh it was saved on:
        (mesh, placements). Under FSDP2 everything is sharded on dim 0 over dp_shard (and under HSDP replicated over
        dp_replicate), then the model's own (KimiK3's routed experts over ep, then expert_dp)."""
        if not dims.several_ranks:
            return _by_mesh(self.model_layouts)
        held = (dims.shard_mesh, dims.shard_placements)
        # ("dp_shard",) is also how a tensor saved on a mesh this run lacks is read (ShardedCheckpointer)
        layouts = {("dp_shard",): held, tuple(dims.shard_mesh.mesh_dim_names): held}
        return {**layouts, **_by_mesh(self.model_layouts)}

    def wrap(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        return model  # fully_shard changed the model in place

    def finish_gradients(self, model: nn.Module, dims: ParallelDims) -> None:
        average_expert_gradients(model, dims)  # the experts FSDP2 ignores; its reduce-scatter did the rest

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module):
        """Backward without the gradient reduce-scatter: gradients accumulate unsharded until the last micro-batch."""
        if not isinstance(module, FSDPModule):
            yield
            return
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
