"""flash-linear-attention's Triton `chunk_kda`: the GPU fast path, an optional dependency imported on first use.

Same layout and conventions as naive.py / chunk.py (FLA defined them): q, k [B, T, H, K]; v [B, T, HV, V];
g [B, T, HV, K] log decay; beta [B, T, HV]; state [B, HV, K, V] fp32. q and k are passed already normalised
and g already computed, so FLA's in-kernel l2norm and gate options stay off. The kernels:
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/chunk.py
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/fused_recurrent.py
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

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
) -> tuple[Tensor, Tensor | None]:
    """FLA's chunk_kda on CUDA tensors: o [B, T, HV, V] and the final state [B, HV, K, V] (or None)."""
    check_kda_inputs(q, k, v, g, beta, initial_state)
    chunk_kda = require_fla()
    if not q.is_cuda:
        raise RuntimeError(
            f"KDA implementation='fla' runs Triton kernels and needs CUDA tensors; got device {q.device}. "
            "Use implementation='chunk' on CPU."
        )
    return chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state
    )


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
