"""RMSNorm as nn.RMSNorm computes it, and L2 normalisation in two forms (F.normalize's, and FLA's kernel's, which
KDA's q and k use), each with its backward written out for CPU training."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm over the last dimension (the same weight, eps, state_dict and type, so checkpoints and parameter
    grouping see no difference) whose fp32 CPU forward and backward run through RMSNormFunction.

    torch's CPU rms_norm is composite: its forward is ~5 elementwise passes over x and autograd differentiates
    them one by one; the written-out backward takes ~8 passes (tests/test_norm.py checks it against nn.RMSNorm,
    benchmarks/bench_layers.py times both). On a CPU, where x's dtype is not the weight's (a bf16 activation under
    autocast, the weight fp32), mixed_dtype_rms_norm runs; elsewhere (GPU, half precision) torch's own kernel.
    """

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if x.device.type == "cpu" and w is not None and x.dtype != w.dtype:
            return mixed_dtype_rms_norm(x, self.normalized_shape, w, self.eps)
        if (
            x.device.type != "cpu"
            or w is None
            or len(self.normalized_shape) != 1
            or x.dtype != torch.float32
            or w.dtype != torch.float32
        ):
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return RMSNormFunction.apply(x, w, eps)


def mixed_dtype_rms_norm(x: Tensor, normalized_shape: tuple[int, ...], weight: Tensor, eps: float | None) -> Tensor:
    """torch.rms_norm on a CPU for an x whose dtype is not the weight's, op for op as torch 2.13 computes it then
    (its composite path: statistics and the weight's product in x's opmath dtype, the result in x's dtype), so the
    numbers are bitwise torch's, forward and backward (checked for bf16, fp16 and fp64 inputs, with and without
    autocast); written out because torch warns on every call that it "cannot dispatch to fused implementation"
    (under bf16 autocast: every norm of every step), which says nothing to act on."""
    acc = x.to(torch.promote_types(x.dtype, torch.float32))  # opmath: fp32 for bf16 and fp16
    eps = torch.finfo(acc.dtype).eps if eps is None else eps
    dims = tuple(range(-len(normalized_shape), 0))
    rstd = torch.rsqrt(acc.pow(2).mean(dims, keepdim=True).add_(eps))
    return acc.mul(rstd).mul(weight).type_as(x)


class RMSNormFunction(torch.autograd.Function):
    """x [..., D], weight [D] -> x / sqrt(mean(x^2) + eps) * weight."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rstd = torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps))  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).mul_(weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        x_hat = x * rstd
        grad_weight = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)
        grad_x_hat = grad * weight
        # d/dx of x_hat = x * rstd(x): rstd * (grad_x_hat - x_hat * mean(grad_x_hat * x_hat))
        dot = (grad_x_hat * x_hat).mean(-1, keepdim=True)
        return grad_x_hat.sub_(x_hat.mul_(dot)).mul_(rstd), grad_weight, None


def l2_normalize_eps(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension: FLA's l2norm kernel, the form Kimi Linear's and Kimi K3's
    KDA normalise q and k with (eps = 1e-6 there), forward and backward written out so that only y and rstd are
    saved.

    Unlike F.normalize's x / max(||x||, eps), eps is always in the denominator: outputs have norm
    ||x|| / sqrt(||x||^2 + eps) < 1, a zero row maps to zero with gradient grad / sqrt(eps), and the gradient is
    the exact one of the formula everywhere (no clamp). Statistics in fp32 at least; the output in x's dtype.
    https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/modules/l2norm.py
    """
    return L2NormEpsFunction.apply(x, eps)


class L2NormEpsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)  # bf16 rows: the sum and rstd in fp32, as FLA's kernel
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc).square_().add_(eps).rsqrt_()
        y = (x * rstd).to(x.dtype)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        y, rstd = ctx.saved_tensors
        # y = x rstd with rstd = (sum x^2 + eps)^(-1/2): dx = rstd (grad - y (grad . y)), eps already inside rstd
        dot = (grad * y).sum(-1, keepdim=True, dtype=rstd.dtype)
        return torch.addcmul(grad, y, dot, value=-1).mul_(rstd).to(grad.dtype), None
