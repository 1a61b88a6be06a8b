"""MLACache: what an MLA layer keeps between decoded tokens, the compressed latent rather than per-head keys and
values (DeepSeek-V2, arXiv 2405.04434, section 2.1.3). KDA layers keep a KDAState (k3train/models/kda/state.py).

  latent [B, capacity, kv_lora_rank]: RMSNorm(c_kv) of every token so far
  k_rope [B, capacity, qk_rope_head_dim]: the shared rotary key (rotated at its position when rope is on)
  length: how many positions are filled; kv_lora_rank + qk_rope_head_dim values per token per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class MLACache:
    latent: Tensor
    k_rope: Tensor
    length: int = 0

    @classmethod
    def empty(
        cls, batch: int, capacity: int, kv_lora_rank: int, rope_dim: int, device: torch.device, dtype: torch.dtype
    ) -> MLACache:
        return cls(
            torch.zeros(batch, capacity, kv_lora_rank, device=device, dtype=dtype),
            torch.zeros(batch, capacity, rope_dim, device=device, dtype=dtype),
        )

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]

    def append(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Store T new positions ([B, T, r], [B, T, dr]); return every position so far."""
        T = latent.shape[1]
        if self.length + T > self.capacity:
            raise ValueError(
                f"MLA cache holds {self.capacity} positions; {self.length} are filled and {T} more "
                "were given: build the cache with a larger capacity (prompt + new tokens)"
            )
        end = self.length + T
        self.latent[:, self.length : end] = latent
        self.k_rope[:, self.length : end] = k_rope
        self.length = end
        return self.latent[:, :end], self.k_rope[:, :end]

    def numel(self) -> int:
        """Values held for the filled positions: length * (kv_lora_rank + rope_dim) per batch row."""
        return self.length * self.latent.shape[0] * (self.latent.shape[2] + self.k_rope.shape[2])
