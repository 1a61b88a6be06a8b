"""SiTU-GLU (k3train/models/common/situ.py): values against hand computation, its analytic derivative against autograd
and finite differences, its dtypes, and the dense FFN that runs it."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3train.models.common.situ import SiTUGLU, situ_glu, situ_glu_grads
from k3train.models.common.swiglu import SwiGLU

B, C = 4.0, 25.0  # Kimi K3's situ_beta and situ_linear_beta


def by_hand(g: float, u: float, b: float = B, c: float = C) -> float:
    """b tanh(g/b) sigmoid(g) * c tanh(u/c) in Python floats, no torch."""
    return b * math.tanh(g / b) / (1 + math.exp(-g)) * c * math.tanh(u / c)


@pytest.mark.parametrize("g, u", [(0.0, 3.0), (1.0, 1.0), (-1.25, 2.0), (4.0, 25.0), (10.0, -60.0), (-30.0, 5.0)])
def test_values_by_hand(g, u):
    got = situ_glu(torch.tensor([g], dtype=torch.float64), torch.tensor([u], dtype=torch.float64), B, C)
    assert got.item() == pytest.approx(by_hand(g, u), rel=1e-14, abs=1e-300)


def test_known_points():
    """A few values worked out on paper: 0 at g = 0; at g = b = 4, u = c = 25 it is 4 tanh(1) sigmoid(4) 25 tanh(1)
    = 100 * 0.761594^2 * 0.982014 = 56.959; the bound b c = 100 is never reached."""
    g = torch.tensor([0.0, 4.0, 1e4, -1e4], dtype=torch.float64)
    u = torch.tensor([7.0, 25.0, 1e4, 1e4], dtype=torch.float64)
    out = situ_glu(g, u, B, C)
    assert out[0] == 0.0
    assert out[1].item() == pytest.approx(56.959, abs=5e-4)
    assert out[2].item() == pytest.approx(B * C) and out[2] <= B * C
    assert out[3].item() == pytest.approx(0.0, abs=1e-100)


def test_near_zero_it_is_swiglu():
    """For |g| << b and |u| << c the tanh's are the identity to O(x^3): SiTU-GLU = silu(g) u to ~(g/b)^2."""
    g = torch.linspace(-0.05, 0.05, 11, dtype=torch.float64)
    u = torch.linspace(0.05, -0.05, 11, dtype=torch.float64)
    torch.testing.assert_close(situ_glu(g, u, B, C), F.silu(g) * u, rtol=1e-3, atol=1e-12)


def test_bounded_and_finite_in_bf16():
    """Huge projections (up to bf16's largest) give finite hidden values, at most b c in size: no outlier passes."""
    g = torch.tensor([-1e30, -1.2, 0.0, 3.0, 1e30, 3e38], dtype=torch.bfloat16)
    u = torch.tensor([1e30, -1e30, 5.0, 1e30, -1e30, 3e38], dtype=torch.bfloat16)
    out = situ_glu(g, u, B, C)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float().abs() <= B * C).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_computed_in_fp32_and_cast_back(dtype):
    """Half-precision inputs: the chain in fp32, one rounding at the end (bit for bit the fp32 result cast)."""
    gen = torch.Generator().manual_seed(0)
    g, u = (torch.randn(64, generator=gen) * 5).to(dtype), (torch.randn(64, generator=gen) * 30).to(dtype)
    out = situ_glu(g, u, B, C)
    assert out.dtype == dtype
    assert torch.equal(out, situ_glu(g.float(), u.float(), B, C).to(dtype))
    assert torch.equal(SiTUGLU.apply(g, u, B, C), out)


def inputs(dtype=torch.float64, n=(6, 9), seed=0):
    """g over SiTU's bends (the sigmoid's and tanh(g/b)'s) and u over tanh(u/c)'s: not just its linear middle."""
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(n, generator=gen, dtype=torch.float64) * 4).to(dtype).requires_grad_()
    u = (torch.randn(n, generator=gen, dtype=torch.float64) * 30).to(dtype).requires_grad_()
    return g, u


