"""KDAState: what a KDA layer keeps between decoded tokens. Its size is fixed, whatever the context length.

conv_q, conv_k [B, conv_size - 1, H*K], conv_v [B, conv_size - 1, HV*K]: the last inputs of each short conv
recurrent [B, HV, K, V] fp32: the delta-rule state S (the state chunk_kda / naive_recurrent_kda / FLA hand over)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KDAState:
    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor
    recurrent: Tensor

    @classmethod
    def empty(
        cls,
        batch: int,
        conv_size: int,
        key_dim: int,
        value_dim: int,
        n_value_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KDAState:
        """Zeros: the short convs' causal padding and the empty delta-rule state."""

        def tail(dim: int) -> Tensor:
            return torch.zeros(batch, conv_size - 1, dim, device=device, dtype=dtype)

        recurrent = torch.zeros(batch, n_value_heads, head_dim, head_dim, device=device, dtype=torch.float32)
        return cls(tail(key_dim), tail(key_dim), tail(value_dim), recurrent)

    def numel(self) -> int:
        return sum(t.numel() for t in (self.conv_q, self.conv_k, self.conv_v, self.recurrent))
