"""How the model is replicated across the ranks of a run (conf/parallel/): DDP.

In one process `wrap` returns the model itself and `no_sync` does nothing, so the update loop has one code path.
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
from torch.nn.parallel import DistributedDataParallel

from k3train.train.distributed import several_ranks


_DDP_OPTIONS = inspect.signature(DistributedDataParallel.__init__).parameters


class DDP:
    def __init__(self, bucket_cap_mb: int = 25):
        self.bucket_cap_mb = bucket_cap_mb

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        if not several_ranks():
            return model
        # Buffers are synced from rank 0 once, at wrap time, not before every forward (torch 2.13 renamed the option).
        no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_OPTIONS
                          else {"broadcast_buffers": False})
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                       bucket_cap_mb=self.bucket_cap_mb, **no_buffer_sync)

    def no_sync(self, module: nn.Module):
        """Backward without the gradient all-reduce (all but the last micro-batch of an update)."""
        return module.no_sync() if isinstance(module, DistributedDataParallel) else contextlib.nullcontext()

    def describe(self) -> str:
        return f"DDP over {dist.get_world_size()} process(es)" if several_ranks() else "one process"
