"""Chunkwise Kimi Delta Attention in pure PyTorch, forward and backward: the default path on CPU.

Same math as naive.py, regrouped (FLA's `naive_chunk_kda`; Kimi Linear, arXiv 2510.26692): inside a chunk of C
steps the delta rule is a unit lower-triangular system (the WY/UT transform), solved for all chunks at once; only the
state hand-over between chunks stays a Python loop (T / C iterations), forward and backward.
https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/naive.py

Per chunk, with G the cumulative sum of g from the chunk start (G <= 0, decreasing), D_ij = exp(G_i - G_j)
(per key channel, <= 1 for j <= i) and S the state at the chunk start:
  A_qk[i, j] = sum_d q_id k_jd D_ijd  (j <= i);   P[i, j] = sum_d k_id k_jd D_ijd  (j < i);   A_kk = beta * P
  [w | u] = (I + A_kk)^-1 (beta * [exp(G) k | v])
  v' = u - w S;   o = (q exp(G)) S + A_qk v'
  S <- exp(G_last) S + (exp(G_last - G) k)^T v'

The decay-weighted triangular products (A_qk, P, and their gradients) never form D itself ([C, C, K] per chunk):
- inside diagonal blocks of b rows, D_ij = exp(G_i - G_m) exp(G_m - G_j) with m the block's middle row, so a block
  is one matmul of decay-scaled rows and columns; b is the largest of C, C/2, ..., 8 whose factors stay within
  e^+-40 (FACTORED_SPAN), chosen per call from the gates;
- between blocks, by doubling levels h = b, 2b, ..., C/2: a 2h-row block's lower-left quadrant pairs rows i of its
  lower half with columns j of its upper half; with r the lower half's first row (j < r <= i), D_ij =
  exp(G_i - G_r) exp(G_r - G_j) has both factors <= 1, so a quadrant is one matmul that cannot overflow however
  fast the gates decay (gates fast enough to span more than 40 within 8 rows get b = 1: levels down to single rows).

The gradient is written out by hand (_ChunkKDA.backward) rather than left to autograd, which would save and replay
every intermediate: it runs the state recurrence in reverse, then the same decay-weighted triangular products as
the forward (_decayed_rows, _decayed_cols). Equality with naive.py's autograd, every gradient: tests/test_kda.py.
Why these forms, with timings: docs/decisions/kda-chunk.md.

Documents packed into a row (document_ids, k3train/models/common/documents.py): the state restarts from zero where a
document starts, as if each document ran alone. A chunk the boundary falls inside keeps the algebra above, with
four factors cut to zero where a boundary lies between the two positions they join (_Documents): A_qk[i, j] and
P[i, j] for i, j in different documents, exp(G_i) for a row that no longer continues the chunk's first document
(it reads nothing of the start state), exp(G_last - G_j) for a row before the chunk's last document (it writes
nothing into the end state), and exp(G_last) for a chunk a document starts in (the start state does not carry
through). G stays the plain cumulative sum, so every kept factor is the one the document alone would have and every
cut one was finite (<= 1) before it was zeroed. The backward cuts the same factors. Without document_ids (or with
None) nothing is masked and the arithmetic is the same, bit for bit. FLA's kernels take boundaries as `cu_seqlens`
over one flattened row instead (fla.py); here the rows stay a batch, so the chunk loop stays T / C steps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from k3train.models.kda.naive import check_kda_inputs, compute_dtype


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
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise KDA, equal to naive_recurrent_kda up to fp32 rounding. Any T works: the tail is padded.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] log decay (<= 0); beta [B, T, HV];
    initial_state [B, HV, K, V]; chunk_size a power of two; document_ids [B, T] (k3train/models/common/documents.py):
    the state restarts at each document start (a row's first document continues initial_state). Returns
    o [B, T, HV, V] in v's dtype and the final state [B, HV, K, V] in fp32 (that of each row's last document; None
    unless output_final_state). Computes in fp32 even under autocast.
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
        # Heads first, contiguous: a view would leave every elementwise result strided, and each matmul would then
        # copy its operands out again (docs/decisions/kda-chunk.md).
        q, k, v, g = (x.transpose(1, 2).contiguous().view(B, HV, N, C, -1) for x in (q, k, v, g))  # [B, HV, N, C, D]
        beta = beta.transpose(1, 2).reshape(B, HV, N, C, 1)
        S0 = None if initial_state is None else initial_state.to(dtype)
        documents = None if document_ids is None else _Documents.of(document_ids, pad, C, dtype)
        o, S = _ChunkKDA.apply(q, k, v, g, beta, S0, documents)  # [B, HV, N, C, V], [B, HV, K, V]
        o = o.reshape(B, HV, N * C, V)[:, :, :T].transpose(1, 2)  # [B, T, HV, V]
    return o.to(out_dtype), (S if output_final_state else None)


class _Documents(NamedTuple):
    """Which factors a document boundary cuts (module docstring), 1 kept and 0 cut, per row and chunk and broadcast
    over heads: `same` [B, 1, N, C, C] whether rows i and j of a chunk lie in one document; `reads` [B, 1, N, C, 1]
    whether row i continues the document the chunk began in (so sees the state at the chunk start)."""

    same: Tensor
    reads: Tensor

    @classmethod
    def of(cls, document_ids: Tensor, pad: int, C: int, dtype: torch.dtype) -> _Documents:
        """From document_ids [B, T]; the `pad` padded steps join the row's last document (they change nothing)."""
        if pad:
            document_ids = torch.cat([document_ids, document_ids[:, -1:].expand(-1, pad)], dim=1)
        ids = document_ids.view(document_ids.shape[0], 1, -1, C)  # [B, 1, N, C]
        # The document each chunk begins in: that of the previous chunk's last row (the first chunk: its own first
        # row, which continues the initial state).
        entering = torch.cat([ids[..., :1, :1], ids[..., :-1, -1:]], dim=-2)  # [B, 1, N, 1]
        same = ids[..., :, None] == ids[..., None, :]
        return cls(same.to(dtype), (ids == entering).unsqueeze(-1).to(dtype))

    @property
    def writes(self) -> Tensor:
        """[B, 1, N, C, 1]: row j lies in the chunk's last document (it writes into the state at the chunk end)."""
        return self.same[..., -1, :].unsqueeze(-1)

    @property
    def carries(self) -> Tensor:
        """[B, 1, N, 1, 1]: no document starts in the chunk (its start state carries through to its end)."""
        return self.reads[..., -1:, :]


