"""reference_moe_forward: the MoE's forward written plainly, the ground truth the tests hold the fast path to."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.models.common.situ import situ_glu
from k3train.models.common.swiglu import SwiGLU
from k3train.models.k3.moe.experts import RoutedExperts
from k3train.models.k3.moe.layer import MoE


def reference_moe_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward, readable and slow: x [B, T, d] -> [B, T, d] through plain autograd, one routed expert at a time
    over the tokens that chose it, SiTU-GLU through situ.situ_glu. The ground truth the tests hold the fast path
    (sorted dispatch, GroupedSwiGLU's written backward, the RMSNorm function) to. It routes with the current bias
    and never changes it or the diagnostics, as an eval pass; it computes in x's dtype (the router in fp32 or
    wider), with no autocast of its own."""
    B, T, d = x.shape
    x_flat = x.reshape(B * T, d)
    router_dtype = torch.promote_types(x.dtype, torch.float32)
    scores = torch.sigmoid(x_flat.to(router_dtype) @ moe.router.weight.to(router_dtype).T)  # [N, n]
    chosen = torch.topk(scores + moe.expert_bias, moe.k, dim=-1).indices  # [N, k]
    weights = scores.gather(-1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * moe.routed_scaling_factor

    h = x_flat if moe.latent_dim is None else x_flat @ moe.latent_down.weight.T  # [N, w]
    ex = moe.experts
    y = torch.zeros_like(h)
    for e in range(moe.n_experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)  # the tokens that chose e, and in which of their k slots
        if token.numel() == 0:
            continue
        out = _reference_ffn(h[token], ex.w_gate[e], ex.w_up[e], ex.w_down[e], ex)
        y = y.index_add(0, token, out * weights[token, slot, None].to(h.dtype))
    if moe.latent_dim is not None:
        norm = moe.latent_norm
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + norm.eps) * norm.weight
        y = y @ moe.latent_up.weight.T
    if moe.shared is not None:
        sh = moe.shared
        y = y + _reference_ffn(x_flat, sh.w_gate.weight, sh.w_up.weight, sh.w_down.weight, sh)
    return y.view(B, T, d)


def _reference_ffn(x, w_gate, w_up, w_down, ffn: SwiGLU | RoutedExperts) -> torch.Tensor:
    """x [N, d], w_gate / w_up [f, d], w_down [d, f] -> [N, d]: w_down act(w_gate x, w_up x), act ffn's."""
    g, u = x @ w_gate.T, x @ w_up.T
    hidden = F.silu(g) * u if ffn.activation == "swiglu" else situ_glu(g, u, ffn.situ_beta, ffn.situ_linear_beta)
    return hidden @ w_down.T
