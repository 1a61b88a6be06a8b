"""Feed-forward blocks: a dense gated FFN, and a sigmoid-routed MoE with a balancing bias (DeepSeek-V3 / Kimi Linear
/ Kimi K3).

    MoE: x [B, T, d] -> [B, T, d] = shared(x) + sum over the k chosen of n routed experts of gate_e * expert_e(x)
    latent MoE (latent_dim = r): shared(x) + latent_up(RMSNorm_r(sum_e gate_e * expert_e(latent_down(x))))

Every FFN (the dense one, the shared and the routed experts) is w_down(act(w_gate x, w_up x)) with act either
SwiGLU's silu(g) * u (the default) or Kimi K3's SiTU-GLU (activation="situ"; situ.py: formula, derivatives, why).

Latent MoE (Kimi K3): the routed experts run at width r < d. latent_down [r, d] maps each token into the latent
space, the k chosen experts (input and output width r) are summed there with their gate weights, the sum is
RMS-normalised (eps: the model's norm_eps) and latent_up [d, r] maps it back; the router and the shared experts
read the full-width x. An expert then costs 3 r ffn multiply-adds instead of 3 d ffn, for 2 d r per token more in
the two projections (flops.py: moe_macs). Upstream, KimiK3MoE (routed_expert_down_proj / routed_expert_norm /
routed_expert_up_proj there):
https://github.com/NVIDIA-NeMo/Automodel/blob/00ef9ca241e8b06fb7f59eb70b1cad1cc5c357bb/nemo_automodel/components/models/kimi_k3/model.py

Routing (DeepSeek-V3, arXiv 2412.19437, section 2.1.2): scores s = sigmoid(router(x)), the router's matmul and the
sigmoid in fp32 even under a bf16 autocast (as Kimi K3's KimiK3Gate: a bf16 matmul rounds logits to ~3 digits,
enough to reorder near-tied experts); the top-k experts are chosen on s + bias; the gate weights are the UNBIASED
scores of the chosen k, renormalised to sum 1 (divided by their sum + 1e-20, as K3 does, so that k scores that
all underflow to 0 give weights 0, not NaN) and multiplied by routed_scaling_factor. The bias only steers the
choice, so balancing never changes what a chosen expert's output is weighted by.

The bias `expert_bias` [n] is a persistent buffer (it travels in state_dict) and changes only in training-mode
forward passes:
- "quantile_balancing" (J. Su, "MoE World Tour 6: Optimal Allocation", Feb 2026): routing is an assignment LP
  with capacity kN/n per expert; the dual variable of an expert's capacity constraint is its bias, so the bias
  is SET each step from the current tokens rather than nudged, with no hyperparameter. Per training forward:
    1. cutoff_i = the (k+1)-th largest of s_i + b            (b: the bias this pass routed with)
    2. r_ij = cutoff_i - s_ij      (the bias expert j needs to be in token i's top-k, others' biases fixed: exact
                                    if j is in it now; for the other experts the true need is higher by the gap
                                    g_i between the k-th and (k+1)-th largest)
       Tie-break: for the (k+1)-th choice itself r_ij would be exactly its old bias b_j, a block of equal values
       the quantile cannot split; that entry uses its true need, b_j + g_i, instead.
    3. b_j = midpoint of the m-th and (m+1)-th smallest r_.j, m = round(N k / n), so that m tokens have r_ij < b_j
       (the (k/n)-quantile of Su's construction; rare exact fp ties in r aside)
    4. b <- b - mean(b)                                       (top-k is shift invariant; keeps b near 0)
  The new b is used from the next forward pass on. It is approximate in two ways: each expert's update holds the
  others' biases fixed (one Jacobi step of the dual problem, not its optimum), and each batch is routed with the
  previous batch's bias, so that batch's sampling noise, and a router moving faster than its logits spread over
  tokens (early training), leave the loads uneven. Measured: docs/decisions/moe-routing.md.
- "aux_free_bias" (DeepSeek-V3): b_e <- b_e + rate * sign(mean_load - load_e) after each training forward.
- "none": the bias stays zero.

Data-parallel training: when `moe.process_group` names a group of more than one rank (the run's data-parallel
group, handed over by the parallelize function from ParallelDims), a training-mode pass balances over the GLOBAL
batch. Each rank's candidates for step 3 (its m+1 smallest r per expert, m from the global token count: the global
m+1 smallest are among them, so the quantile is exactly the one over all ranks' r) go, expert block by expert
block, to the rank that takes that block (one all-to-all), which computes its experts' quantiles; one all-gather
of the biases then gives every rank the same bias (global_quantile_bias). The load counts are summed
over ranks, so aux_free_bias steps on the global load and the diagnostics describe the global batch.
- Quantile Balancing needs the same number of tokens on every rank (k3train's loaders give every rank B x T); a
  mismatch is refused on every rank, naming the counts.
- Every rank must run the same training-mode passes: each makes, per MoE layer, one collective for the loads and,
  under Quantile Balancing, two more for r (the all-to-all and the all-gather).
- DDP's buffer sync before each forward (broadcast_buffers; forward_sync_buffers from torch 2.13) copies a bias
  every rank already has: turning it off skips that broadcast.
- What differs from one big batch: the quantile is over the tokens of ONE forward pass, so gradient-accumulated
  micro-batches are separate quantiles (each sets the bias the next one routes with); and the router matmul over a
  rank's N tokens may round differently from one over W*N, so scores, r and the bias can differ in their last bits
  from a one-process run of the same global batch, which flips a token's choice only at a near tie. Given the same
  scores, the 2-rank bias is bitwise the 1-rank one.
Eval-mode passes (validation, generation) never touch the bias or the diagnostics, and are collective-free: they
may run on one rank alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3train.models.k3.situ import (
    SiTUGLU,
    check_activation,
    situ_glu,
    situ_glu_forward,
    situ_glu_grads_from_parts,
    situ_glu_parts,
    situ_glu_value,
)
from k3train.models.norm import RMSNorm
from k3train.runtime.distributed import chunk_sizes

BALANCING = ("quantile_balancing", "aux_free_bias", "none")
EXPERT_IMPLEMENTATIONS = ("auto", "loop", "grouped_mm")
# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); k3train supports torch >= 2.9.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_all_to_all_single = dist.all_to_all_single  # module attributes, so tests can count what they carry


def _situ_betas(activation: str, beta: float, linear_beta: float) -> tuple[float, float] | None:
    """What GroupedSwiGLU takes as its activation: None for SwiGLU, (beta, linear_beta) for SiTU-GLU."""
    return None if activation == "swiglu" else (float(beta), float(linear_beta))


class SwiGLU(nn.Module):
    """x [..., d] -> [..., d]: w_down(act(w_gate x, w_up x)), act = silu(g) * u (activation="swiglu", the default)
    or SiTU-GLU (activation="situ": situ.py, computed in fp32, cast back to the projections' dtype). The dense FFN
    and the shared expert(s)."""

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        activation: str = "swiglu",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
    ) -> None:
        super().__init__()
        check_activation(activation, situ_beta, situ_linear_beta)
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta
        self.w_gate = nn.Linear(d_model, ffn_dim, bias=False)
        self.w_up = nn.Linear(d_model, ffn_dim, bias=False)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.w_down(SiTUGLU.apply(self.w_gate(x), self.w_up(x), self.situ_beta, self.situ_linear_beta))

    def extra_repr(self) -> str:  # SwiGLU's repr as before; SiTU-GLU says so
        if self.activation == "swiglu":
            return ""
        return f"activation=situ, situ_beta={self.situ_beta}, situ_linear_beta={self.situ_linear_beta}"


class RoutedExperts(nn.Module):
    """E gated experts (SwiGLU or SiTU-GLU, as SwiGLU's `activation`) as stacked weights [E, out, in] (Muon treats
    each expert as its own matrix). d_model is the experts' input and output width: the latent width r in a latent
    MoE.

    implementation: how each expert's matmuls run (GroupedSwiGLU): "loop", one torch.mm per expert over host-side row
    counts (the CPU's fastest: docs/decisions/moe-experts.md); "grouped_mm", torch's grouped GEMM over device-side
    offsets, with no host sync (F.grouped_mm: bf16 on CUDA is its fast path; widths multiples of 8); "auto",
    grouped_mm when the matmuls run in bf16 on CUDA and the widths allow it, loop otherwise."""

    def __init__(
        self,
        n_experts: int,
        d_model: int,
        ffn_dim: int,
        activation: str = "swiglu",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
        implementation: str = "auto",
    ) -> None:
        super().__init__()
        check_activation(activation, situ_beta, situ_linear_beta)
        if implementation not in EXPERT_IMPLEMENTATIONS:
            raise ValueError(f"expert_implementation={implementation!r} must be one of {EXPERT_IMPLEMENTATIONS}")
        # grouped_mm wants every row 16-byte aligned: 8 bf16 values (4 fp32)
        self.grouped_mm_fits = d_model % 8 == 0 and ffn_dim % 8 == 0
        if implementation == "grouped_mm" and not self.grouped_mm_fits:
            raise ValueError(
                f"expert_implementation=grouped_mm needs the experts' widths to be multiples of 8 (torch's grouped "
                f"GEMM aligns rows to 16 bytes); these are {d_model} and {ffn_dim}: use loop or auto"
            )
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta
        self.implementation = implementation
        self.w_gate = nn.Parameter(torch.empty(n_experts, ffn_dim, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, ffn_dim, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, ffn_dim))
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=0.02)  # the model re-initialises with its init_std

    def forward(
        self, x_sorted: torch.Tensor, counts: torch.Tensor, row_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x_sorted [S, d]: token slots grouped by expert, counts[e] rows for expert e (an integer tensor [E]) ->
        [S, d], each row times row_scale [S] when given (the slots' gate weights)."""
        situ = _situ_betas(self.activation, self.situ_beta, self.situ_linear_beta)
        rows = counts if self.uses_grouped_mm(x_sorted) else counts.tolist()  # tolist: the loop's one host sync
        return GroupedSwiGLU.apply(x_sorted, self.w_gate, self.w_up, self.w_down, rows, row_scale, situ)

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        if self.implementation != "auto":
            return self.implementation == "grouped_mm"
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return device == "cuda" and dtype == torch.bfloat16 and self.grouped_mm_fits

    def extra_repr(self) -> str:  # SwiGLU's repr as before; SiTU-GLU and a chosen implementation say so
        parts = [] if self.implementation == "auto" else [f"implementation={self.implementation}"]
        if self.activation != "swiglu":
            parts.append(f"activation=situ, situ_beta={self.situ_beta}, situ_linear_beta={self.situ_linear_beta}")
        return ", ".join(parts)


class GroupedSwiGLU(torch.autograd.Function):
    """Expert e's gated FFN, w_down[e](act(w_gate[e] x, w_up[e] x)), on its contiguous rows of x, for every e; with
    row_scale [S], each row's output times its scale (applied to the [S, ffn] hidden before w_down: the same product,
    but a pass over rows ffn wide instead of d wide, forward and backward). act: silu(g) * u when `situ` is None
    (SwiGLU), SiTU-GLU with situ = (beta, linear_beta) otherwise (situ.py: computed in fp32, cast back to the
    matmuls' dtype; its analytic derivative in the backward, from the saved gate and up). The gate weight scales
    the hidden for both; K3's own code applies it to the expert's output after w_down, the same product in exact
    arithmetic, rounded in a different place under bf16.

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


@contextlib.contextmanager
def replayed_routes(ffn: nn.Module, routes: dict) -> Iterator[None]:
    """Within: a MoE `ffn` records the experts it chooses in `routes`, or, once they are there, routes by them and
    leaves its bias alone (a checkpointed Block's recompute). Any other FFN: nothing."""
    if not isinstance(ffn, MoE):
        yield
        return
    ffn.routes = routes
    try:
        yield
    finally:
        ffn.routes = None


def _expert_rows(counts: list[int]):
    """(expert, slice of its rows) for every expert with at least one row."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
        start += n


class MoE(nn.Module):
    """x [B, T, d] -> [B, T, d]: shared expert(s) plus k of n routed experts per token.

    activation / situ_beta / situ_linear_beta: every expert's FFN, shared and routed (SwiGLU's arguments).
    latent_dim: None, the routed experts at width d (Kimi Linear); r, a latent MoE (module docstring), with
    `latent_down` (Linear d -> r), `latent_norm` (RMSNorm over r, eps norm_eps) and `latent_up` (Linear r -> d).
    expert_implementation: RoutedExperts' `implementation` ("auto", "loop", "grouped_mm").
    """

    def __init__(
        self,
        d_model: int,
        n_routed_experts: int,
        experts_per_token: int,
        expert_ffn_dim: int,
        n_shared_experts: int = 1,
        routed_scaling_factor: float = 1.0,
        balancing: str = "quantile_balancing",
        aux_free_bias_rate: float = 1e-3,
        activation: str = "swiglu",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
        latent_dim: int | None = None,
        norm_eps: float = 1e-6,
        expert_implementation: str = "auto",
    ) -> None:
        super().__init__()
        check_activation(activation, situ_beta, situ_linear_beta)
        if latent_dim is not None and not (isinstance(latent_dim, int) and latent_dim > 0):
            raise ValueError(f"latent_dim={latent_dim!r} must be a positive integer (or None: experts at d_model)")
        if balancing not in BALANCING:
            raise ValueError(f"balancing={balancing!r} must be one of {BALANCING}")
        if not 0 < experts_per_token < n_routed_experts:
            raise ValueError(f"experts_per_token={experts_per_token} must be in [1, n_routed_experts)")
        self.n_experts, self.k = n_routed_experts, experts_per_token
        self.routed_scaling_factor = routed_scaling_factor
        self.balancing, self.aux_free_bias_rate = balancing, aux_free_bias_rate

        act = dict(activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
        self.latent_dim = latent_dim
        self.router = nn.Linear(d_model, n_routed_experts, bias=False)  # weight [n, d]
        expert_dim = d_model if latent_dim is None else latent_dim
        self.experts = RoutedExperts(
            n_routed_experts, expert_dim, expert_ffn_dim, **act, implementation=expert_implementation
        )
        self.shared = SwiGLU(d_model, n_shared_experts * expert_ffn_dim, **act) if n_shared_experts > 0 else None
        # Built after the router, experts and shared experts, so that without them the RNG draws are today's.
        self.latent_down = nn.Linear(d_model, latent_dim, bias=False) if latent_dim is not None else None
        self.latent_norm = RMSNorm(latent_dim, eps=norm_eps) if latent_dim is not None else None
        self.latent_up = nn.Linear(latent_dim, d_model, bias=False) if latent_dim is not None else None
        self.register_buffer("expert_bias", torch.zeros(n_routed_experts))  # persistent: in state_dict
        # Diagnostics of the last training-mode pass: tokens per expert [n]. Not state: not in state_dict.
        self.last_load: torch.Tensor | None = None
        # The ranks whose tokens are balanced together (set by the parallelize function); None: this process's alone.
        self.process_group: dist.ProcessGroup | None = None
        self.checkpoint_experts = False  # recompute the routed experts in the backward (selective checkpointing)
        # Expert parallelism (expert_parallel.py): the group whose ranks each hold 1/ep of the routed experts, and
        # the first of this rank's; None: every expert here.
        self.ep_group: dist.ProcessGroup | None = None
        self.first_local_expert = 0
        # Under a checkpointed Block (replayed_routes): {} while its forward runs, then {"experts": ...} for the
        # recompute to route the same way. None: no checkpointed Block around this pass.
        self.routes: dict | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x_flat = x.reshape(B * T, d)
        weights, experts = self.route(self.router_logits(x_flat))  # [N, k], [N, k]
        if self.checkpoint_experts and torch.is_grad_enabled():
            out = checkpoint(self.routed, x_flat, weights, experts, use_reentrant=False)
        else:
            out = self.routed(x_flat, weights, experts)
        if self.shared is not None:
            out = out + self.shared(x_flat)
        return out.view(B, T, d)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> the routed experts' weighted sum [N, d], through the latent width in a latent MoE."""
        if self.latent_dim is None:
            return self.dispatch(x, weights, experts)
        y = self.dispatch(self.latent_down(x), weights, experts)  # [N, r], in the matmuls' dtype
        # normalised in the norm weight's dtype (fp32 under autocast: the variance of a bf16 sum in fp32, and
        # nn.RMSNorm's fused kernels want input and weight alike), then latent_up back in the autocast dtype
        return self.latent_up(self.latent_norm(y.to(self.latent_norm.weight.dtype)))

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> router logits [N, n] in fp32 (float64 for float64 x), whatever autocast is on: the router
        matmul is K3's one fp32 matmul of the FFN (module docstring). Without autocast and in fp32 it is exactly
        self.router(x)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.router.weight.to(dtype))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, n] -> gate weights [N, k] fp32 (float64 for float64 logits) and chosen experts [N, k]; in
        training, updates the bias."""
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        replay = self.routes is not None and "experts" in self.routes  # a checkpointed Block's recompute
        if replay:
            experts = self.routes["experts"]  # the forward's choice: the bias has moved on since
        else:
            # the bias only steers the choice; detached: indices carry no gradient, and a graph node here would be one
            # the replay lacks (checkpointing counts the tensors each saves)
            experts = torch.topk((scores + self.expert_bias).detach(), self.k, dim=-1).indices
            if self.routes is not None:
                self.routes["experts"] = experts
        weights = scores.gather(-1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        if self.training and not replay:
            self._after_training_route(scores.detach(), experts)
        return weights, experts

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, w], weights/experts [N, k] -> sum_j weights[:, j] * expert_{experts[:, j]}(x)  [N, w] (w: d, or
        the latent width r, which x is then already in).

        The N*k token slots are sorted by expert so that each expert runs once on a contiguous slice. With the
        experts spread over ranks (ep_group), the slots travel to them and back (expert_parallel.py).
        """
        if self.ep_group is not None:
            from k3train.models.k3.expert_parallel import dispatch_across_ranks  # it imports this module

            return dispatch_across_ranks(self, x, weights, experts)
        N, d = x.shape
        flat_experts = experts.reshape(-1)  # [N*k]
        order = torch.argsort(flat_experts, stable=True)
        token_of_slot = order // self.k  # [N*k]: which token each sorted slot belongs to
        counts = expert_counts(flat_experts, self.n_experts)
        # index_select, not x[token_of_slot]: its backward is an index_add rather than indexing's accumulating
        # index_put (why: docs/decisions/moe-experts.md). y is in the matmuls' dtype (bf16 under autocast), each
        # slot already weighted by its gate weight.
        y = self.experts(x.index_select(0, token_of_slot), counts, weights.reshape(-1)[order])  # [N*k, d]
        return y.new_zeros(N, d).index_add_(0, token_of_slot, y)

    @torch.no_grad()
    def _after_training_route(self, scores: torch.Tensor, experts: torch.Tensor) -> None:
        group = self._balancing_group()
        load = expert_counts(experts.reshape(-1), self.n_experts).float()
        if group is not None:
            load, tokens_per_rank = global_load(load, scores.shape[0], group)
        self.last_load = load
        if self.balancing == "quantile_balancing":
            required = required_bias(scores, self.expert_bias, self.k)
            if group is None:
                bias = quantile_bias(required, self.k)
            else:
                check_equal_tokens(tokens_per_rank)
                bias = global_quantile_bias(required, self.k, group)
            self.expert_bias.copy_(bias - bias.mean())
        elif self.balancing == "aux_free_bias":
            self.expert_bias.add_(self.aux_free_bias_rate * torch.sign(load.mean() - load))

    def _balancing_group(self) -> dist.ProcessGroup | None:
        """The group whose tokens are balanced together, or None to balance over this process's tokens alone."""
        group = self.process_group
        return group if group is not None and dist.get_world_size(group) > 1 else None

    def diagnostics(self) -> dict[str, float]:
        """Router health of the last training-mode pass: max/min expert load over the mean, bias range, and the
        entropy of the load distribution over log(n) (1.0 = perfectly even). Empty before the first pass."""
        if self.last_load is None:
            return {}
        load = self.last_load
        share = load / load.sum()
        entropy = -(share * share.clamp_min(1e-12).log()).sum() / math.log(self.n_experts)
        return {
            "load_max": (load.max() / load.mean()).item(),
            "load_min": (load.min() / load.mean()).item(),
            "bias_range": (self.expert_bias.max() - self.expert_bias.min()).item(),
            "routing_entropy": entropy.item(),
        }


