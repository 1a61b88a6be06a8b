"""QK-Clip for MLA layers (MuonClip, Kimi K2: arXiv 2507.20534; NVIDIA Megatron-LM
`megatron/core/transformer/multi_latent_attention.py`, `clip_qk`).

After a successful optimizer update, each head h whose observed max scaled logit S_h exceeded tau has its query
and key weights scaled so that the same inputs would give logits times gamma_h = tau / S_h (gamma_h = min(1,
tau / S_h) for every head; heads at or under tau keep gamma 1 and are not touched). It never clips scores inside
the forward pass: it keeps the weights from growing logits further.

Usage (the Trainer): `set_max_logit_tracking(model, True)` once; after each successful `optimizer.step()`,
`qk_clip_(model, tau)`, which reads the running max logits of the training forward passes since its last call
(all micro-batches of the update), clears them, and returns them for metrics. After a skipped update the Trainer
calls `reset_max_logits(model)`: a forward pass that produced a non-finite loss may have measured inf/NaN logits,
and an inf would give gamma = 0 and wipe the head's query and key rows.
"""

from __future__ import annotations

import torch
from torch import nn

from k3train.models.k3.mla import MultiHeadLatentAttention


def _mla_modules(model: nn.Module) -> dict[str, MultiHeadLatentAttention]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadLatentAttention)}


def set_max_logit_tracking(model: nn.Module, on: bool) -> int:
    """Turn the per-head max-logit measurement of every MLA module on or off; returns how many were set."""
    modules = _mla_modules(model)
    for m in modules.values():
        m.track_max_logit = on
        if not on:
            m.max_logit = None
    return len(modules)


def reset_max_logits(model: nn.Module) -> None:
    """Discard the running measurements (after a skipped update)."""
    for m in _mla_modules(model).values():
        m.max_logit = None


@torch.no_grad()
def qk_clip_(model: nn.Module, tau: float) -> dict:
    """Clip every MLA head whose last measured max logit exceeds tau. Returns, for metrics:
    {"max_logit": {module name: float (max over heads, before clipping)},
     "clipped_heads": {module name: [head indices clipped]}, "n_clipped": int}.
    MLA modules with no measurement (tracking off, or no training forward since the last call) are skipped.
    """
    if not tau > 0:
        raise ValueError(f"QK-Clip threshold tau={tau} must be > 0")
    max_logit: dict[str, float] = {}
    clipped: dict[str, list[int]] = {}
    for name, m in _mla_modules(model).items():
        if m.max_logit is None:
            continue
        s = m.max_logit
        m.max_logit = None  # consumed: the next update's forward passes start a fresh running max
        max_logit[name] = s.max().item()
        if not torch.isfinite(s).all():
            continue  # reported, never acted on: tau / inf = 0 would zero the head
        over = s > tau
        if over.any():
            gamma = torch.where(over, tau / s, torch.ones_like(s))
            m.scale_qk_heads_(gamma)
            clipped[name] = over.nonzero().flatten().tolist()
    return {"max_logit": max_logit, "clipped_heads": clipped, "n_clipped": sum(len(v) for v in clipped.values())}
