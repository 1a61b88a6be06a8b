"""GroupedSwiGLU: every routed expert's gated FFN on its contiguous rows, forward and a hand-written backward, run
either expert by expert (torch.mm over host-side row counts) or at once (F.grouped_mm over device-side offsets).
RoutedExperts (experts.py) is the module that calls it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.models.common.situ import situ_glu_forward, situ_glu_grads_from_parts, situ_glu_parts, situ_glu_value


class GroupedSwiGLU(torch.autograd.Function):
    """Expert e's gated FFN, w_down[e](act(w_gate[e] x, w_up[e] x)), on its contiguous rows of x, for every e; with
    row_scale [S], each row's output times its scale (applied to the [S, ffn] hidden before w_down: the same product,
    but a pass over rows ffn wide instead of d wide, forward and backward). act: silu(g) * u when `situ` is None
    (SwiGLU), SiTU-GLU with situ = (beta, linear_beta) otherwise (k3train/models/common/situ.py: computed in fp32,
    cast back to the matmuls' dtype; its analytic derivative in the backward, from the saved gate and up). The gate
    weight scales the hidden for both; K3's own code applies it to the expert's output after w_down, the same
    product in exact arithmetic, rounded in a different place under bf16.

    x [S, d] grouped by expert, w_gate / w_up [E, ffn, d], w_down [E, d, ffn] -> [S, d]. `rows` says which rows are
    whose: a list of E host-side counts runs the FFN expert by expert (OneExpert: torch.mm on its rows, written into
    slices of whole outputs, so the elementwise work and its temporaries stay one expert's rows at a time); an
    integer tensor [E] of counts runs it once over all rows with F.grouped_mm (AllExperts), with no host sync. The
    same matmuls autograd would run through `w.unbind(0)` and a loop, with a hand-written backward that writes each
    expert's weight gradient into its slice of one [E, out, in] tensor, where autograd would stack E separate
    gradients (a second full copy of every expert weight) and concatenate the outputs (why:
    docs/decisions/moe-experts.md). Under autocast the matmuls run in the autocast dtype, as nn.Linear's would, and
    the scale is cast to it; gradients return in the inputs' dtypes.
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, rows, row_scale=None, situ=None):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            xs, wg, wu, wd = (t.to(dtype) for t in (x, w_gate, w_up, w_down))
            scale = None if row_scale is None else row_scale.to(dtype)[:, None]
            if isinstance(rows, torch.Tensor):
                gate, up, out = _ffn_forward(xs, wg, wu, wd, scale, situ, AllExperts(rows))
            else:
                _check_counts(rows, xs.shape[0])
                gate, up = xs.new_empty(xs.shape[0], wg.shape[1]), xs.new_empty(xs.shape[0], wu.shape[1])
                out = xs.new_empty(xs.shape[0], wd.shape[1])
                for e, r in _expert_rows(rows):
                    block_scale = None if scale is None else scale[r]
                    gate[r], up[r], out[r] = _ffn_forward(xs[r], wg, wu, wd, block_scale, situ, OneExpert(e))
        ctx.save_for_backward(xs, wg, wu, wd, gate, up, scale)
        ctx.rows, ctx.situ = rows, situ
        ctx.dtypes = (x.dtype, w_gate.dtype, w_up.dtype, w_down.dtype, None if row_scale is None else row_scale.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xs, wg, wu, wd, gate, up, scale = ctx.saved_tensors
        with torch.autocast(xs.device.type, enabled=False):
            grad_out = grad_out.to(xs.dtype)
            saved = (xs, wg, wu, wd, gate, up, scale)
            if isinstance(ctx.rows, torch.Tensor):
                grad_x, grad_wg, grad_wu, grad_wd, grad_scale = _ffn_backward(
                    grad_out, *saved, ctx.situ, AllExperts(ctx.rows)
                )
            else:
                grad_x = torch.empty_like(xs)  # every row belongs to one expert: all are written
                # empty, not zeros: every expert with rows is written whole below, the others are zeroed here
                grad_wg, grad_wu, grad_wd = torch.empty_like(wg), torch.empty_like(wu), torch.empty_like(wd)
                grad_scale = None if scale is None else torch.empty_like(scale)
                for e in (e for e, n in enumerate(ctx.rows) if n == 0):
                    grad_wg[e], grad_wu[e], grad_wd[e] = 0, 0, 0
                for e, r in _expert_rows(ctx.rows):
                    block = (xs[r], wg, wu, wd, gate[r], up[r], None if scale is None else scale[r])
                    grad_x[r], grad_wg[e], grad_wu[e], grad_wd[e], block_scale = _ffn_backward(
                        grad_out[r], *block, ctx.situ, OneExpert(e)
                    )
                    if grad_scale is not None:
                        grad_scale[r] = block_scale
        x_dtype, *w_dtypes, scale_dtype = ctx.dtypes
        grads = (grad_x.to(x_dtype), *(g.to(dt) for g, dt in zip((grad_wg, grad_wu, grad_wd), w_dtypes)))
        return (*grads, None, None if grad_scale is None else grad_scale[:, 0].to(scale_dtype), None)


class OneExpert:
    """GroupedSwiGLU's matmuls on expert e's rows: torch.mm with its matrices."""

    def __init__(self, e: int) -> None:
        self.e = e

    def rows_by_weights(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [S_e, i], w [E, i, o] -> x w[e]  [S_e, o]."""
        return x @ w[self.e]

    def weight_grad(self, grad: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """grad [S_e, o], inp [S_e, i] -> grad^T inp  [o, i]: expert e's weight gradient."""
        return grad.T @ inp

    def input_grad(self, grad_a, wa, grad_b, wb) -> torch.Tensor:
        """grad_a, grad_b [S_e, o], wa, wb [E, o, i] -> grad_a wa[e] + grad_b wb[e]  [S_e, i]."""
        return torch.addmm(grad_a @ wa[self.e], grad_b, wb[self.e])


class AllExperts:
    """GroupedSwiGLU's matmuls on all rows at once: F.grouped_mm over the counts' cumulative int32 offsets, which
    stay on the device (no host sync)."""

    def __init__(self, counts: torch.Tensor) -> None:
        self.offsets = torch.cumsum(counts, 0, dtype=torch.int32)

    def rows_by_weights(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.grouped_mm(x, w, offs=self.offsets)

    def weight_grad(self, grad: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """-> [E, o, i], zero for an expert with no rows."""
        return F.grouped_mm(grad.T, inp, offs=self.offsets)

    def input_grad(self, grad_a, wa, grad_b, wb) -> torch.Tensor:
        # one GEMM over both halves: one rounding of the sum in bf16, and twice the depth for the kernel
        return F.grouped_mm(torch.cat([grad_a, grad_b], 1), torch.cat([wa, wb], 1), offs=self.offsets)


def _ffn_forward(xs, wg, wu, wd, scale, situ, experts: OneExpert | AllExperts):
    """Rows of x -> (gate, up, out) for those rows: what GroupedSwiGLU's forward computes and keeps."""
    gate, up = experts.rows_by_weights(xs, wg.mT), experts.rows_by_weights(xs, wu.mT)
    hidden = F.silu(gate) * up if situ is None else situ_glu_forward(gate, up, *situ)
    if scale is not None:
        hidden *= scale
    return gate, up, experts.rows_by_weights(hidden, wd.mT)


def _ffn_backward(grad_out, xs, wg, wu, wd, gate, up, scale, situ, experts: OneExpert | AllExperts):
    """The gradients of _ffn_forward's out for those rows: (x, w_gate, w_up, w_down, scale [rows, 1] or None)."""
    if situ is None:
        act = F.silu(gate)
        hidden = act * up
    else:
        parts = situ_glu_parts(gate, up, *situ)  # recomputed: the forward saved only gate and up
        hidden = situ_glu_value(parts, *situ, gate.dtype)
    grad_h = experts.rows_by_weights(grad_out, wd)  # d/d(hidden * scale)
    grad_scale = None
    if scale is not None:
        grad_scale = torch.sum(grad_h * hidden, dim=-1, keepdim=True)
        hidden *= scale
        grad_h *= scale
    grad_wd = experts.weight_grad(grad_out, hidden)
    if situ is None:
        grad_a = torch.ops.aten.silu_backward(grad_h * up, gate)  # the kernel autograd's silu would use
        grad_b = grad_h * act
    else:
        grad_a, grad_b = situ_glu_grads_from_parts(grad_h, parts, *situ, gate.dtype)  # fp32 inside
    grad_wg, grad_wu = experts.weight_grad(grad_a, xs), experts.weight_grad(grad_b, xs)
    return experts.input_grad(grad_a, wg, grad_b, wu), grad_wg, grad_wu, grad_wd, grad_scale


def _check_counts(counts: list[int], n_rows: int) -> None:
    if sum(counts) != n_rows:
        raise ValueError(f"expert row counts sum to {sum(counts)}, but x has {n_rows} rows")


def _expert_rows(counts: list[int]):
    """(expert, slice of its rows) for every expert with at least one row."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
        start += n