def reference_moe_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward, readable and slow: x [B, T, d] -> [B, T, d] through plain autograd, one routed expert at a time
    over the tokens that chose it, SiTU-GLU through situ.situ_glu. The ground truth the tests hold the fast path
    (sorted dispatch, GroupedSwiGLU's written backward, the RMSNorm function) to. It routes with the current bias
    and never changes it or the diagnostics, as an eval pass; it computes in x's dtype (the router in fp32 or
    wider), with no autocast of its own."""
    B, T, d = x.shape
    x_flat = x.reshape(B * T, d)
    router_dtype = torch.promote_types(x.dtype, torch.float32)
    scores = torch.sigmoid(x_flat.to(router_dtype) @ moe.router.weight.to(router_dtype).T)  # [N, n]
    chosen = torch.topk(scores + moe.expert_bias, moe.k, dim=-1).indices  # [N, k]
    weights = scores.gather(-1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * moe.routed_scaling_factor

    h = x_flat if moe.latent_dim is None else x_flat @ moe.latent_down.weight.T  # [N, w]
    ex = moe.experts
    y = torch.zeros_like(h)
    for e in range(moe.n_experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)  # the tokens that chose e, and in which of their k slots
        if token.numel() == 0:
            continue
        out = _reference_ffn(h[token], ex.w_gate[e], ex.w_up[e], ex.w_down[e], ex)
        y = y.index_add(0, token, out * weights[token, slot, None].to(h.dtype))
    if moe.latent_dim is not None:
        norm = moe.latent_norm
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + norm.eps) * norm.weight
        y = y @ moe.latent_up.weight.T
    if moe.shared is not None:
        sh = moe.shared
        y = y + _reference_ffn(x_flat, sh.w_gate.weight, sh.w_up.weight, sh.w_down.weight, sh)
    return y.view(B, T, d)


def _reference_ffn(x, w_gate, w_up, w_down, ffn: SwiGLU | RoutedExperts) -> torch.Tensor:
    """x [N, d], w_gate / w_up [f, d], w_down [d, f] -> [N, d]: w_down act(w_gate x, w_up x), act ffn's."""
    g, u = x @ w_gate.T, x @ w_up.T
    hidden = F.silu(g) * u if ffn.activation == "swiglu" else situ_glu(g, u, ffn.situ_beta, ffn.situ_linear_beta)
    return hidden @ w_down.T


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """experts [S] (indices) -> how many slots chose each expert [n_experts] (int64). A scatter-add, not bincount: on
    CUDA bincount reads its input's maximum back to the host to size its output, a sync every MoE layer."""
    return torch.zeros(n_experts, dtype=torch.int64, device=experts.device).index_add_(
        0, experts, torch.ones_like(experts, dtype=torch.int64)
    )


