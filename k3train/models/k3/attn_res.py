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

from k3train.models.common.norm import RMSNorm


def attn_res_mix(sources: Sequence[Tensor], norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """sources: n >= 1 tensors [..., d] of one dtype; norm_weight [d]; proj_weight [1, d] (or [d]) -> [..., d].

    sum_i softmax_i(<norm_weight * proj_weight, V_i / sqrt(mean(V_i^2) + eps)>) V_i, in fp32 or wider, with
    autocast off (else the scores' matmul-vector would drop to half precision before the softmax).

    Written per source, as <w, V_i> / rms(V_i): no [..., n, d] stack and no normalised copy of the keys, which
    halves the step's cost of the mix at small d (the sources are few, the tokens many)."""
    dtype = torch.promote_types(sources[0].dtype, torch.float32)
    with torch.autocast(sources[0].device.type, enabled=False):
        values = [v.to(dtype) for v in sources]
        query = norm_weight.to(dtype) * proj_weight.reshape(-1).to(dtype)  # [d]
        scores = [(v @ query) * torch.rsqrt(v.square().mean(-1) + eps) for v in values]  # n x [...]
        probs = torch.stack(scores, dim=-1).softmax(-1)  # [..., n]
        mixed = sum(probs[..., i, None] * v for i, v in enumerate(values))  # [..., d]
    return mixed.to(sources[0].dtype)


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
