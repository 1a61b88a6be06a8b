"""flash-linear-attention's Triton `chunk_kda`: the GPU fast path, an optional dependency imported on first use.

Same layout and conventions as naive.py / chunk.py (FLA defined them): q, k [B, T, H, K]; v [B, T, HV, V];
g [B, T, HV, K] log decay; beta [B, T, HV]; state [B, HV, K, V] fp32. q and k are passed already normalised
and g already computed, so FLA's in-kernel l2norm and gate options stay off. The kernels:
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/chunk.py
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/fused_recurrent.py

Documents packed into rows (document_ids) go through FLA's varlen form: the batch flattened into one row of B*T
steps and `cu_seqlens`, every document its own sequence whose state starts from zero, as chunk_kda's docstring
gives it (batch 1, cu_seqlens int64 [N + 1], one initial/final state per sequence):
https://github.com/fla-org/flash-linear-attention/blob/0395eef12dd31ec73cd853230f555609b620d4c5/fla/ops/kda/chunk.py
That path is untested here: FLA needs CUDA, and this machine has none (tests/test_kda_gpu.py's checks run on one).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from k3train.models.documents import cu_seqlens, document_starts
from k3train.models.kda.naive import check_kda_inputs


def require_fla() -> Callable:
    """Return `fla.ops.kda.chunk_kda`, or raise ImportError saying how to install it."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as err:
        raise ImportError(
            "KDA implementation='fla' needs flash-linear-attention (and triton) on a CUDA machine: "
            "pip install 'k3train[gpu]'. On CPU use implementation='chunk'."
        ) from err
    return chunk_kda


def fla_chunk_kda(
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
    """FLA's chunk_kda on CUDA tensors: o [B, T, HV, V] and the final state [B, HV, K, V] (or None); document_ids
    [B, T] restart the state at each document start (module docstring; no initial_state with them)."""
    check_kda_inputs(q, k, v, g, beta, initial_state)
    chunk_kda = require_fla()
    if not q.is_cuda:
        raise RuntimeError(
            f"KDA implementation='fla' runs Triton kernels and needs CUDA tensors; got device {q.device}. "
            "Use implementation='chunk' on CPU."
        )
    if document_ids is not None:
        return _fla_chunk_kda_documents(
            chunk_kda, q, k, v, g, beta, scale, initial_state, output_final_state, document_ids
        )
    return chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state
    )


def _fla_chunk_kda_documents(
    chunk_kda: Callable,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    document_ids: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """chunk_kda over the rows flattened into one varlen row, one sequence per document; o back as [B, T, HV, V],
    the final state as each row's last document's [B, HV, K, V]."""
    if initial_state is not None:  # training never continues a state; FLA would want one per document
        raise ValueError("fla_chunk_kda: document_ids with an initial_state is not supported")
    B, T = q.shape[:2]
    flat = {name: x.reshape(1, B * T, *x.shape[2:]) for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    o, final_state = chunk_kda(
        **flat, scale=scale, output_final_state=output_final_state, cu_seqlens=cu_seqlens(document_ids)
    )
    if final_state is not None:  # [N, HV, K, V] over all documents in order: each row's last one
        documents_per_row = document_starts(document_ids).sum(dim=1) + 1
        final_state = final_state[documents_per_row.cumsum(0) - 1]
    return o.view(B, T, *o.shape[2:]), final_state


def fla_fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """FLA's fused_recurrent_kda (forward only: decoding one token at a time), same layout as fla_chunk_kda."""
    check_kda_inputs(q, k, v, g, beta, initial_state)
    require_fla()
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state
    )
