"""RMSNorm's written-out backward against nn.RMSNorm (values, gradients, state_dict, and where it steps aside),
l2_normalize_eps's (FLA's form) against its formula through autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.common.norm import RMSNorm, RMSNormFunction, l2_normalize_eps

pytestmark = pytest.mark.usefixtures("one_thread")


def pair(D=24, eps=1e-6, seed=0):
    torch.manual_seed(seed)
    ours, reference = RMSNorm(D, eps=eps), nn.RMSNorm(D, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(D))
    reference.load_state_dict(ours.state_dict())
    return ours, reference


@pytest.mark.parametrize("eps", [1e-6, None], ids=["eps", "eps_of_dtype"])
@pytest.mark.parametrize("shape", [(5, 24), (2, 7, 24), (2, 3, 4, 24)])
def test_matches_nn_rmsnorm_forward_and_backward(shape, eps):
    ours, reference = pair(eps=eps)
    x = (3 * torch.randn(shape)).requires_grad_()
    upstream = torch.randn(shape)
    results = []
    for norm in (ours, reference):
        x.grad = None
        y = norm(x)
        (y * upstream).sum().backward()
        results.append((y.detach(), x.grad.clone(), norm.weight.grad.clone()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, 1e-6), (x, weight))


def test_is_an_nn_rmsnorm_with_the_same_state_dict():
    ours, reference = pair()
    assert isinstance(ours, nn.RMSNorm)  # parameter grouping puts its weight with the norms
    assert ours.state_dict().keys() == reference.state_dict().keys() == {"weight"}


def test_other_dtypes_take_torchs_kernel(monkeypatch):
    ours, reference = pair()
    monkeypatch.setattr(RMSNormFunction, "apply", lambda *args: pytest.fail("fp32 CPU inputs only"))
    x = torch.randn(4, 24)
    torch.testing.assert_close(ours.bfloat16()(x.bfloat16()), reference.bfloat16()(x.bfloat16()))
    torch.testing.assert_close(ours.double()(x.double()), reference.double()(x.double()))


def l2_normalize_eps_formula(x, eps):
    """FLA's l2norm as plain autograd sees it: x / sqrt(sum x^2 + eps) over the last dimension."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + eps)


def l2_eps_rows(dtype=torch.float64):
    """Rows of every scale, a zero row and rows whose squared norm is below, near and above eps = 1e-6."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 16, dtype=dtype) * torch.rand(2, 5, 3, 1, dtype=dtype) * 4
    x[0, 0, 0] = 0
    for i, norm in enumerate((1e-5, 1e-3, 3e-3)):  # ||x||^2 = 1e-10, 1e-6 (= eps), 9e-6
        x[1, 0, i] = F.normalize(torch.randn(16, dtype=dtype), dim=0) * norm
    return x


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_l2_normalize_eps_matches_its_formula_float64(eps):
    """Values and gradients as autograd through x / sqrt(sum x^2 + eps) gives them, in fp64, rows whose squared
    norm is far below eps included (there eps dominates: y ~ x / sqrt(eps), no clamp as F.normalize has)."""
    x, upstream = l2_eps_rows(), torch.randn(2, 5, 3, 16, dtype=torch.float64)
    results = []
    for fn in (l2_normalize_eps, l2_normalize_eps_formula):
        leaf = x.clone().requires_grad_()
        y = fn(leaf, eps)
        y.backward(upstream)
        results.append((y.detach(), leaf.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    y = results[0][0]
    assert y[0, 0, 0].abs().max() == 0
    norms = torch.linalg.vector_norm(x, dim=-1)
    torch.testing.assert_close(torch.linalg.vector_norm(y, dim=-1), norms / (norms**2 + eps).sqrt(), rtol=1e-12, atol=0)


def test_l2_normalize_eps_gradcheck():
    x = l2_eps_rows()[:, :2].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: l2_normalize_eps(t, 1e-6), (x,))
    assert torch.autograd.gradcheck(lambda t: l2_normalize_eps(t, 0.5), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_eps_lower_precision_keeps_dtype_and_tracks_float64(dtype):
    x, upstream = l2_eps_rows(), torch.randn(2, 5, 3, 16, dtype=torch.float64)
    results = []
    for fn, dt in ((l2_normalize_eps, dtype), (l2_normalize_eps_formula, torch.float64)):
        leaf = x.to(dt).requires_grad_()
        y = fn(leaf, 1e-6)
        y.backward(upstream.to(dt))
        assert y.dtype == leaf.grad.dtype == dt
        results.append((y.detach().double(), leaf.grad.double()))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    (y, dx), (y_ref, dx_ref) = results
    torch.testing.assert_close(y, y_ref, **tol)
    scale = dx_ref.abs().amax(-1, keepdim=True)  # rows below eps have gradients up to 1e3 |upstream|
    torch.testing.assert_close(dx / scale, dx_ref / scale, **tol)


def test_l2_normalize_eps_differs_from_f_normalize_by_the_eps_in_the_denominator():
    """The two forms agree up to the factor ||x|| / sqrt(||x||^2 + eps): 1 - eps / (2 ||x||^2) for unit-scale rows."""
    x = torch.randn(64, 32, dtype=torch.float64)
    ratio = l2_normalize_eps(x, 1e-6) / F.normalize(x, dim=-1)
    norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    torch.testing.assert_close(ratio, (norms / (norms**2 + 1e-6).sqrt()).expand_as(x), rtol=1e-13, atol=0)
    assert (ratio < 1).all() and (1 - ratio).max() < 1e-6
