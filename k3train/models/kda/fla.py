"""flash-linear-attention's Triton `chunk_kda`: the GPU fast path, an optional dependency imported on first use.

Same layout and conventions as naive.py / chunk.py (FLA defined them): q, k [B, T, H, K]; v [B, T, HV, V];
g [B, T, HV, K] log decay; beta [B, T, HV]; state [B, HV, K, V] fp32. fla_chunk_kda and fla_fused_recurrent_kda
take q and k already normalised and g and beta already computed (their in-kernel options off). The kernels:
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/chunk.py
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/fused_recurrent.py

Documents packed into rows (document_ids) go through FLA's varlen form: the batch flattened into one row of B*T
steps and `cu_seqlens`, every document its own sequence whose state starts from zero (but a row's first document,
which continues an initial state where one is given), as chunk_kda's docstring gives it (batch 1, cu_seqlens int64
[N + 1], one initial/final state per sequence):
https://github.com/fla-org/flash-linear-attention/blob/0395eef12dd31ec73cd853230f555609b620d4c5/fla/ops/kda/chunk.py
FLA's kernels need CUDA, or Triton's interpreter on a CPU (TRITON_INTERPRET=1, slow): tests/fla runs them there
against k3train's chunk_kda, the varlen path included; tests/test_kda_gpu.py compares them on a GPU.

The KDA layer's forward under implementation="fla" also runs its elementwise steps in FLA's kernels (layer.py says
which and why; docs/decisions/kda-layer.md): the short convolution (fla_short_conv_silu), chunk_kda's in-kernel
forget gate, beta sigmoid and q/k L2 norm (fla_chunk_kda_from_projections) and the gated output RMSNorm
(fla_rms_norm_sigmoid_gated). Those options of chunk_kda (use_gate_in_kernel, lower_bound, safe_gate,
use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel) and the gate and norm they compute:
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/chunk.py
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/gate.py
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/modules/l2norm.py
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from k3train.models.common.documents import Documents
from k3train.models.common.fla import fla_runs_on
from k3train.models.kda.naive import check_kda_inputs

# The eps of chunk_kda's in-kernel q/k L2 norm (use_qk_l2norm_in_kernel): l2norm_fwd's default, which chunk_kda gives
# no way to change.
FLA_QK_L2NORM_EPS = 1e-6
# The lowest lower_bound chunk_kda accepts with safe_gate=True and its in-kernel gate: safe_gate's intra-chunk kernel
# rescales q and k by exponentials of the gates' sums over a 16-step block, which must stay within fp32's range.
FLA_SAFE_GATE_LOWEST_BOUND = -5.0


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


def _require_fla_device(x: Tensor) -> None:
    if not fla_runs_on(x):
        raise RuntimeError(
            f"KDA implementation='fla' runs Triton kernels and needs CUDA tensors; got device {x.device}. "
            "Use implementation='chunk' on CPU."
        )


def fla_chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    document_ids: Documents | Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """FLA's chunk_kda on CUDA tensors: o [B, T, HV, V] and the final state [B, HV, K, V] (or None); document_ids
    [B, T] (or their Documents, whose varlen form is made once per forward) restart the state at each document start
    (module docstring), a row's first document continuing initial_state as chunk_kda's does
    (_fla_chunk_kda_documents)."""
    check_kda_inputs(q, k, v, g, beta, initial_state)
    chunk_kda = require_fla()
    _require_fla_device(q)
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
    document_ids: Documents | Tensor,
) -> tuple[Tensor, Tensor | None]:
    """chunk_kda over the rows flattened into one varlen row, one sequence per document; o back as [B, T, HV, V],
    the final state as each row's last document's [B, HV, K, V].

    FLA takes one initial state per sequence ([N, HV, K, V] for N documents): initial_state [B, HV, K, V] goes to
    each row's FIRST document and every other document starts from zero, so a row reads as chunk_kda with
    document_ids has it (its first document continues initial_state, each later one starts afresh). The gradient
    reaches initial_state through its rows' first documents alone. N is cu_seqlens' length less one: no host read."""
    B, T = q.shape[:2]
    documents = Documents.local(document_ids)
    flat = {name: x.reshape(1, B * T, *x.shape[2:]) for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    documents_per_row = documents.documents_per_row
    last_documents = documents_per_row.cumsum(0) - 1  # each row's last document among all N, in order
    if initial_state is not None:
        first_documents = last_documents - documents_per_row + 1
        initial_state = initial_state.new_zeros(documents.count, *initial_state.shape[1:]).index_copy(
            0, first_documents, initial_state
        )
    o, final_state = chunk_kda(
        **flat,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=documents.cu_seqlens,
    )
    if final_state is not None:  # [N, HV, K, V] over all documents in order: each row's last one
        final_state = final_state[last_documents]
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


def fla_chunk_kda_from_projections(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f: Tensor,
    beta_logits: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float | None,
    normalize_qk: bool,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """FLA's chunk_kda from the layer's projections, its elementwise steps inside FLA's kernels: o [B, T, HV, V].

    The forget gate from f [B, T, HV, K] (f_b_proj's output) in the cumsum kernel: -exp(A_log) softplus(f + dt_bias),
    or with lower_bound lower_bound * sigmoid(exp(A_log) (f + dt_bias)); beta = sigmoid(beta_logits [B, T, HV]) in
    fp32; with normalize_qk q and k each x / sqrt(sum x^2 + FLA_QK_L2NORM_EPS) per head (else they come normalised).
    A lower_bound within [FLA_SAFE_GATE_LOWEST_BOUND, 0) also turns on safe_gate: the same products through an
    intra-chunk kernel that relies on every log decay lying in [lower_bound, 0), which the bounded sigmoid gate
    guarantees. cu_seqlens: B = 1 and every sequence's state starts from zero; no initial or final state (training).
    """
    check_kda_inputs(q, k, v, f, beta_logits, None)
    chunk_kda = require_fla()
    _require_fla_device(q)
    o, _ = chunk_kda(
        q=q,
        k=k,
        v=v,
        g=f,
        beta=beta_logits,
        A_log=A_log,
        dt_bias=dt_bias,
        use_gate_in_kernel=True,
        lower_bound=lower_bound,
        safe_gate=lower_bound is not None and lower_bound >= FLA_SAFE_GATE_LOWEST_BOUND,
        use_beta_sigmoid_in_kernel=True,
        use_qk_l2norm_in_kernel=normalize_qk,
        cu_seqlens=cu_seqlens,
    )
    return o


def fla_short_conv_silu(x: Tensor, weight: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """SiLU(causal depthwise conv of x, zero-padded in front) in FLA's causal_conv1d Triton kernel, the functional
    form of its ShortConvolution: x [B, T, D], weight [D, 1, W] as nn.Conv1d holds it -> [B, T, D] in x's dtype
    (the kernel sums in fp32). cu_seqlens: x is one row (B = 1) of sequences, each padded as if it ran alone.
    https://github.com/fla-org/flash-linear-attention/blob/0a1659faa00b3a710e75562bb940a28ec1e453c4/fla/modules/causal_conv1d/ops.py
    """
    _require_fla_device(x)
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(x, weight=weight.squeeze(1), activation="silu", backend="triton", cu_seqlens=cu_seqlens)
    return y


def fla_rms_norm_sigmoid_gated(x: Tensor, gate_logits: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate_logits) over the last dimension in one Triton kernel, in
    fp32 whatever the inputs' dtype, the result in x's: FLA's FusedRMSNormGated(activation="sigmoid") as a function
    of a weight the caller owns.
    https://github.com/fla-org/flash-linear-attention/blob/1f81376ff68590d58d89188f4939770474e72234/fla/modules/norm/fused_norm_gate.py
    """
    _require_fla_device(x)
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x, gate_logits, weight, None, activation="sigmoid", eps=eps)
