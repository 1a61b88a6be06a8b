"""Kimi Delta Attention: the per-step reference (naive), the chunkwise CPU path (chunk), FLA's GPU kernel (fla,
imported only when used) and the layer built on them."""

from k3train.models.kda.chunk import chunk_kda
from k3train.models.kda.fla import fla_chunk_kda
from k3train.models.kda.layer import KimiDeltaAttention
from k3train.models.kda.naive import naive_recurrent_kda

__all__ = ["KimiDeltaAttention", "chunk_kda", "fla_chunk_kda", "naive_recurrent_kda"]
