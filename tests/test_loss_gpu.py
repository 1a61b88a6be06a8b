"""linear_cross_entropy on a CUDA GPU against F.cross_entropy on the whole logits, at k3_small's head (V 32768:
softmax's blockwise kernel) and k3_tiny's (V 257: its one-warp-per-row kernel), both run in place on the logits
block. Skipped without CUDA."""

import pytest
import torch

from k3train.models.common.loss import linear_cross_entropy

from helpers.loss_problems import loss_and_grads, problem, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def on_cuda(hidden, weight, targets):
    return (hidden.detach().cuda().requires_grad_(), weight.detach().cuda().requires_grad_(), targets.cuda())


@pytest.mark.parametrize("v", [32768, 257])
def test_fp32_on_cuda_equals_the_reference(v, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # both sides in true fp32
    hidden, weight, targets = on_cuda(*problem(2048, 512, v, ignored=0.05))
    want = loss_and_grads(reference, hidden, weight, targets, grad_scale=0.7)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, targets, grad_scale=0.7, chunk_size=300)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("v", [32768, 257])
def test_bf16_autocast_on_cuda_matches_the_reference_under_the_same_autocast(v):
    hidden, weight, targets = on_cuda(*problem(2048, 512, v, ignored=0.05))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = loss_and_grads(reference, hidden, weight, targets)
        got = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk_size=300)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        assert a.dtype == b.dtype == torch.float32, name
        torch.testing.assert_close(
            a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("autocast", [False, True])
def test_auto_takes_flas_fused_loss_on_cuda_and_equals_the_reference(autocast, monkeypatch):
    """Without a chunk_size, `auto` runs flash-linear-attention's fused linear cross-entropy on CUDA tensors."""
    pytest.importorskip("fla", reason="needs flash-linear-attention: pip install 'k3train[gpu]'")
    from unittest import mock

    import fla.modules.fused_linear_cross_entropy as fla_lce

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    hidden, weight, targets = on_cuda(*problem(4096, 512, 32768, ignored=0.05))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        want = loss_and_grads(reference, hidden, weight, targets, grad_scale=0.7)
        with mock.patch.object(
            fla_lce, "fused_linear_cross_entropy_loss", wraps=fla_lce.fused_linear_cross_entropy_loss
        ) as fused:
            got = loss_and_grads(linear_cross_entropy, hidden, weight, targets, grad_scale=0.7)
    assert fused.call_count == 1
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        tol = dict(rtol=2e-2, atol=2e-2 * b.abs().max().item()) if autocast else dict(rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m, name=name: f"{name}: {m}")
