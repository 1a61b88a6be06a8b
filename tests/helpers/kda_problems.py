"""KDA problems: random q, k, v, g, beta and initial state, one forward with the final state and backward, the
comparison of two runs' outputs and gradients (test_kda.py, test_kda_gpu.py), and rows of packed documents."""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def make_inputs(B, T, H, HV, K, V, dtype=torch.float64, decay=1.0, with_state=True, seed=0):
    """q, k, v, g, beta, initial_state (or None) as leaves requiring grad; q, k L2-normalised as the layer does."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    g = decay * F.logsigmoid(torch.randn(B, T, HV, K, generator=gen, dtype=dtype))
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    h0 = torch.randn(B, HV, K, V, generator=gen, dtype=dtype) if with_state else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, g, beta, h0)]


def run(fn, inputs, seed=1, **kwargs):
    """Forward with the final state, backward of a random projection of (o, state); returns dict by NAMES."""
    for x in inputs:
        if x is not None:
            x.grad = None
    o, S = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)  # float64 CPU draws: every dtype and device gets the same upstream
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)).sum()
    loss = loss + (S * torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S)).sum()
    loss.backward()
    grads = [x.grad if x is not None else torch.zeros(()) for x in inputs]
    return dict(zip(NAMES, [o.detach(), S.detach()] + grads))


def assert_close(result, reference, tol):
    for name in NAMES:
        diff = (result[name].double().cpu() - reference[name].double().cpu()).abs().max()
        err = (diff / reference[name].double().abs().max().clamp(min=1e-30)).item()
        assert err < tol, f"{name}: max |chunk - reference| / max |reference| = {err:.2e} >= {tol:.0e}"


def document_ids_of(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """document_ids [B, T] (k3train/models/common/documents.py) of rows packing documents of these lengths, in order."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths_per_row])
