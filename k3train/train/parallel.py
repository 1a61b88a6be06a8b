"""How the model is spread over the ranks of a run (conf/parallel/): DDP replicates it, FSDP2 shards it.

Each strategy has `shard(model, device, dims)` (called before the optimizer is built: FSDP2 replaces the
parameters; both hand the data-parallel group to the modules that balance over it), `wrap(model, device, dims)`
(the module the Trainer runs forward through), and `no_sync(module)`; `dims` is the run's
ParallelDims (k3train/runtime/parallel_dims.py). In one
process `shard` and `wrap` return the model itself and `no_sync` does nothing, so the update loop has one code path.
DDP (torch.nn.parallel.DistributedDataParallel) all-reduces (averages) gradients during backward; under gradient
accumulation only the last micro-batch's backward does (`no_sync` for the others), so an update costs one
all-reduce however many micro-batches it has. Buffers are not broadcast from rank 0 before each forward: the
ones k3train's models keep (the MoE balancing bias) are computed from the global batch on every rank, so one sync
when the model is wrapped is enough.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from k3train.models.k3.expert_parallel import expert_shards, shard_experts
from k3train.models.k3.moe import MoE
from k3train.runtime.parallel_dims import ParallelDims


def _set(owner, key: str, value: torch.Tensor) -> None:
    if isinstance(owner, dict):
        owner[key] = value
    else:
        owner.data = value


def _get(owner, key: str) -> torch.Tensor:
    return owner[key] if isinstance(owner, dict) else owner.data


def global_grad_norm(params: list[torch.Tensor], dims: ParallelDims) -> float:
    """The L2 norm of every gradient of the model, over all ranks: FSDP2's shards summed (full_value), and the
    routed experts' shards of expert parallelism, which differ by rank, summed over the expert-parallel group."""
    whole = [p.grad for p in params if p.grad is not None and getattr(p, "expert_parallel", 1) == 1]
    split = [p.grad for p in params if p.grad is not None and getattr(p, "expert_parallel", 1) > 1]
    total = full_value(torch.nn.utils.get_total_norm(whole)).square() if whole else torch.zeros(())
    if split:
        split_sq = torch.nn.utils.get_total_norm(split).square()
        dist.all_reduce(split_sq, group=dims.ep_group)
        total = total + split_sq
    return total.sqrt().item()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A figure computed from FSDP2-sharded tensors (a DTensor, e.g. a gradient norm with a pending sum over
    shards) as a plain tensor; a plain tensor as it is. A collective for a DTensor: every rank must call it."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def hand_data_parallel_group(model: nn.Module, dims: ParallelDims) -> None:
    """Give every module that reduces over the data-parallel ranks (a `process_group` attribute: the MoE's Quantile
    Balancing) the run's group; None in one process."""
    for module in model.modules():
        if hasattr(module, "process_group"):
            module.process_group = dims.dp_group


_DDP_OPTIONS = inspect.signature(DistributedDataParallel.__init__).parameters


class DDP:
    """DDP, and with ep > 1 expert parallelism: each MoE keeps 1/ep of its routed experts (shard_experts), DDP leaves
    those weights out of its all-reduce, and finish_gradients averages them instead: an expert's gradient on its
    rank already sums every rank's tokens that chose it (the all-to-all's backward brings them), so it is divided by
    the world size, as DDP's average divides the others, and summed over the ranks holding the same experts."""

    name = "ddp"

    def __init__(self, bucket_cap_mb: int = 25, ep: int = 1):
        self.bucket_cap_mb = bucket_cap_mb
        self.ep = ep

    def shard(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        """DDP keeps every parameter whole on every rank; with ep > 1 each rank keeps its routed experts only."""
        hand_data_parallel_group(model, dims)
        if dims.ep > 1:
            moes = [m for m in model.modules() if isinstance(m, MoE)]
            if not moes:
                raise ValueError(f"parallel.ep={dims.ep}: {type(model).__name__} has no MoE layer to split")
            for moe in moes:
                shard_experts(moe, dims.ep_group)
        return model

    def finish_gradients(self, model: nn.Module, dims: ParallelDims) -> None:
        """After the last backward of an update: the routed experts' gradients averaged as DDP averages the rest."""
        for p in expert_shards(model):
            if p.grad is not None:
                p.grad.div_(dims.world_size)
                if dims.expert_dp_group is not None:
                    dist.all_reduce(p.grad, group=dims.expert_dp_group)

    @contextlib.contextmanager
    def whole_experts(self, model: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims):
        """Within: every routed-expert weight (and its optimizer state) whole on every rank, gathered over the
        expert-parallel group; after: this rank's 1/ep again, sliced from what is there then (what a checkpoint
        load wrote, or the gathered values). So a checkpoint holds whole experts, whatever ep wrote or reads it."""
        shards = expert_shards(model)
        if not shards:
            yield
            return
        rank, local = dist.get_rank(dims.ep_group), {p: p.shape[0] for p in shards}

        def each_tensor():  # (where it is kept, under which key, this rank's rows of it)
            for p in shards:
                yield p, "data", local[p]
                for key, value in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.dim() == p.dim():
                        yield optimizer.state[p], key, local[p]

        for owner, key, n in list(each_tensor()):
            part = _get(owner, key)
            whole = part.new_empty((n * dims.ep, *part.shape[1:]))
            dist.all_gather_into_tensor(whole, part.contiguous(), group=dims.ep_group)
            _set(owner, key, whole)
        try:
            yield
        finally:
            for owner, key, n in list(each_tensor()):  # the state a load brought in, too
                whole = _get(owner, key)
                if whole.shape[0] == n * dims.ep:
                    _set(owner, key, whole[rank * n : (rank + 1) * n].clone())

    def wrap(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        if not dims.several_ranks:
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


class FSDP:
    """FSDP2 (torch.distributed.fsdp.fully_shard): each rank holds a 1/N slice (dim 0) of every parameter, of its
    gradient and of the optimizer state. Every module of an nn.ModuleList (the transformer blocks) is one unit,
    the root holds the rest (embeddings, head, final norm): a block's parameters are all-gathered just before its
    forward and backward and freed after; gradients are reduce-scattered (averaged) at the end of backward.

    fully_shard replaces each parameter by a new DTensor parameter, which loses Python attributes such as
    `head_split` (docs/contracts.md): they are read before and set again on the new parameters, so the optimizer
    built afterwards sees them. Buffers (the MoE balancing bias) stay whole on every rank.
    """

    name = "fsdp"

    def __init__(self, reshard_after_forward: bool = True, ep: int = 1):
        self.reshard_after_forward = reshard_after_forward
        self.ep = ep  # ParallelDims refuses > 1 with FSDP2 for now

    def shard(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        hand_data_parallel_group(model, dims)
        if not dims.several_ranks:
            return model
        annotations = {
            name: {"head_split": p.head_split} for name, p in model.named_parameters() if hasattr(p, "head_split")
        }
        blocks = [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]
        for block in blocks:
            fully_shard(block, mesh=dims.shard_mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=dims.shard_mesh, reshard_after_forward=self.reshard_after_forward)
        for name, p in model.named_parameters():
            for key, value in annotations.get(name, {}).items():
                setattr(p, key, value)
        return model

    def wrap(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        return model  # fully_shard changed the model in place

    def finish_gradients(self, model: nn.Module, dims: ParallelDims) -> None:
        pass  # the reduce-scatter at the end of the backward did it

    def whole_experts(self, model: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims):
        return contextlib.nullcontext()  # no expert parallelism with FSDP2 yet (ParallelDims refuses it)

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