def required_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """scores [N, n], bias [n] -> r [N, n]: the bias expert j needs to be in token i's top-k (steps 1-2)."""
    top = torch.topk(scores + bias, k + 1, dim=-1)  # [N, k+1], descending
    required = top.values[:, -1:] - scores  # cutoff - s
    # Tie-break: for the (k+1)-th choice itself, cutoff - s is exactly its own old bias, a block of equal values
    # the quantile cannot split. Its real need is the k-th largest - s: the old bias plus the token's gap.
    runner_up = top.indices[:, -1:]  # [N, 1]
    return required.scatter_(1, runner_up, top.values[:, -2:-1] - scores.gather(1, runner_up))


def quantile_rank(n_tokens: int, k: int, n_experts: int) -> int:
    """m = round(N k / n), kept in [1, N - 1] so that the m-th and (m+1)-th smallest exist (step 3)."""
    return min(max(round(n_tokens * k / n_experts), 1), n_tokens - 1)


def quantile_bias(
    required: torch.Tensor, k: int, n_tokens: int | None = None, n_experts: int | None = None
) -> torch.Tensor:
    """r [R, n] -> per expert the midpoint of the m-th and (m+1)-th smallest r, m = quantile_rank(N) (step 3).
    N is R unless given: the rows may be only the candidates for the m+1 smallest of N tokens; n_experts is n unless
    given: the columns may be a block of the experts."""
    N, n = required.shape
    m = quantile_rank(N if n_tokens is None else n_tokens, k, n if n_experts is None else n_experts)
    lowest = torch.topk(required, m + 1, dim=0, largest=False).values  # [m+1, n], ascending
    return 0.5 * (lowest[m - 1] + lowest[m])


