"""SwiGLU, the dense gated FFN every model family uses: the dense peer's FFN, Kimi K3's dense layers and the MoE's
shared experts (the routed experts, k3train/models/k3/moe/experts.py, are stacked weights of the same FFN).

    x [..., d] -> w_down(act(w_gate x, w_up x)) [..., d]

act is silu(g) * u (activation="swiglu", the default) or Kimi K3's SiTU-GLU (activation="situ"; situ.py: formula,
derivatives, why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.common.situ import SiTUGLU, check_activation


class SwiGLU(nn.Module):
    """x [..., d] -> [..., d]: w_down(act(w_gate x, w_up x)), act = silu(g) * u (activation="swiglu", the default)
    or SiTU-GLU (activation="situ": situ.py, computed in fp32, cast back to the projections' dtype). The dense FFN
    and the shared expert(s)."""

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        activation: str = "swiglu",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
    ) -> None:
        super().__init__()
        check_activation(activation, situ_beta, situ_linear_beta)
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta
        self.w_gate = nn.Linear(d_model, ffn_dim, bias=False)
        self.w_up = nn.Linear(d_model, ffn_dim, bias=False)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.w_down(SiTUGLU.apply(self.w_gate(x), self.w_up(x), self.situ_beta, self.situ_linear_beta))

    def extra_repr(self) -> str:  # SwiGLU's repr as before; SiTU-GLU says so
        if self.activation == "swiglu":
            return ""
        return f"activation=situ, situ_beta={self.situ_beta}, situ_linear_beta={self.situ_linear_beta}"
