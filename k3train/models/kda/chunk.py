"""Chunkwise Kimi Delta Attention in pure PyTorch: the default (and differentiable) path on CPU.

Same math as naive.py, regrouped (FLA `naive_chunk_kda`, Kimi Linear tech report): inside a chunk of C steps the
delta rule is a unit lower-triangular system (the WY/UT transform), built and inverted for all chunks at once;
only the state hand-over between chunks stays a Python loop (T / C iterations). Autograd differentiates it all.

Per chunk, with G the cumulative sum of g from the chunk start (G <= 0, decreasing) and S the state at its start:
  A_kk[i, j] = beta_i sum_d k_id k_jd exp(G_id - G_jd)   (j < i)
  [w | u] = (I + A_kk)^-1 (beta * [exp(G) k | v])
  v' = u - w S;   o = (q exp(G)) S + A_qk v'   with A_qk[i, j] = sum_d q_id k_jd exp(G_id - G_jd)   (j <= i)
  S <- exp(G_last) S + (exp(G_last - G) k)^T v'
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3train.models.kda.naive import check_kda_inputs, compute_dtype


def _join(upper: Tensor, lower_left: Tensor, lower: Tensor) -> Tensor:
    """Lower block-triangular [[upper, 0], [lower_left, lower]]: [..., h, h] x 3 -> [..., 2h, 2h]."""
    return torch.cat([F.pad(upper, (0, upper.shape[-1])), torch.cat([lower_left, lower], dim=-1)], dim=-2)


def _intra_chunk(q: Tensor, k: Tensor, G: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """A_qk (j <= i) and (I + A_kk)^-1, both [..., C, C], from q, k, G [..., C, K] and beta [..., C, 1].

    exp(G_i - G_j) <= 1 for j <= i, but the factored form exp(G_i) exp(-G_j) overflows once a chunk decays by
    more than e^-88, and the exact pairwise [C, C, K] tensor is slow. So both matrices are built from 1x1 blocks
    up, doubling the block size (C must be a power of two). A block's lower-left quadrant pairs rows i of its
    lower half with columns j of its upper half; with r the first row of the lower half (j < r <= i),
    exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) has both factors <= 1, so the quadrant is one matmul.
    The inverse doubles alongside: [[U, 0], [X, L]]^-1 = [[U^-1, 0], [-L^-1 X U^-1, L^-1]].
    """
    C = k.shape[-2]
    A_qk = (q * k).sum(-1)[..., None, None]  # [..., C blocks, 1, 1]: the diagonal
    inverse = torch.ones_like(A_qk)  # (I + A_kk)^-1 on 1x1 blocks
    half = 1
    while half < C:
        # unbind, not x[..., 0, :, :]: each indexing's backward writes a zero-filled copy of the whole tensor
        (_, q_lo), (k_up, k_lo), (G_up, G_lo), (_, beta_lo) = (
            x.unflatten(-2, (C // (2 * half), 2, half)).unbind(-3) for x in (q, k, G, beta))  # [..., nb, h, *]
        G_r = G_lo[..., :1, :]  # [..., nb, 1, K]
        cols = k_up * (G_r - G_up).exp()  # [..., nb, h, K]
        rows = torch.stack([q_lo, k_lo]) * (G_lo - G_r).exp()
        qk_quadrant, kk_quadrant = (rows @ cols.transpose(-1, -2)).unbind(0)  # [..., nb, h, h] each
        kk_quadrant = beta_lo * kk_quadrant
        qk_upper, qk_lower = A_qk.unflatten(-3, (-1, 2)).unbind(-3)  # [..., nb, h, h]: the diagonal sub-blocks
        A_qk = _join(qk_upper, qk_quadrant, qk_lower)
        inv_upper, inv_lower = inverse.unflatten(-3, (-1, 2)).unbind(-3)
        inverse = _join(inv_upper, -inv_lower @ kk_quadrant @ inv_upper, inv_lower)
        half *= 2
    return A_qk.squeeze(-3), inverse.squeeze(-3)


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise KDA, equal to naive_recurrent_kda up to fp32 rounding. Any T works: the tail is padded.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] log decay (<= 0); beta [B, T, HV];
    initial_state [B, HV, K, V]; chunk_size a power of two. Returns o [B, T, HV, V] in v's dtype and the final
    state [B, HV, K, V] in fp32 (None unless output_final_state). Computes in fp32 even under autocast.
    """
    check_kda_inputs(q, k, v, g, beta, initial_state)
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two (16, 32, 64, ...); got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    out_dtype, dtype = v.dtype, compute_dtype(v)
    with torch.autocast(q.device.type, enabled=False):
        if HV != H:  # each q/k head serves HV // H value heads (repeat_interleave copies even when HV == H)
            q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
        q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
        q = q * scale  # [B, T, HV, K]
        # Pad the tail to whole chunks with q = k = v = g = beta = 0: there the state neither decays nor updates,
        # and causality hides the padding from real steps, so outputs and final state are exact.
        pad = (-T) % C
        if pad:
            q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
            beta = F.pad(beta, (0, 0, 0, pad))
        N = (T + pad) // C
        q, k, v, g = (x.transpose(1, 2).reshape(B, HV, N, C, -1) for x in (q, k, v, g))  # [B, HV, N, C, D]
        beta = beta.transpose(1, 2).reshape(B, HV, N, C, 1)
        G = g.cumsum(-2)  # log decay from the chunk start through each step

        # Intra-chunk work, every chunk at once.
        A_qk, inverse = _intra_chunk(q, k, G, beta)  # [B, HV, N, C, C] each
        w, u = (inverse @ (beta * torch.cat([k * G.exp(), v], dim=-1))).split([K, V], dim=-1)
        q_in = q * G.exp()  # reads the state at the chunk start
        k_out = (k * (G[..., -1:, :] - G).exp()).transpose(-1, -2)  # [B, HV, N, K, C]: writes the chunk-end state
        chunk_decay = G[..., -1, :, None].exp()  # [B, HV, N, K, 1]

        # Inter-chunk recurrence: the only sequential part.
        S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dtype)
        starts, v_new = [], []
        # unbind, not x[:, :, n]: each indexing's backward would write a zero-filled copy of the whole tensor.
        for u_n, w_n, k_out_n, decay_n in zip(*(x.unbind(2) for x in (u, w, k_out, chunk_decay))):
            starts.append(S)
            v_new.append(u_n - w_n @ S)  # [B, HV, C, V]: the values the state fails to predict
            S = decay_n * S + k_out_n @ v_new[-1]
        o = q_in @ torch.stack(starts, dim=2) + A_qk @ torch.stack(v_new, dim=2)  # [B, HV, N, C, V]
        o = o.reshape(B, HV, N * C, V)[:, :, :T].transpose(1, 2)  # [B, T, HV, V]
    return o.to(out_dtype), (S if output_final_state else None)
