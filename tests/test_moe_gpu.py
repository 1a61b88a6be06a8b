"""The routed experts on a CUDA GPU: torch's grouped GEMM (what expert_implementation=auto runs in bf16 there)
against the per-expert loop, and a MoE training step with no host sync. Skipped without CUDA."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from k3train.models.k3.moe import MoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# k3_small's MoE: 64 experts of ffn 192 at the latent width 256, 4 a token, SiTU-GLU
D, E, K, FFN, LATENT = 512, 64, 4, 192, 256


def k3_small_moe(implementation: str) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, E, K, FFN, activation="situ", latent_dim=LATENT, expert_implementation=implementation)
    return moe.cuda().train()


def step(moe: MoE, autocast: bool) -> dict:
    x = torch.randn(4, 1024, D, device="cuda", generator=torch.Generator("cuda").manual_seed(1), requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = moe(x)
    out.float().square().mean().backward()
    return {"out": out.detach().float(), "x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


@pytest.mark.parametrize("autocast", [True, False])
def test_grouped_mm_equals_the_loop_on_cuda(autocast, monkeypatch):
    """bf16 autocast (auto's choice there) and fp32 (grouped_mm chosen by hand): the output and every gradient."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    want = step(k3_small_moe("loop"), autocast)
    with mock.patch("torch.nn.functional.grouped_mm", wraps=F.grouped_mm) as grouped_mm:
        have = step(k3_small_moe("auto" if autocast else "grouped_mm"), autocast)
    assert grouped_mm.call_count == 8  # 3 forward, 5 backward
    for name in want:
        scale = want[name].abs().max().item()
        tol = dict(rtol=2e-2, atol=1e-2 * scale) if autocast else dict(rtol=1e-4, atol=1e-5 * scale)
        torch.testing.assert_close(have[name], want[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_a_moe_training_step_never_waits_for_the_host():
    """Routing, Quantile Balancing, the counts, the grouped GEMMs and the backward, under bf16 autocast, with CUDA's
    sync debug mode raising at any operation that would make the host wait for the GPU."""
    moe = k3_small_moe("auto")
    step(moe, autocast=True)  # warm-up: first-use allocations and kernel selection
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(moe, autocast=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
