"""SiTU-GLU, Kimi K3's gated activation, in place of SwiGLU's silu(g) * u in every FFN.

    g, u [..., f] (the gate and up projections, one float dtype) -> [..., f] in that dtype:
    situ_glu(g, u) = b tanh(g / b) sigmoid(g)  *  c tanh(u / c)        b = beta (K3: 4), c = linear_beta (K3: 25)

computed in fp32 (float64 stays float64) and cast back to the inputs' dtype, as the released model does.

Why: silu(g) * u grows without bound in g and in u, so one outlier in a projection becomes an outlier in the
hidden and in every gradient that flows through it. SiTU bounds both branches with tanh: the gate branch lies in
(-0.28, b) (its minimum is silu's, -0.278, or above: |b tanh(g/b)| <= |g|) and the up branch in (-c, c), so
|hidden| < b c. Near zero it is SwiGLU (b tanh(g / b) ~ g for
|g| << b, c tanh(u / c) ~ u for |u| << c), so small activations are treated as before.

Derivatives (what the written backwards use; tests/test_situ.py checks them against autograd and gradcheck):
    d/dg [b tanh(g/b) sigmoid(g)] = (1 - tanh(g/b)^2) sigmoid(g) + b tanh(g/b) sigmoid(g) (1 - sigmoid(g))
    d/du [c tanh(u/c)]            = 1 - tanh(u/c)^2

Here: `situ_glu` is the readable reference (plain torch, autograd differentiates it); `situ_glu_grads` is the
analytic backward, and both it and `situ_glu_forward` are made of `situ_glu_parts` (the fp32 tanhs and sigmoid).
`SiTUGLU` pairs them in an autograd Function that saves only g and u (in their own dtype) and recomputes the fp32
chain in backward, where autograd through the reference keeps several fp32 copies of [..., f] alive until the
backward. The dense FFN and the shared experts run SiTUGLU (swiglu.py); the routed experts' GroupedSwiGLU
(k3train/models/k3/moe/grouped_swiglu.py) builds the parts once in its own written backward, for the value and the
gradients.
Upstream (SituAndMul, _weighted_situ and the analytic _situ_bwd_core):
https://github.com/NVIDIA-NeMo/Automodel/blob/43708d05ae3239c48b53230859d4326c1f1da93e/nemo_automodel/components/models/kimi_k3/situ.py
https://github.com/NVIDIA-NeMo/Automodel/blob/00ef9ca241e8b06fb7f59eb70b1cad1cc5c357bb/nemo_automodel/components/models/kimi_k3/model.py
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

ACTIVATIONS = ("swiglu", "situ")


def check_activation(activation: str, beta: float, linear_beta: float) -> None:
    """Raise ValueError for an unknown activation name or a non-positive SiTU beta."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    if not (beta > 0 and linear_beta > 0):
        raise ValueError(f"situ_beta={beta} and situ_linear_beta={linear_beta} must both be > 0")


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for half-precision inputs, float64 kept for tight tests."""
    return torch.promote_types(x.dtype, torch.float32)


def situ_glu(g: Tensor, u: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """The reference: g, u [..., f] -> b tanh(g/b) sigmoid(g) * c tanh(u/c) [..., f], in fp32, cast to g's dtype."""
    dtype = _compute_dtype(g)
    gf, uf = g.to(dtype), u.to(dtype)
    gate = beta * torch.tanh(gf / beta) * torch.sigmoid(gf)
    up = linear_beta * torch.tanh(uf / linear_beta)
    return (gate * up).to(g.dtype)


def situ_glu_parts(g: Tensor, u: Tensor, beta: float, linear_beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """g, u [..., f] -> (tanh(g/b), sigmoid(g), tanh(u/c)) in fp32 (float64 kept): what both the value and the
    derivatives are made of. The tanhs are the cost (on a CPU a tanh takes ~5x a sigmoid): a backward that needs
    the value too (GroupedSwiGLU's, for the down projection's gradient) builds the parts once for both."""
    dtype = _compute_dtype(g)
    with torch.no_grad():
        gf, uf = g.to(dtype), u.to(dtype)
        return torch.div(gf, beta).tanh_(), torch.sigmoid(gf), torch.div(uf, linear_beta).tanh_()


def situ_glu_value(parts: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float, dtype: torch.dtype) -> Tensor:
    """situ_glu's value from situ_glu_parts (left as they are), cast to dtype: the reference's operations in its
    order, (b tanh(g/b)) sigmoid(g) (c tanh(u/c)), so the two agree bit for bit."""
    tg, sg, tu = parts
    with torch.no_grad():
        return torch.mul(tg, beta).mul_(sg).mul_(torch.mul(tu, linear_beta)).to(dtype)


def situ_glu_forward(g: Tensor, u: Tensor, beta: float, linear_beta: float) -> Tensor:
    """situ_glu's value without an autograd graph (the written backwards' forward), in g's dtype."""
    return situ_glu_value(situ_glu_parts(g, u, beta, linear_beta), beta, linear_beta, g.dtype)


def situ_glu_grads_from_parts(
    grad: Tensor, parts: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """grad [..., f] of situ_glu's output and situ_glu_parts (consumed: overwritten in place) -> (grad of g, grad of
    u) in dtype, with the derivatives in the module docstring."""
    tg, sg, tu = parts
    with torch.no_grad():
        grad = grad.to(tg.dtype)
        gate = torch.mul(tg, sg).mul_(beta)
        # d_gate = (1 - tg^2) sg + gate (1 - sg), built in tg's buffer
        d_gate = tg.square_().neg_().add_(1).mul_(sg).add_(sg.neg_().add_(1).mul_(gate))
        grad_u = gate.mul_(grad).mul_(tu.square().neg_().add_(1))
        grad_g = tu.mul_(linear_beta).mul_(grad).mul_(d_gate)
        return grad_g.to(dtype), grad_u.to(dtype)


def situ_glu_grads(grad: Tensor, g: Tensor, u: Tensor, beta: float, linear_beta: float) -> tuple[Tensor, Tensor]:
    """grad [..., f] of situ_glu's output, g, u [..., f] -> (grad of g, grad of u), each in its input's dtype: the
    fp32 chain recomputed from g and u."""
    return situ_glu_grads_from_parts(grad, situ_glu_parts(g, u, beta, linear_beta), beta, linear_beta, g.dtype)


class SiTUGLU(torch.autograd.Function):
    """situ_glu(g, u, beta, linear_beta) with situ_glu_grads as its backward; saves g and u only."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
        if g.shape != u.shape or g.dtype != u.dtype:
            raise ValueError(f"g and u must match: g {tuple(g.shape)} {g.dtype}, u {tuple(u.shape)} {u.dtype}")
        ctx.save_for_backward(g, u)
        ctx.betas = (beta, linear_beta)
        return situ_glu_forward(g, u, beta, linear_beta)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        g, u = ctx.saved_tensors
        return (*situ_glu_grads(grad, g, u, *ctx.betas), None, None)
