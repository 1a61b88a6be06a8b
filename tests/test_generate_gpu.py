"""Decoding on a CUDA GPU: the incremental logits against the full forward's, with the pure-PyTorch KDA and with
FLA's kernels (chunk_kda for the prompt, fused_recurrent_kda per token). Skipped without CUDA; the FLA case also
without flash-linear-attention and triton (pip install 'k3train[gpu]')."""

import pytest
import torch

from helpers.decoding import build, incremental_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def rms_ratio(fast: torch.Tensor, reference: torch.Tensor) -> float:
    """FLA's own test metric (tests/ops/test_kda.py): RMS(fast - reference) / RMS(reference)."""
    return ((fast - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("implementation, tolerance", [("chunk", 1e-4), ("fla", 0.005)])
def test_incremental_decoding_equals_the_full_forward_on_cuda(implementation, tolerance, monkeypatch):
    # cuDNN runs forward()'s short convs in TF32 by default (10 mantissa bits); decoding's weighted sums are fp32.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    if implementation == "fla":
        pytest.importorskip("triton", reason="triton not installed: pip install 'k3train[gpu]'")
        pytest.importorskip("fla.ops.kda", reason="flash-linear-attention not installed: pip install 'k3train[gpu]'")
    model = build("k3_tiny", kda_implementation=implementation).cuda()
    tokens = torch.randint(0, 257, (2, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        full, _ = model(tokens)
    assert rms_ratio(incremental_logits(model, tokens, prefill=70), full) < tolerance