# --- data-parallel balancing: every rank ends with the same bias, the one of all ranks' tokens together ----------


def all_gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[R, ...] from each of W ranks (the same R) -> [W*R, ...], rank 0's rows first, the same on every rank."""
    out = local.new_empty(dist.get_world_size(group) * local.shape[0], *local.shape[1:])
    _all_gather_single(out, local.contiguous(), group=group)
    return out


def global_load(load: torch.Tensor, n_tokens: int, group: dist.ProcessGroup) -> tuple[torch.Tensor, list[int]]:
    """This rank's tokens per expert [n] and token count -> the sum of the loads over ranks [n] and every rank's
    token count, in one collective (fp64: counts are exact integers there)."""
    local = torch.cat([load.double(), load.new_tensor([n_tokens], dtype=torch.float64)])
    per_rank = all_gather_rows(local[None], group)  # [W, n+1]
    return per_rank[:, :-1].sum(0).to(load.dtype), [int(t) for t in per_rank[:, -1].tolist()]


def check_equal_tokens(tokens_per_rank: list[int]) -> None:
    if len(set(tokens_per_rank)) > 1:
        raise ValueError(
            f"Quantile Balancing over ranks needs the same number of tokens on every rank, got {tokens_per_rank} "
            "(tokens per rank, in rank order): give every rank the same batch_size and seq_len"
        )


