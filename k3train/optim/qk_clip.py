"""QK-Clip for MLA layers (MuonClip, Kimi K2: arXiv 2507.20534; NVIDIA Megatron-LM's MLA `clip_qk`).
https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/megatron/core/transformer/multi_latent_attention.py

After a successful optimizer update, each head h whose observed max scaled logit S_h exceeded tau has its query
and key weights scaled so that the same inputs would give logits times gamma_h = tau / S_h (gamma_h = min(1,
tau / S_h) for every head; heads at or under tau keep gamma 1 and are not touched). It never clips scores inside
the forward pass: it keeps the weights from growing logits further.

It runs as a training callback (QKClip in k3train/train/callbacks.py, conf/callbacks/qk_clip.yaml): `setup` turns
the max-logit measurement on; after each successful update `qk_clip_` reads the running max logits of the training
forward passes since its last call (all micro-batches of the update), clears them and clips; after a skipped update
`reset_max_logits` drops them: a forward pass that produced a non-finite loss may have measured inf/NaN logits, and
an inf would give gamma = 0 and wipe the head's query and key rows. Any module with the MaxLogitTracking attributes
takes part (MLA has them).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn


@runtime_checkable
class MaxLogitTracking(Protocol):
    """What an attention module offers QK-Clip (k3train/models/k3/mla.py has it): with `track_max_logit` on, each
    training forward folds its per-head max scaled logit into `max_logit` [n_heads]; `scale_qk_heads_(gamma)` makes
    the same inputs give head h's logits times gamma[h]."""

    track_max_logit: bool
    max_logit: torch.Tensor | None

    def scale_qk_heads_(self, gamma: torch.Tensor) -> None: ...


def _mla_modules(model: nn.Module) -> dict[str, MaxLogitTracking]:
    # The protocol's members tested directly: isinstance against a runtime_checkable Protocol walks typing's
    # machinery for each of the model's modules, on every update (why: docs/decisions/qk-clip.md).
    return {
        name: m
        for name, m in model.named_modules()
        if hasattr(m, "track_max_logit") and hasattr(m, "max_logit") and callable(getattr(m, "scale_qk_heads_", None))
    }


def set_max_logit_tracking(model: nn.Module, on: bool) -> int:
    """Turn the per-head max-logit measurement of every tracking (MLA) module on or off; returns how many were set."""
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
def qk_clip_(model: nn.Module, tau: float, group: dist.ProcessGroup | None = None) -> dict:
    """Clip every MLA head whose last measured max logit exceeds tau. Returns, for metrics:
    {"max_logit": {module name: float (max over heads, before clipping)}, "max_logit_head": {module name: the head
     it is of}, "clipped_heads": {module name: [head indices clipped]}, "n_clipped": int}.
    MLA modules with no measurement (tracking off, or no training forward since the last call) are skipped.
    With `group` (the data-parallel ranks; None in one process) the measurement is the max over every rank's
    tokens, so every rank clips alike.
    """
    if not tau > 0:
        raise ValueError(f"QK-Clip threshold tau={tau} must be > 0")
    max_logit: dict[str, float] = {}
    head: dict[str, int] = {}
    clipped: dict[str, list[int]] = {}
    for name, m in _mla_modules(model).items():
        if m.max_logit is None:
            continue
        if group is not None:
            # NaN as inf first: a max with NaN depends on the order of the operands, inf is non-finite on every rank.
            m.max_logit = torch.nan_to_num(m.max_logit, nan=float("inf"))
            dist.all_reduce(m.max_logit, op=dist.ReduceOp.MAX, group=group)
        s = m.max_logit
        m.max_logit = None  # consumed: the next update's forward passes start a fresh running max
        max_logit[name] = s.max().item()
        head[name] = int(s.argmax())
        if not torch.isfinite(s).all():
            continue  # reported, never acted on: tau / inf = 0 would zero the head
        over = s > tau
        if over.any():
            gamma = torch.where(over, tau / s, torch.ones_like(s))
            m.scale_qk_heads_(gamma)
            clipped[name] = over.nonzero().flatten().tolist()
    n_clipped = sum(len(v) for v in clipped.values())
    return {"max_logit": max_logit, "max_logit_head": head, "clipped_heads": clipped, "n_clipped": n_clipped}
