"""RMSNorm's written-out backward against nn.RMSNorm: values, gradients, state_dict, and where it steps aside."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3train.models.norm import RMSNorm, RMSNormFunction

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
