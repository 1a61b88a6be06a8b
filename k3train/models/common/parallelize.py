"""FSDP2 over a model's blocks: what every model family's parallelize ends with, and all a model without its own
parallelize gets (k3train/models/protocol.py's Parallelizes).

Every module of an nn.ModuleList (the transformer blocks; a pipeline stage's nn.ModuleDict of them) is one FSDP2 unit
and the root holds the rest (embeddings, head, final norm): a block's parameters are all-gathered just before its
forward and backward and freed after; gradients are reduce-scattered (averaged) at the end of backward. fully_shard
replaces each parameter by a new DTensor parameter under the same name, so the layout table
(k3train/models/layout.py) still describes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class FullyShard:
    """FSDP2's options, as conf/parallel/fsdp.yaml sets them, handed to a model's parallelize: every fully_shard
    call of a model (blocks, root, KimiK3's routed-expert units) passes `kwargs`."""

    reshard_after_forward: bool = True
    # precision=bf16 / fp16: gathers in that dtype, gradients reduced in fp32 (Precision.fsdp_policy); None: fp32
    mp_policy: MixedPrecisionPolicy | None = None

    @property
    def kwargs(self) -> dict:
        """fully_shard's keyword arguments for these options (mp_policy only when one is set: FSDP2's default)."""
        out: dict = {"reshard_after_forward": self.reshard_after_forward}
        if self.mp_policy is not None:
            out["mp_policy"] = self.mp_policy
        return out


def fully_shard_blocks(model: nn.Module, mesh, options: FullyShard, ignored_params: set | None = None) -> None:
    """Each block of every nn.ModuleList (a pipeline stage's nn.ModuleDict) of `model` one FSDP2 unit over `mesh`,
    then the root; `ignored_params` stay as they are on every rank (FSDP2 neither shards nor reduces them)."""
    blocks = [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]
    blocks += [block for module in model.modules() if isinstance(module, nn.ModuleDict) for block in module.values()]
    for unit in (*blocks, model):
        fully_shard(unit, mesh=mesh, ignored_params=ignored_params, **options.kwargs)


def parallelize_blocks(model: nn.Module, dims, fully_shard: FullyShard | None) -> dict:
    """The parallelize of a model without its own: under FSDP2 (fully_shard given) on several ranks, its blocks and
    root over the run's shard mesh; under DDP nothing (DDP wraps it whole). No sharded-checkpoint layout of its
    own."""
    if dims.ep > 1:
        raise ValueError(f"parallel.ep={dims.ep}: {type(model).__name__} has no MoE layer to split")
    if fully_shard is not None and dims.world_size > 1:
        fully_shard_blocks(model, dims.shard_mesh, fully_shard)
    return {}
