"""RMSNorm's written-out backward against nn.RMSNorm (values, gradients, state_dict, and where it steps aside), and
l2_normalize's against F.normalize."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.norm import RMSNorm, RMSNormFunction, l2_normalize

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_matches_f_normalize(dtype):
    """Values and gradients as autograd through F.normalize gives them, rows whose norm is clamped to eps included
    (a zero row, and one of norm 1e-13: there the gradient has no projection term)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 16) * torch.rand(2, 5, 3, 1) * 4
    x[0, 0, 0] = 0
    x[1, 0, 0] = torch.nn.functional.normalize(torch.randn(16), dim=0) * 1e-13
    upstream = torch.randn(x.shape)
    results = []
    for fn in (l2_normalize, lambda t: F.normalize(t, dim=-1)):
        leaf = x.to(dtype).requires_grad_()
        y = fn(leaf)
        y.backward(upstream.to(dtype))
        assert y.dtype == leaf.grad.dtype == dtype
        results.append((y.detach().float(), leaf.grad.float()))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol)


def test_l2_normalize_gradcheck():
    x = torch.randn(4, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(l2_normalize, (x,))
