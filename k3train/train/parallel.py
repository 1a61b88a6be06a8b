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
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from k3train.runtime.parallel_dims import ParallelDims


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
    name = "ddp"

    def __init__(self, bucket_cap_mb: int = 25):
        self.bucket_cap_mb = bucket_cap_mb

    def shard(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        """DDP keeps every parameter whole on every rank."""
        hand_data_parallel_group(model, dims)
        return model

    def wrap(self, model: nn.Module, device: torch.device, dims: ParallelDims) -> nn.Module:
        if not dims.several_ranks:
            return model
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

    def __init__(self, reshard_after_forward: bool = True):
        self.reshard_after_forward = reshard_after_forward

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