def global_quantile_bias(required: torch.Tensor, k: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's r [N, n] -> quantile_bias of every rank's r stacked, exactly. The global m+1 smallest of an
    expert's r are among the union of each rank's m+1 smallest, so only those travel, and each to one rank: rank j
    takes a block of the experts (torch.chunk's), receives every rank's candidates for them in one all-to-all,
    computes their quantiles, and an all-gather hands every rank every block's biases. A rank receives W x (m+1) x
    n / W values, not the W x (m+1) x n of gathering every candidate everywhere (Kimi K3 on 1,024 GPUs: 15 MB a MoE
    layer, not 15 GB); the quantile is the same values' (it depends only on the values, not their order)."""
    N, n = required.shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n_tokens = N * world
    m = quantile_rank(n_tokens, k, n)
    c = min(m + 1, N)
    candidates = torch.topk(required, c, dim=0, largest=False).values  # [c, n]
    blocks = chunk_sizes(n, world)  # experts each rank takes (torch.chunk's split)
    received = candidates.new_empty(world * c * blocks[rank])
    by_expert = candidates.t().reshape(-1)  # [n c]: each rank's block contiguous, split in elements
    _all_to_all_single(received, by_expert, [c * blocks[rank]] * world, [c * b for b in blocks], group=group)
    mine = received.view(world, blocks[rank], c).permute(0, 2, 1).reshape(world * c, blocks[rank])
    bias = quantile_bias(mine, k, n_tokens, n) if blocks[rank] else mine.new_empty(0)
    widest = blocks[0]
    padded = torch.cat([bias, bias.new_zeros(widest - blocks[rank])])
    every = all_gather_rows(padded[None], group)  # [W, widest]
    return torch.cat([every[j, : blocks[j]] for j in range(world)])