@pytest.mark.parametrize("betas", [(B, C), (1.0, 2.0), (0.5, 100.0)])
def test_analytic_derivative_equals_autograd_float64(betas):
    """situ_glu_grads (the written backward) against autograd through the reference, fp64, and the module
    docstring's derivative formulas evaluated directly."""
    b, c = betas
    g, u = inputs()
    grad = torch.randn(g.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    situ_glu(g, u, b, c).backward(grad)
    grad_g, grad_u = situ_glu_grads(grad, g.detach(), u.detach(), b, c)
    torch.testing.assert_close(grad_g, g.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_u, u.grad, rtol=1e-12, atol=1e-14)
    gd, ud = g.detach(), u.detach()
    t, s = torch.tanh(gd / b), torch.sigmoid(gd)
    d_gate = (1 - t**2) * s + b * t * s * (1 - s)
    d_up = 1 - torch.tanh(ud / c) ** 2
    torch.testing.assert_close(grad_g, grad * d_gate * c * torch.tanh(ud / c), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_u, grad * b * t * s * d_up, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("betas", [(B, C), (1.0, 2.0)])
def test_situ_function_gradcheck_float64(betas):
    g, u = inputs(n=(3, 5))
    assert torch.autograd.gradcheck(lambda g, u: SiTUGLU.apply(g, u, *betas), (g, u))
    assert torch.autograd.gradcheck(lambda g, u: situ_glu(g, u, *betas), (g, u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_function_equals_autograd_through_the_reference(dtype):
    """SiTUGLU's values and gradients against autograd through situ_glu in the same dtype: equal outputs, gradients
    in the inputs' dtype, equal to a rounding (the two compute the fp32 derivative in different orders)."""
    results = []
    for fn in (situ_glu, SiTUGLU.apply):
        g, u = inputs(dtype, n=(16, 32), seed=2)
        out = fn(g, u, B, C)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype))
        results.append((out.detach(), g.grad, u.grad))
    (out_r, gg_r, gu_r), (out_f, gg_f, gu_f) = results
    assert torch.equal(out_f, out_r)
    assert gg_f.dtype == gu_f.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(gg_f, gg_r, **tol)
    torch.testing.assert_close(gu_f, gu_r, **tol)


def test_dense_ffn_with_situ_float64():
    """SwiGLU(activation="situ"): w_down(situ_glu(w_gate x, w_up x)), its values and every gradient against
    autograd through the reference; swiglu remains the default."""
    torch.manual_seed(0)
    ffn = SwiGLU(8, 20, activation="situ", situ_beta=2.0, situ_linear_beta=3.0).double()
    with torch.no_grad():
        for p in ffn.parameters():
            p.mul_(20)  # large enough to bend both tanh's
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(5, 8, dtype=torch.float64)
    ffn(x).backward(grad)
    got = [x.grad.clone(), *(p.grad.clone() for p in ffn.parameters())]
    x.grad = None
    ffn.zero_grad()
    want_out = ffn.w_down(situ_glu(ffn.w_gate(x), ffn.w_up(x), 2.0, 3.0))
    want_out.backward(grad)
    torch.testing.assert_close(ffn(x), want_out, rtol=1e-12, atol=1e-12)
    for have, want in zip(got, [x.grad, *(p.grad for p in ffn.parameters())]):
        torch.testing.assert_close(have, want, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(ffn, (x[:2].detach().requires_grad_(),))
    assert SwiGLU(8, 20).activation == "swiglu"


def test_dense_ffn_under_bf16_autocast():
    """Under autocast the projections run in bf16, SiTU in fp32 on them, the output and the hidden in bf16."""
    torch.manual_seed(0)
    ffn = SwiGLU(8, 20, activation="situ")
    x = torch.randn(5, 8) * 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ffn(x)
        want = ffn.w_down(situ_glu(ffn.w_gate(x), ffn.w_up(x), B, C))
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


def test_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        SwiGLU(8, 20, activation="gelu")
    with pytest.raises(ValueError, match="situ_beta"):
        SwiGLU(8, 20, activation="situ", situ_beta=0.0)
    with pytest.raises(ValueError, match="must match"):
        SiTUGLU.apply(torch.randn(3), torch.randn(4), B, C)
