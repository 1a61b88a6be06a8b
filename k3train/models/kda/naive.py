"""Kimi Delta Attention, the per-step fp32 reference: readable, slow, and the ground truth for the fast paths.

Layout follows flash-linear-attention (time before heads): q, k [B, T, H, K], v [B, T, HV, V],
g [B, T, HV, K] (log-space decay, <= 0), beta [B, T, HV], state [B, HV, K, V] fp32. HV may exceed H
(grouped value attention): each q/k head then serves HV // H consecutive value heads.
Upstream: FLA's `naive_recurrent_kda` (written against flash-linear-attention 0.6.0; the link pins the newest
commit found) and the Kimi Linear tech report (arXiv 2510.26692):
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/naive.py
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3train.models.common.documents import document_starts


def check_kda_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> None:
    """Raise ValueError naming the first tensor whose shape does not fit the [B, T, H, K] layout."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError(f"q, k, v, g, beta need at least one time step; got T={T}")
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H != 0:
        raise ValueError(f"v must be [B, T, HV, V] with HV a multiple of H={H}; got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {(B, T, HV, K)}; got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}; got {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise ValueError(f"initial_state must be [B, HV, K, V] = {(B, HV, K, V)}; got {tuple(initial_state.shape)}")


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for half-precision inputs (state and decays need it), float64 kept for tight tests."""
    return torch.promote_types(x.dtype, torch.float32)


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One step at a time: S <- diag(exp g_t) S; S <- S + beta_t k_t (v_t - S^T k_t)^T; o_t = S^T (scale q_t).

    q, k are used as given (the layer L2-normalises them). document_ids [B, T] (k3train/models/common/documents.py): S
    starts from zero again where a document starts, as if each document ran alone. Returns o [B, T, HV, V] in v's
    dtype and the final state [B, HV, K, V] fp32 (None unless output_final_state).
    """
    check_kda_inputs(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    out_dtype, dtype = v.dtype, compute_dtype(v)
    # The state and the decays live in fp32 even inside a bf16 autocast region.
    with torch.autocast(q.device.type, enabled=False):
        q = q.to(dtype).repeat_interleave(HV // H, dim=2) * scale  # [B, T, HV, K]
        k = k.to(dtype).repeat_interleave(HV // H, dim=2)  # [B, T, HV, K]
        v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
        S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dtype)
        starts = None if document_ids is None else document_starts(document_ids)
        outputs = []
        for t in range(T):
            if starts is not None:  # a new document remembers nothing of the one before it
                S = torch.where(starts[:, t, None, None, None], 0.0, S)
            S = S * g[:, t, :, :, None].exp()  # decay each key row of the state
            error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)  # [B, HV, V]: what S mispredicts
            S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], error)
            outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        o = torch.stack(outputs, dim=1)  # [B, T, HV, V]
    return o.to(out_dtype), (S if output_final_state else None)