def _state_decays(G: Tensor, documents: _Documents | None) -> tuple[Tensor, Tensor, Tensor]:
    """The decays between a chunk's boundary states and its rows, for G [..., N, C, K]: exp(G_i) from the chunk start
    to row i (reading the start state) [..., N, C, K], exp(G_last - G_j) from row j to the chunk end (writing the end
    state) [..., N, C, K] and exp(G_last) across the chunk (carrying the state) [..., N, K, 1]; with documents, cut
    to zero where a document starts between the two."""
    read, write, carry = G.exp(), (G[..., -1:, :] - G).exp(), G[..., -1, :, None].exp()
    if documents is not None:
        read, write, carry = read * documents.reads, write * documents.writes, carry * documents.carries
    return read, write, carry


class _ChunkKDA(torch.autograd.Function):
    """q, k, g [..., N, C, K], v [..., N, C, V], beta [..., N, C, 1], initial state [..., K, V] or None, documents
    (_Documents) or None -> o [..., N, C, V] and the final state [..., K, V]."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, documents):
        N, C, K = q.shape[-3:]
        G = g.cumsum(-2)
        decays = _decays(G)
        A_qk, P = _intra_chunk(q, k, decays)
        if documents is not None:  # no attention and no delta-rule interaction between documents
            A_qk.mul_(documents.same)
            P.mul_(documents.same)
        # M = (I + beta P)^-1; unitriangular: the solver takes the unit diagonal as given and reads only below it.
        eye = torch.eye(C, dtype=q.dtype, device=q.device).expand_as(P)
        M = torch.linalg.solve_triangular(beta * P, eye, upper=False, unitriangular=True)
        eG, out_decay, chunk_decay = _state_decays(G, documents)  # [..., N, C, K] twice, [..., N, K, 1]
        w, u = M @ (beta * k * eG), M @ (beta * v)
        q_in = q * eG  # reads the state at the chunk start
        k_out = (k * out_decay).transpose(-1, -2)  # [..., N, K, C]: writes the chunk-end state

        # Inter-chunk recurrence: the only sequential part.
        S = q.new_zeros(*q.shape[:-3], K, v.shape[-1]) if initial_state is None else initial_state
        starts, v_new = q.new_empty(*q.shape[:-2], K, v.shape[-1]), torch.empty_like(u)  # [..., N, K|C, V]
        for start, v_new_n, u_n, w_n, k_out_n, decay_n in zip(
            *(x.unbind(-3) for x in (starts, v_new, u, w, k_out, chunk_decay))
        ):
            start.copy_(S)
            torch.sub(u_n, w_n @ S, out=v_new_n)  # [..., C, V]: the values the state fails to predict
            S = decay_n * S + k_out_n @ v_new_n
        o = q_in @ starts + A_qk @ v_new
        ctx.save_for_backward(q, k, v, G, beta, A_qk, P, M, w, u, v_new, starts)
        ctx.has_initial_state, ctx.block, ctx.documents = initial_state is not None, decays.block, documents
        return o, S

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dS_final):
        with torch.autocast(do.device.type, enabled=False):  # fp32, even if backward() runs under autocast
            return _ChunkKDA._backward(ctx, do, dS_final)

    @staticmethod
    def _backward(ctx, do, dS_final):
        q, k, v, G, beta, A_qk, P, M, w, u, v_new, starts = ctx.saved_tensors
        documents = ctx.documents
        decays = _decays(G, ctx.block)
        eG, out_decay, chunk_decay = _state_decays(G, documents)  # [..., N, C, K] twice, [..., N, K, 1]
        q_in, kg = q * eG, k * eG
        k_out = k * out_decay
        do = do.contiguous()

        # The recurrence in reverse: dS is the gradient of the state at a chunk's end, then at its start.
        dS = torch.zeros_like(starts[..., 0, :, :]) if dS_final is None else dS_final.contiguous()
        dv_new_from_o = A_qk.transpose(-1, -2) @ do  # [..., N, C, V]
        dS_from_o = q_in.transpose(-1, -2) @ do  # [..., N, K, V]
        dv_new, dS_ends = torch.empty_like(v_new), torch.empty_like(starts)
        for dS_end, dv_new_n, dv_o, dS_o, k_out_n, w_n, decay_n in reversed(
            list(zip(*(x.unbind(-3) for x in (dS_ends, dv_new, dv_new_from_o, dS_from_o, k_out, w, chunk_decay))))
        ):
            dS_end.copy_(dS)
            torch.add(dv_o, k_out_n @ dS, out=dv_new_n)
            dS = dS_o - w_n.transpose(-1, -2) @ dv_new_n + decay_n * dS
        d_initial_state = dS if ctx.has_initial_state else None

        # Everything else, every chunk at once.
        dq_in = do @ starts.transpose(-1, -2)  # [..., N, C, K]
        dw = -(dv_new @ starts.transpose(-1, -2))
        dk_out = v_new @ dS_ends.transpose(-1, -2)  # [..., N, C, K]
        dchunk_decay = (dS_ends * starts).sum(-1, keepdim=True)  # [..., N, K, 1]
        # [w | u] = M R  with M = (I + A_kk)^-1:  dR = M^T d[w | u],  dA_kk = -M^T d[w | u] (M R)^T = -dR [w | u]^T
        M_T = M.transpose(-1, -2)
        dR_k, dR_v = M_T @ dw, M_T @ dv_new
        dA = A_qk.new_empty(2, *A_qk.shape)  # [dA_qk, dP]: both go through the decayed products below at once
        dA_qk, dA_kk = dA.unbind(0)
        torch.matmul(do, v_new.transpose(-1, -2), out=dA_qk).tril_()
        torch.matmul(dR_k, w.transpose(-1, -2), out=dA_kk).add_(dR_v @ u.transpose(-1, -2)).tril_(-1).neg_()
        dbeta = (dR_k * kg).sum(-1, keepdim=True) + (dR_v * v).sum(-1, keepdim=True) + (dA_kk * P).sum(-1, keepdim=True)
        dA_kk.mul_(beta)  # A_kk = beta P: now dP
        if documents is not None:  # the forward zeroed these entries: nothing flows back through them
            dA.mul_(documents.same)
        dv = beta * dR_v
        # The decay-weighted products: A_qk's and P's gradients back onto their rows and columns.
        rows = _decayed_rows(dA, k, decays)  # [2, ..., N, C, K]: into q (from A_qk) and into k as P's row
        cols_qk, cols_kk = _decayed_cols(dA, torch.stack([q, k]), decays).unbind(0)  # into k as a column
        dkg = beta * dR_k
        dq = torch.addcmul(rows[0], dq_in, eG)
        dk = (dkg * eG).addcmul_(dk_out, out_decay).add_(cols_qk).add_(rows[1]).add_(cols_kk)
        # d/dG: exp(G_i - G_j) gives +G_i on the row side and -G_j on the column side.
        dG = (dq_in * q_in).addcmul_(dkg, kg).addcmul_(dk_out, k_out, value=-1).addcmul_(q, rows[0])
        dG.addcmul_(k, rows[1].sub_(cols_qk).sub_(cols_kk))
        dG[..., -1, :] += (dk_out * k_out).sum(-2) + (dchunk_decay * chunk_decay)[..., 0]
        dg = dG.flip(-2).cumsum(-2).flip(-2)  # G = cumsum(g) within the chunk
        return dq, dk, dv, dg, dbeta, d_initial_state, None


# The largest |G_i - G_m| the factored form exp(G_i - G_m) exp(G_m - G_j) may meet inside a block (m: the block's
# middle row). Its factors then stay within e^+-40 and every product, the masked-out upper triangle's (up to e^80
# times |q.k| <= 1) included, far below fp32's 3.4e38.
FACTORED_SPAN = 40.0
# Below this block size the factored matmuls are too small to pay: the doubling levels go down to single rows.
MIN_FACTORED_BLOCK = 8


class _Decays(NamedTuple):
    """How the decay D_ij = exp(G_i - G_j) is applied: inside diagonal blocks of `block` rows as row_factor_i *
    col_factor_j (exp(G_i - G_m), exp(G_m - G_j)), between blocks by the doubling levels (h, lo, up), h >= block.
    block == 1: no factored part, the levels go down to single rows."""

    block: int
    row_factor: Tensor | None  # [..., C, K]
    col_factor: Tensor | None
    levels: list[tuple[int, Tensor, Tensor]]


def _decays(G: Tensor, block: int | None = None) -> _Decays:
    """The decays for G [..., C, K]: the largest block (C, C/2, ..., MIN_FACTORED_BLOCK) whose spans |G_i - G_m| stay
    within FACTORED_SPAN (the forward's choice, passed back in for the backward), then the levels above it.

    Why the factored form first: one matmul per block instead of log2(block) levels of small batched products and
    their elementwise passes (timings: docs/decisions/kda-chunk.md). Why the levels at all: a chunk
    whose gates decay fast (past e^80 between its rows) would overflow the factors; the levels never multiply a
    factor above 1. Choosing costs a host sync (.item()) per size tried, in the forward only: fine for this
    CPU / no-FLA path.
    """
    C = G.shape[-2]
    if block is None:
        block = C
        while block >= MIN_FACTORED_BLOCK and _span(G, block) > FACTORED_SPAN:
            block //= 2
        if block < MIN_FACTORED_BLOCK:
            block = 1
    row_factor = col_factor = None
    if block > 1:
        from_middle = (G.unflatten(-2, (C // block, block)) - _block_middles(G, block)).flatten(-3, -2)
        row_factor, col_factor = from_middle.exp(), from_middle.neg_().exp_()
    levels, h = [], block
    while h < C:
        G_up, G_lo = _halves(G, h)
        G_r = G_lo[..., :1, :]
        levels.append((h, (G_lo - G_r).exp(), (G_r - G_up).exp()))
        h *= 2
    return _Decays(block, row_factor, col_factor, levels)


def _block_middles(G: Tensor, block: int) -> Tensor:
    """G at each block's middle row: [..., C, K] -> [..., C/block, 1, K]."""
    return G.unflatten(-2, (G.shape[-2] // block, block))[..., block // 2 : block // 2 + 1, :]


def _span(G: Tensor, block: int) -> float:
    """The largest |G_i - G_m| over every block of `block` rows (m: its middle row)."""
    return (G.unflatten(-2, (G.shape[-2] // block, block)) - _block_middles(G, block)).abs().amax().item()


def _halves(x: Tensor, h: int) -> tuple[Tensor, Tensor]:
    """[..., C, D] -> the upper and lower half of each 2h-row block, [..., C/2h, h, D] each (views)."""
    return x.unflatten(-2, (x.shape[-2] // (2 * h), 2, h)).unbind(-3)


def _quadrant(A: Tensor, h: int) -> Tensor:
    """The lower-left h x h quadrants of A's 2h x 2h diagonal blocks: [..., C, C] -> [..., C/2h, h, h] (a view)."""
    nb = A.shape[-1] // (2 * h)
    blocks = A.unflatten(-2, (nb, 2, h)).unflatten(-1, (nb, 2, h))  # [..., nb, 2, h, nb, 2, h]
    return blocks.diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :].movedim(-1, -3)


def _diagonal_blocks(A: Tensor, b: int) -> Tensor:
    """A's b x b diagonal blocks: [..., C, C] -> [..., C/b, b, b] (a view; A itself when b == C)."""
    nb = A.shape[-1] // b
    if nb == 1:
        return A.unsqueeze(-3)
    return A.unflatten(-2, (nb, b)).unflatten(-1, (nb, b)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _blocks(x: Tensor, b: int) -> Tensor:
    """[..., C, D] -> [..., C/b, b, D] (a view)."""
    return x.unflatten(-2, (x.shape[-2] // b, b))


def _intra_chunk(q: Tensor, k: Tensor, decays: _Decays) -> tuple[Tensor, Tensor]:
    """A_qk (j <= i) and P (j < i), both [..., C, C]: diagonal blocks factored, then the levels' quadrants."""
    C, b = q.shape[-2], decays.block
    if b == C:  # one block: the whole matrices, no zero fill
        k_col = k * decays.col_factor
        A_qk = torch.matmul(q * decays.row_factor, k_col.transpose(-1, -2)).tril_()
        P = torch.matmul(k * decays.row_factor, k_col.transpose(-1, -2)).tril_(-1)
        return A_qk, P
    A_qk = q.new_zeros(*q.shape[:-1], C)
    P = torch.zeros_like(A_qk)
    if b == 1:
        A_qk.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    else:
        k_col = _blocks(k * decays.col_factor, b).transpose(-1, -2)
        _diagonal_blocks(A_qk, b).copy_(torch.matmul(_blocks(q * decays.row_factor, b), k_col).tril_())
        _diagonal_blocks(P, b).copy_(torch.matmul(_blocks(k * decays.row_factor, b), k_col).tril_(-1))
    for h, lo_decay, up_decay in decays.levels:
        (_, q_lo), (k_up, k_lo) = _halves(q, h), _halves(k, h)
        qk, kk = torch.einsum("...ik,...jk->...ij", torch.stack([q_lo, k_lo]) * lo_decay, k_up * up_decay)
        _quadrant(A_qk, h).copy_(qk)
        _quadrant(P, h).copy_(kk)
    return A_qk, P


def _decayed_rows(A: Tensor, X: Tensor, decays: _Decays) -> Tensor:
    """Y_i = sum_{j <= i} A_ij X_j D_ij for lower-triangular A [..., C, C] and X [..., C, K] (broadcast)."""
    b = decays.block
    if b == 1:
        Y = A.diagonal(dim1=-2, dim2=-1)[..., None] * X
    else:
        in_block = _apply(_diagonal_blocks(A, b), _blocks(X * decays.col_factor, b))
        Y = in_block.flatten(-3, -2).mul_(decays.row_factor)
    for h, lo_decay, up_decay in decays.levels:
        X_up = _halves(X, h)[0]
        _halves(Y, h)[1].addcmul_(lo_decay, _apply(_quadrant(A, h), X_up * up_decay))
    return Y


def _decayed_cols(A: Tensor, Z: Tensor, decays: _Decays) -> Tensor:
    """Y_j = sum_{i >= j} A_ij Z_i D_ij for lower-triangular A [..., C, C] and Z [..., C, K] (broadcast)."""
    b = decays.block
    if b == 1:
        Y = A.diagonal(dim1=-2, dim2=-1)[..., None] * Z
    else:
        in_block = _apply(_diagonal_blocks(A, b).transpose(-1, -2), _blocks(Z * decays.row_factor, b))
        Y = in_block.flatten(-3, -2).mul_(decays.col_factor)
    for h, lo_decay, up_decay in decays.levels:
        Z_lo = _halves(Z, h)[1]
        _halves(Y, h)[0].addcmul_(up_decay, _apply(_quadrant(A, h).transpose(-1, -2), Z_lo * lo_decay))
    return Y


def _apply(A: Tensor, X: Tensor) -> Tensor:
    """A @ X for [..., h, h] and [..., h, K], broadcasting. einsum, not matmul: matmul copies a broadcast operand
    out to full size; for h <= 2 multiply-adds, as batched matmuls of 2 x 2 matrices run far below a column's speed."""
    if A.shape[-1] <= 2:
        out = A[..., :, :1] * X[..., :1, :]
        for j in range(1, A.shape[-1]):
            out.addcmul_(A[..., :, j : j + 1], X[..., j : j + 1, :])
        return out
    return torch.einsum("...ij,...jk->...ik", A, X)
