"""Kimi K3-style model: KDA + MLA hybrid layers with a Quantile-Balanced MoE."""

from k3train.models.k3.config import KimiK3Config
from k3train.models.k3.mla import MultiHeadLatentAttention
from k3train.models.k3.model import KimiK3
from k3train.models.k3.moe import MoE

__all__ = ["KimiK3", "KimiK3Config", "MoE", "MultiHeadLatentAttention"]
