"""Attention residuals (Kimi K3): a softmax mix over depth in place of the residual sum.

At each mixing point a learned query w [d] scores a list of sources V_1..V_n (all [..., d], the same token's
hidden states at earlier depths) and returns their weighted sum:

    Mix(V) = sum_i p_i V_i,    p = softmax_i(<w, V_i / rms(V_i)>),    w = norm.weight * proj.weight[0]

Keys are the sources RMS-normalised (rms(v) = sqrt(mean(v^2) + eps)); values are the sources as they are. The
parameters are an RMSNorm [d] and a Linear(d, 1, bias=False), as the released checkpoint stores them, though only
their product is used. The mix runs in fp32 (in fp64 for fp64 sources) and returns the sources' dtype.

It is per token and over depth only: decoding needs no cache for it. How KimiK3 wires the mixing points into its
layers: the module docstring of k3train/models/k3/model.py. Reference: NVIDIA-NeMo/Automodel's Kimi K3
(`_attn_res_core`, `_apply_attn_res`),
https://github.com/NVIDIA-NeMo/Automodel/blob/43708d05ae3239c48b53230859d4326c1f1da93e/nemo_automodel/components/models/kimi_k3/situ.py
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from k3train.models.norm import RMSNorm


def attn_res_mix(sources: Sequence[Tensor], norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """sources: n >= 1 tensors [..., d] of one dtype; norm_weight [d]; proj_weight [1, d] (or [d]) -> [..., d].

    sum_i softmax_i(<norm_weight * proj_weight, V_i / sqrt(mean(V_i^2) + eps)>) V_i, in fp32 or wider, with
    autocast off (nothing here is a matmul; the softmax must not drop to half precision)."""
    values = torch.stack(tuple(sources), dim=-2)  # [..., n, d]
    dtype = torch.promote_types(values.dtype, torch.float32)
    with torch.autocast(values.device.type, enabled=False):
        v = values.to(dtype)
        keys = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)  # [..., n, d]
        query = norm_weight.to(dtype) * proj_weight.reshape(-1).to(dtype)  # [d]
        probs = (keys * query).sum(-1).softmax(-1)  # [..., n]
        mixed = (probs.unsqueeze(-1) * v).sum(-2)  # [..., d]
    return mixed.to(values.dtype)


class AttnResMix(nn.Module):
    """One mixing point as a module: `norm` (RMSNorm [d]) and `proj` (Linear(d, 1, bias=False)); forward(sources)
    is attn_res_mix over them. KimiK3 registers the same pair directly under the released checkpoint's names
    (`<point>_res_norm`, `<point>_res_proj`) and calls attn_res_mix; this module is the mix on its own."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = RMSNorm(d, eps=eps)
        self.proj = nn.Linear(d, 1, bias=False)

    def forward(self, sources: Sequence[Tensor]) -> Tensor:
        return attn_res_mix(sources, self.norm.weight, self.proj.weight, self.norm.eps)
