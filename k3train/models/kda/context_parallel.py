"""KDA over a sequence split across ranks (context parallelism, k3train/models/common/context_parallel.py).

The recurrence is affine in the state a slice starts from: with S_in the state entering rank r's slice,

    final state   S_out = M_r S_in + F_r        M_r [K, K]: the slice's decays and delta-rule erasures composed
    outputs       o_t   = o_t(0) + Q_t S_in     Q_t [K]: q_t through the same transitions up to t

where F_r and o(0) are the slice run from a zero state (chunk_kda as it is), and M_r and Q are the slice run from the
identity (S_in = I, K x K) with v = 0: two chunked passes, each rank's independent of the others. The ranks then
all-gather (M_r, F_r) and each composes the states before its own, S_in(r) = M_{r-1} S_in(r-1) + F_{r-1} from a
zero state at rank 0, so no rank waits for another's pass. A document that starts at a slice's first position starts
from zero (S_in = 0); one that starts inside a slice cuts M_r and Q there by itself (chunk_kda restarts the state).

Both passes run in k3train's chunk_kda (implementation="chunk") or in FLA's Triton chunk_kda (implementation="fla",
fla.py's fla_chunk_kda: it takes the initial state, returns the final one and differentiates through both outputs,
and with documents gives the initial state to each row's first document only, as chunk_kda does).

Per rank this costs two chunked passes instead of one and moves 2 x heads x K x (K + V) numbers per row; FLA's
`fla/ops/cp` passes the states the same way (its pre-scan), and NeMo Automodel's kimi_k3 context parallelism
follows it.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from k3train.models.common.context_parallel import ContextParallel
from k3train.models.common.documents import Documents
from k3train.models.kda.chunk import chunk_kda
from k3train.models.kda.fla import fla_chunk_kda

IMPLEMENTATIONS = ("chunk", "fla")


def slice_summary(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int,
    document_ids: Documents | Tensor | None = None,
    implementation: str = "chunk",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One slice from a zero state and from the identity: (o(0) [B, T, HV, V], Q [B, T, HV, K], M [B, HV, K, K],
    F [B, HV, K, V]); shapes as chunk_kda's. implementation: "chunk" (k3train's chunk_kda, chunk_size) or "fla"
    (FLA's, whose chunk size is its own). document_ids: raw [B, T] or this slice's Documents (whose cu_seqlens FLA's
    varlen form reads, made once per forward)."""
    if implementation == "chunk":
        kernel = partial(chunk_kda, chunk_size=chunk_size)
        if isinstance(document_ids, Documents):
            document_ids = document_ids.ids
    elif implementation == "fla":
        kernel = fla_chunk_kda
    else:
        raise ValueError(f"context-parallel KDA runs one of {IMPLEMENTATIONS}; got {implementation!r}")
    B, _, HV, K = g.shape
    o0, F = kernel(q, k, v, g, beta, output_final_state=True, document_ids=document_ids)
    identity = (
        torch.eye(K, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        .expand(B, HV, K, K)
        .contiguous()
    )
    no_values = v.new_zeros(*v.shape[:3], K)
    Q, M = kernel(q, k, no_values, g, beta, initial_state=identity, output_final_state=True, document_ids=document_ids)
    return o0, Q, M, F


def entering_states(transitions: list[Tensor], finals: list[Tensor], continues: list[Tensor], rank: int) -> Tensor:
    """The state entering slice `rank`: the slices before it composed from a zero state. continues[j] [B] is 1 where
    slice j's first position continues the document of slice j - 1's last, else 0 (a document starts there)."""
    S = torch.zeros_like(finals[0])
    for j in range(rank):
        S = torch.matmul(transitions[j], S) + finals[j]
        S = S * continues[j + 1].view(-1, 1, 1, 1).to(S.dtype)
    return S


def context_parallel_chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cp: ContextParallel,
    chunk_size: int = 64,
    document_ids: Documents | Tensor | None = None,
    implementation: str = "chunk",
) -> Tensor:
    """chunk_kda's output for this rank's slice of rows split over `cp` (every rank calls it: a collective);
    document_ids: this slice of the rows' ids (global numbering, so a slice can tell whether it continues the
    document the previous slice ended in), as a Documents over `cp` (the layer's: every rank's ids gathered once
    per forward) or raw [B, T]; implementation: the kernel of the two passes, "chunk" or "fla" (slice_summary)."""
    documents = Documents.of(document_ids, cp)
    o0, Q, M, F = slice_summary(q, k, v, g, beta, chunk_size, documents, implementation)
    K = M.shape[-1]
    # one exchange of both; every rank's result depends on all of it (the first rank's with weight 0), so every
    # rank takes part in its backward, the collective that returns the gradients
    summaries = cp.gather(torch.cat([M, F], dim=-1))
    transitions, finals = [s[..., :K] for s in summaries], [s[..., K:] for s in summaries]
    if documents is None:
        continues = [torch.ones(q.shape[0], device=q.device)] * cp.size
    else:
        continues = documents.slice_continues()
    S_in = entering_states(transitions, finals, continues, cp.rank)
    S_in = S_in + 0 * sum(s.sum() for s in summaries)
    return o0 + torch.einsum("bthk,bhkv->bthv", Q.to(S_in.dtype), S_in).to(o0.dtype)
