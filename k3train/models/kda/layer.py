"""The Kimi Delta Attention layer (Kimi Linear, arXiv 2510.26692; FLA's layer): [B, T, d] -> [B, T, d].

https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/layers/kda.py
Kimi K3's form of it (a full-rank output gate without bias, the sigmoid gate's lower bound from the config, FLA's
in-kernel q/k L2 norm) as NeMo AutoModel implements the released model:
https://github.com/NVIDIA-NeMo/Automodel/blob/00ef9ca241e8b06fb7f59eb70b1cad1cc5c357bb/nemo_automodel/components/models/kimi_k3/model.py
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from k3train.models.common.context_parallel import ContextParallel
from k3train.models.common.documents import Documents
from k3train.models.common.fla import fla_runs_on
from k3train.models.common.health import WindowStats
from k3train.models.common.init import Rule, Uniform, conv_default
from k3train.models.common.norm import RMSNorm, l2_normalize_eps
from k3train.models.kda.chunk import chunk_kda
from k3train.models.kda.context_parallel import IMPLEMENTATIONS as CONTEXT_PARALLEL_IMPLEMENTATIONS
from k3train.models.kda.context_parallel import context_parallel_chunk_kda
from k3train.models.kda.fla import (
    FLA_QK_L2NORM_EPS,
    fla_chunk_kda,
    fla_chunk_kda_from_projections,
    fla_fused_recurrent_kda,
    fla_rms_norm_sigmoid_gated,
    fla_short_conv_silu,
    require_fla,
)
from k3train.models.kda.naive import compute_dtype, naive_recurrent_kda
from k3train.models.kda.state import KDAState
from k3train.models.layout import ParamLayout

IMPLEMENTATIONS = ("chunk", "recurrent", "fla")
GATES = ("softplus", "sigmoid")
OUTPUT_GATES = ("low_rank", "full_rank")
# The sigmoid ("safe") gate's default lower bound: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) lies in
# (lower_bound, 0), FLA's `lower_bound` (its default too); the layer's `gate_lower_bound` sets it:
# https://github.com/fla-org/flash-linear-attention/blob/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/fla/ops/kda/gate.py
SIGMOID_GATE_LOWER_BOUND = -5.0
CONVS = ("q_conv", "k_conv", "v_conv")


def _dt_bias(log_dt: Tensor) -> Tensor:
    """dt_bias from log dt: softplus^-1(dt), dt kept >= 1e-4."""
    dt = log_dt.exp().clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class KimiDeltaAttention(nn.Module):
    """Delta-rule linear attention with per-channel forget gates, for the KDA layers of the hybrid.

    q, k, v: Linear -> depthwise causal conv -> SiLU; q, k L2-normalised per head as FLA's kernel does it,
    x / sqrt(sum x^2 + qk_norm_eps) (l2_normalize_eps). Forget gate g [B, T, HV, K] (log decay <= 0) from a
    low-rank projection: -exp(A_log) softplus(f + dt_bias), or with gate="sigmoid" gate_lower_bound *
    sigmoid(exp(A_log) (f + dt_bias)) in (gate_lower_bound, 0); beta = sigmoid(b_proj x). The recurrence runs in
    `implementation` ("chunk": pure PyTorch, the CPU default; "recurrent": the per-step reference; "fla": FLA's
    Triton kernel, the steps around it fused as below). Output: per-head RMSNorm times sigmoid(gate logits), then
    o_proj; the logits from output_gate="low_rank" (Kimi Linear: g_b_proj(g_a_proj x), rank head_dim; g_b_proj has
    a bias unless output_gate_bias=False: FLA's layer has one, Kimi Linear as released and transformers'
    kimi_linear have none) or "full_rank" (Kimi K3: g_proj x, [d_model -> HV K], no bias, split per value head for
    Muon as v_proj is). n_value_heads > n_heads gives grouped value attention (each q/k head serves
    n_value_heads // n_heads value heads); V = K = head_dim.

    implementation="fla" on CUDA (or under Triton's interpreter) computes the same function with forward's
    elementwise steps in FLA's kernels (_forward_fla; measured differences: docs/decisions/kda-layer.md): the conv +
    SiLU in FLA's causal_conv1d on the same Conv1d weights (documents as cu_seqlens); the forget gate, beta's
    sigmoid and the q/k L2 norm inside chunk_kda (its in-kernel gate with A_log, dt_bias and gate_lower_bound, plus
    safe_gate for a sigmoid gate bounded within [-5, 0); its l2norm only when qk_norm_eps is its fixed 1e-6); the
    RMSNorm times sigmoid(logits) in FLA's fused gated RMSNorm on o_norm's weight. Left to k3train, and why: the
    projections (matmuls, nothing to fuse them with); the q/k norm under another qk_norm_eps (FLA's eps cannot be
    set); forward_cached's conv, norm and gate (decoding's state keeps k3train's conv tail; only the output norm
    is fused there); context parallelism, whose conv reads the previous rank's tail (only its recurrence's two
    passes run in FLA's chunk_kda, k3train/models/kda/context_parallel.py). Under autocast FLA's conv writes q, k, v
    in the autocast dtype, as FLA's layer has them, where k3train's conv promotes them to fp32 with its fp32 weight.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        conv_size: int = 4,
        implementation: str = "chunk",
        chunk_size: int = 64,
        gate: str = "softplus",
        norm_eps: float = 1e-6,
        n_value_heads: int | None = None,
        output_gate: str = "low_rank",
        gate_lower_bound: float = SIGMOID_GATE_LOWER_BOUND,
        qk_norm_eps: float = 1e-6,
        output_gate_bias: bool | None = None,  # None: True for low_rank, False for full_rank
    ) -> None:
        super().__init__()
        n_value_heads = n_heads if n_value_heads is None else n_value_heads
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"KDA implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
        if gate not in GATES:
            raise ValueError(f"KDA gate must be one of {GATES}; got {gate!r}")
        if output_gate not in OUTPUT_GATES:
            raise ValueError(f"KDA output_gate must be one of {OUTPUT_GATES}; got {output_gate!r}")
        if output_gate_bias is None:
            output_gate_bias = output_gate == "low_rank"
        if output_gate == "full_rank" and output_gate_bias:
            raise ValueError("KDA output_gate='full_rank' has no bias: output_gate_bias must be False or None")
        if not gate_lower_bound < 0:
            raise ValueError(f"KDA gate_lower_bound must be < 0 (a log decay); got {gate_lower_bound}")
        if not qk_norm_eps > 0:
            raise ValueError(f"KDA qk_norm_eps must be > 0; got {qk_norm_eps}")
        if n_value_heads % n_heads:
            raise ValueError(f"n_value_heads ({n_value_heads}) must be a multiple of n_heads ({n_heads})")
        if chunk_size < 1 or chunk_size & (chunk_size - 1):
            raise ValueError(f"KDA chunk_size must be a power of two (16, 32, 64, ...); got {chunk_size}")
        if implementation == "fla":
            require_fla()  # fail at build time, not at the first forward
        self.d_model, self.n_heads, self.n_value_heads, self.head_dim = d_model, n_heads, n_value_heads, head_dim
        self.conv_size, self.implementation, self.chunk_size, self.gate = conv_size, implementation, chunk_size, gate
        self.output_gate, self.gate_lower_bound, self.qk_norm_eps = output_gate, float(gate_lower_bound), qk_norm_eps
        self.output_gate_bias = output_gate_bias
        self._context_parallel: ContextParallel | None = None
        # The health panel (KimiK3.diagnostics): the gates' figures over the training forwards since the last read.
        # A checkpointed block's recompute turns it off for its second pass (k3train/models/k3/model.py).
        self.track_gates = True
        self.gate_stats = WindowStats()
        key_dim, value_dim = n_heads * head_dim, n_value_heads * head_dim

        self.q_proj = nn.Linear(d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        # Depthwise convs as nn.Conv1d for their weight layout [D, 1, W], init and checkpoint names (FLA's too); the
        # layer applies the weights itself (CausalConvSiLU, causal_depthwise_conv), never calling the modules.
        self.q_conv, self.k_conv, self.v_conv = (
            nn.Conv1d(dim, dim, conv_size, groups=dim, padding=conv_size - 1, bias=False)
            for dim in (key_dim, key_dim, value_dim)
        )
        self.f_a_proj = nn.Linear(d_model, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, n_value_heads * head_dim, bias=False)
        self.b_proj = nn.Linear(d_model, n_value_heads, bias=False)
        # Decay rates A in [1, 16] per head; dt_bias puts softplus(dt_bias) = dt log-uniform in [1e-3, 1e-1].
        self.A_log = nn.Parameter(torch.empty(n_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_value_heads * head_dim))
        for name, rule in self.init_rules().items():
            if "." not in name:
                rule.fill(getattr(self, name).data, None)
        if output_gate == "low_rank":
            self.g_a_proj = nn.Linear(d_model, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, value_dim, bias=output_gate_bias)
        else:
            self.g_proj = nn.Linear(d_model, value_dim, bias=False)
        self.o_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)

    def init_rules(self) -> dict[str, Rule]:
        """How this layer's own parameters start (k3train/models/common/init.py; the model draws its linear maps):
        A_log = log U(1, 16), dt_bias = softplus^-1 of a log-uniform dt in [1e-3, 1e-1], the short convs as
        nn.Conv1d starts them."""
        convs = {f"{name}.weight": conv_default(tuple(getattr(self, name).weight.shape)) for name in CONVS}
        return {
            "A_log": Uniform(1.0, 16.0, torch.log),
            "dt_bias": Uniform(math.log(1e-3), math.log(1e-1), _dt_bias),
            **convs,
        }

    def param_layouts(self) -> dict[str, ParamLayout]:
        """Muon may orthogonalise per head (k3train/models/layout.py): rows per head of q, k, v and the full-rank
        output gate (one gate logit per output channel, per value head as v_proj), columns of o."""
        rows = {"q_proj": self.n_heads, "k_proj": self.n_heads, "v_proj": self.n_value_heads}
        if self.output_gate == "full_rank":
            rows["g_proj"] = self.n_value_heads
        layouts = {f"{name}.weight": ParamLayout(head_split=(heads, 0)) for name, heads in rows.items()}
        return {**layouts, "o_proj.weight": ParamLayout(head_split=(self.n_value_heads, 1))}

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_value_heads={self.n_value_heads}, "
            f"head_dim={self.head_dim}, conv_size={self.conv_size}, implementation={self.implementation!r}, "
            f"chunk_size={self.chunk_size}, gate={self.gate!r}, gate_lower_bound={self.gate_lower_bound}, "
            f"output_gate={self.output_gate!r}, output_gate_bias={self.output_gate_bias}, "
            f"qk_norm_eps={self.qk_norm_eps}"
        )

    def forward(self, x: Tensor, documents: Documents | Tensor | None = None) -> Tensor:
        """x [B, T, d_model] -> [B, T, d_model]; causal. documents (a Documents, k3train/models/common/documents.py, or
        document_ids [B, T]): the short convs and the recurrent state start afresh at each document start, as if
        each document ran alone."""
        documents = Documents.of(documents, self.context_parallel)
        if self._fla_kernels_take(x):
            return self._forward_fla(x, documents)
        B, T, _ = x.shape
        H, HV, K = self.n_heads, self.n_value_heads, self.head_dim
        qkv, f_a, g_in, b = self._input_projections(x)
        # one conv over q, k and v side by side (the three depthwise convs' weights concatenated)
        conv_weight = torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight])
        q, k, v = self._short_conv(qkv, conv_weight, documents).split(self._qkv_widths(), dim=-1)
        q, k = self._qk_normalize(q.view(B, T, H, K)), self._qk_normalize(k.view(B, T, H, K))
        g, beta = self._forget_gate(f_a), b.sigmoid()
        if self.track_gates and self.training:
            self._measure_gates(g, beta)
        o = self._recurrence(q, k, v.view(B, T, HV, K), g, beta, documents)  # in v's dtype
        return self._gated_output(g_in, o)

    @torch.no_grad()
    def _measure_gates(self, g: Tensor, beta: Tensor) -> None:
        """The log decay's mean and minimum, the share of channels within 1% of the sigmoid gate's lower bound
        (where the decay saturates: that channel forgets almost everything each step), and beta's mean."""
        self.gate_stats.mean("log_decay_mean", g.mean())
        self.gate_stats.min("log_decay_min", g.min())
        if self.gate == "sigmoid":
            near = torch.count_nonzero(g <= 0.99 * self.gate_lower_bound) / g.numel()
            self.gate_stats.mean("near_lower_bound", near)
        self.gate_stats.mean("beta_mean", beta.mean())

    def gate_diagnostics(self) -> dict[str, float]:
        """The gates' figures since the last call (_measure_gates); {} when no training forward ran."""
        return self.gate_stats.read()

    def _fla_kernels_take(self, x: Tensor) -> bool:
        """Whether this forward runs on FLA's fused kernels: implementation="fla", no context parallelism, and tensors
        FLA's Triton kernels run on (CUDA, or Triton's interpreter). Elsewhere "fla" keeps k3train's steps around
        fla_chunk_kda: under cp its two passes per slice; off CUDA it then refuses the CPU tensors."""
        return self.implementation == "fla" and self.context_parallel is None and fla_runs_on(x)

    def _forward_fla(self, x: Tensor, documents: Documents | None) -> Tensor:
        """forward() with its elementwise steps in FLA's kernels (the class docstring says which, and what changes).
        Documents go through FLA's varlen form: the rows flattened into one of B*T steps, one sequence per document
        (cu_seqlens, the Documents' own: made once per forward), for the short conv as for chunk_kda."""
        B, T, _ = x.shape
        HV, K = self.n_value_heads, self.head_dim
        qkv, f_a, g_in, b = self._input_projections(x)
        rows, steps = (B, T) if documents is None else (1, B * T)
        sequences = None if documents is None else documents.cu_seqlens
        conv_weight = torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight])
        qkv = fla_short_conv_silu(qkv.reshape(rows, steps, -1), conv_weight, sequences)
        q, k, v = (t.view(rows, steps, -1, K) for t in qkv.split(self._qkv_widths(), dim=-1))
        normalize_in_kernel = self.qk_norm_eps == FLA_QK_L2NORM_EPS  # the kernel's eps is fixed
        if not normalize_in_kernel:
            q, k = self._qk_normalize(q), self._qk_normalize(k)
        if self.track_gates and self.training:  # the kernel makes g and beta inside: made again here, no grad
            with torch.no_grad():
                self._measure_gates(self._forget_gate(f_a), b.float().sigmoid())
        o = fla_chunk_kda_from_projections(
            q,
            k,
            v,
            self.f_b_proj(f_a).view(rows, steps, HV, K),
            b.reshape(rows, steps, HV),
            self.A_log,
            self.dt_bias,
            lower_bound=self.gate_lower_bound if self.gate == "sigmoid" else None,
            normalize_qk=normalize_in_kernel,
            cu_seqlens=sequences,
        )
        return self._gated_output(g_in, o.view(B, T, HV, K))

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The ranks this layer's sequence is split over (parallel.cp; k3train/models/common/context_parallel.py), or
        None."""
        return self._context_parallel

    @context_parallel.setter
    def context_parallel(self, cp: ContextParallel | None) -> None:
        if cp is not None and self.implementation not in CONTEXT_PARALLEL_IMPLEMENTATIONS:
            raise ValueError(
                f"parallel.cp splits KDA's sequence with a chunked kernel (k3train's or FLA's); this layer runs "
                f"{self.implementation!r}: set model.kda_implementation=chunk (or fla)"
            )
        self._context_parallel = cp

    def _short_conv(self, qkv: Tensor, weight: Tensor, documents: Documents | None) -> Tensor:
        """The causal depthwise conv + SiLU over q, k, v side by side; split over ranks, the first positions read
        the previous rank's last conv_size - 1 inputs (and their documents: Documents.window), the first rank's
        zeros."""
        cp = self.context_parallel
        if cp is None:
            return CausalConvSiLU.apply(qkv, weight, documents)
        n = self.conv_size - 1
        window = torch.cat([cp.previous_tail(qkv, n), qkv], dim=1)
        return CausalConvSiLU.apply(window, weight, None if documents is None else documents.window(n))[:, n:]

    def _input_projections(self, x: Tensor, fused: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k, v side by side [..., 2 H K + HV K], the forget gate's low-rank input f_a, the output gate's input
        (g_a_proj x [..., K] for the low-rank gate, the logits g_proj x [..., HV K] for the full-rank one) and
        beta's logits; fused: every projection of x in one matmul.

        The weights stay separate parameters (their own names, init, Muon's per-head split); one [d, 3 H K + 2 K + HV]
        matmul instead of six is faster on CPU for training-sized inputs (docs/decisions/kda-layer.md). For a few
        rows (decoding) copying the weights together costs more than it saves: fused=False."""
        gate_in = self.g_a_proj if self.output_gate == "low_rank" else self.g_proj
        projections = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate_in, self.b_proj)
        if not fused:
            q, k, v, f_a, g_in, b = (p(x) for p in projections)
            return torch.cat([q, k, v], dim=-1), f_a, g_in, b
        weight = torch.cat([p.weight for p in projections])
        return F.linear(x, weight).split([sum(self._qkv_widths()), *(p.out_features for p in projections[3:])], -1)

    def _qk_normalize(self, x: Tensor) -> Tensor:
        """q or k [B, T, H, K] -> x / sqrt(sum x^2 + qk_norm_eps) per head: FLA's in-kernel l2norm's formula. Only
        _forward_fla leaves it to chunk_kda (use_qk_l2norm_in_kernel), and only when qk_norm_eps is the kernel's
        fixed 1e-6, so any qk_norm_eps holds on every path."""
        return l2_normalize_eps(x, self.qk_norm_eps)

    def _qkv_widths(self) -> list[int]:
        return [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]

    def empty_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> KDAState:
        key_dim = self.n_heads * self.head_dim
        return KDAState.empty(
            batch,
            self.conv_size,
            key_dim,
            self.n_value_heads * self.head_dim,
            self.n_value_heads,
            self.head_dim,
            device,
            dtype,
        )

    def forward_cached(self, x: Tensor, state: KDAState) -> Tensor:
        """forward() continued from `state`, which is updated in place: a prompt (T > 1) or one new token."""
        B, T, _ = x.shape
        H, HV, K = self.n_heads, self.n_value_heads, self.head_dim
        qkv, f_a, g_in, b = self._input_projections(x, fused=False)
        q, k, v = qkv.split(self._qkv_widths(), dim=-1)
        q, state.conv_q = self._short_conv_continued(self.q_conv, q, state.conv_q)
        k, state.conv_k = self._short_conv_continued(self.k_conv, k, state.conv_k)
        v, state.conv_v = self._short_conv_continued(self.v_conv, v, state.conv_v)
        q, k = self._qk_normalize(q.view(B, T, H, K)), self._qk_normalize(k.view(B, T, H, K))
        recurrence = self._continued_recurrence(T)
        o, state.recurrent = recurrence(
            q,
            k,
            v.view(B, T, HV, K),
            self._forget_gate(f_a),
            b.sigmoid(),
            initial_state=state.recurrent,
            output_final_state=True,
        )
        return self._gated_output(g_in, o)

    def _gated_output(self, g_in: Tensor, o: Tensor) -> Tensor:
        """o [B, T, HV, K] -> per-head RMSNorm times sigmoid(the output gate's logits), then o_proj. g_in: as
        _input_projections gives it (g_a_proj x, whose logits are g_b_proj(g_in); or the logits g_proj x)."""
        B, T, HV, K = o.shape
        logits = (self.g_b_proj(g_in) if self.output_gate == "low_rank" else g_in).view(B, T, HV, K)
        if self._fla_kernels_take(o):  # in fp32 inside the kernel, written in o's dtype, which o_proj reads
            eps = torch.finfo(o.dtype).eps if self.o_norm.eps is None else self.o_norm.eps  # nn.RMSNorm's default
            o = fla_rms_norm_sigmoid_gated(o, logits, self.o_norm.weight, eps)
        else:
            o = self.o_norm(o.to(self.o_norm.weight.dtype)) * logits.sigmoid()  # RMSNorm in the weight's precision
        return self.o_proj(o.reshape(B, T, HV * K))

    def _short_conv_continued(self, conv: nn.Conv1d, x: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
        """The causal conv + SiLU over `tail` (the previous conv_size - 1 inputs) then x: [B, T, D] and the new tail.

        Zeros as the first tail reproduce forward()'s causal padding exactly."""
        window = torch.cat((tail.to(x.dtype), x), dim=1)  # [B, conv_size - 1 + T, D]
        return F.silu(causal_depthwise_conv(window, conv.weight)), window[:, window.shape[1] - tail.shape[1] :]

    def _continued_recurrence(self, T: int):
        """The kernel that continues a state: chunked for a prompt, the per-step recurrence for one token
        (FLA's fused_recurrent_kda when this layer runs on FLA, the fp32 reference otherwise)."""
        if self.implementation == "fla":
            return fla_fused_recurrent_kda if T == 1 else fla_chunk_kda
        if self.implementation == "chunk" and T > 1:
            return partial(chunk_kda, chunk_size=self.chunk_size)
        return naive_recurrent_kda

    def _forget_gate(self, f_a: Tensor) -> Tensor:
        """Per-channel log decay g [B, T, HV, K] from f_a = f_a_proj(x), fp32 even under autocast (summed over T);
        an fp64 model keeps fp64 (the kernels' compute_dtype), so its gradients hold to fp64 in tests."""
        B, T, _ = f_a.shape
        dtype = compute_dtype(self.dt_bias)
        f = self.f_b_proj(f_a).to(dtype).view(B, T, self.n_value_heads, self.head_dim)
        f = f + self.dt_bias.to(dtype).view(self.n_value_heads, self.head_dim)
        rate = self.A_log.to(dtype).exp()[:, None]  # [HV, 1]
        if self.gate == "softplus":
            return -rate * F.softplus(f)
        return self.gate_lower_bound * torch.sigmoid(rate * f)

    def _recurrence(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, documents: Documents | None
    ) -> Tensor:
        if self.context_parallel is not None:
            return context_parallel_chunk_kda(
                q, k, v, g, beta, self.context_parallel, self.chunk_size, documents, self.implementation
            )
        if self.implementation == "fla":
            return fla_chunk_kda(q, k, v, g, beta, document_ids=documents)[0]
        document_ids = None if documents is None else documents.ids
        if self.implementation == "chunk":
            return chunk_kda(q, k, v, g, beta, chunk_size=self.chunk_size, document_ids=document_ids)[0]
        if self.implementation == "recurrent":
            return naive_recurrent_kda(q, k, v, g, beta, document_ids=document_ids)[0]


def causal_depthwise_conv(window: Tensor, weight: Tensor) -> Tensor:
    """window [B, W - 1 + T, D] (W - 1 earlier inputs, then T new ones), weight [D, 1, W] (an nn.Conv1d with
    groups=D) -> [B, T, D]: out[t] = sum_i weight[:, 0, i] * window[t + i], a causal depthwise conv.

    W shifted multiply-adds in [B, T, D] layout instead of Conv1d: on CPU the conv wants [B, D, T], and the
    transposes around it made its forward + backward slower (docs/decisions/kda-layer.md).
    """
    W = weight.shape[-1]
    T = window.shape[1] - W + 1
    out = window[:, :T] * weight[:, 0, 0]
    for i in range(1, W):
        out.addcmul_(window[:, i : i + T], weight[:, 0, i])
    return out


class CausalConvSiLU(torch.autograd.Function):
    """SiLU(causal_depthwise_conv(x zero-padded in front, weight)): x [B, T, D], weight [D, 1, W] -> [B, T, D].

    Forward and backward are W shifted multiply-adds into one tensor each, never a padded copy of x: through
    autograd, each of the W shifted slices' backward allocated and zero-filled a padded copy of the whole input.
    The layer runs q, k and v through one call (D = 2 H K + HV K, their weights concatenated). Timings:
    docs/decisions/kda-layer.md.

    documents (a Documents over x's positions, document_ids [B, T], or None): a tap that would reach back across a
    document start reads zero instead, the padding the document would see at the start of a row of its own (FLA's
    short conv does the same per cu_seqlens sequence); the taps' masks are the Documents', shared by every layer.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, documents: Documents | Tensor | None = None) -> Tensor:
        documents = Documents.local(documents)
        W, T = weight.shape[-1], x.shape[1]
        w = weight[:, 0]  # [D, W]; out[t] = sum_s w[:, W - 1 - s] * x[t - s]: no padded copy of x
        pre = x * w[:, W - 1]
        for s in range(1, min(W, T)):
            pre[:, s:].addcmul_(_same_document_only(x[:, : T - s], documents, s), w[:, W - 1 - s])
        ctx.save_for_backward(x, weight, pre)
        ctx.documents = documents
        return F.silu(pre)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, pre = ctx.saved_tensors
        grad_pre = torch.ops.aten.silu_backward(grad, pre)  # the kernel autograd's silu would use
        W, T = weight.shape[-1], x.shape[1]
        w = weight[:, 0].to(grad_pre.dtype)  # [D, W]; out[t] = sum_s w[:, W - 1 - s] * x[t - s]
        grad_x = grad_pre * w[:, W - 1]
        acc = torch.promote_types(weight.dtype, torch.float32)  # the weight's sums over B x T: at least fp32
        grad_w = torch.empty(weight.shape, dtype=acc, device=weight.device)
        grad_w[:, 0, W - 1] = (grad_pre * x).sum((0, 1), dtype=acc)
        for s in range(1, min(W, T)):
            grad_tap = _same_document_only(grad_pre[:, s:], ctx.documents, s)  # the taps the forward kept
            grad_x[:, : T - s].addcmul_(grad_tap, w[:, W - 1 - s])
            grad_w[:, 0, W - 1 - s] = (grad_tap * x[:, : T - s]).sum((0, 1), dtype=acc)
        grad_w[:, 0, : max(W - T, 0)] = 0  # taps that only ever saw the padding
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def _same_document_only(tap: Tensor, documents: Documents | None, shift: int) -> Tensor:
    """tap [B, T - shift, D], the pairs (t, t + shift) of a conv tap: zeroed where a document starts between them
    (tap itself, untouched, without documents)."""
    if documents is None:
        return tap
    return tap * documents.same_document(shift, tap.dtype)
