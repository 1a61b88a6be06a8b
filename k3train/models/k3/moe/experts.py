"""The routed experts: RoutedExperts, the E routed experts as stacked weights [E, out, in] that run through
GroupedSwiGLU (grouped_swiglu.py). The dense FFN and the MoE's shared experts are SwiGLU
(k3train/models/common/swiglu.py), whose activation and its arguments the routed experts take too.

Every FFN is w_down(act(w_gate x, w_up x)) with act either SwiGLU's silu(g) * u (the default) or Kimi K3's SiTU-GLU
(activation="situ"; k3train/models/common/situ.py: formula, derivatives, why).

Expert parallelism keeps whole experts on each rank: RoutedExperts.keep_shard replaces each stacked weight with this
rank's 1/ep of it, and its param_layouts say so (expert_parallel = ep, expert_group; k3train/models/layout.py)
so that the gradient averaging, the optimizer's norms and the checkpoint know it is part of a whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3train.models.common.situ import check_activation
from k3train.models.k3.moe.grouped_swiglu import GroupedSwiGLU
from k3train.models.layout import ParamLayout

EXPERT_IMPLEMENTATIONS = ("auto", "loop", "grouped_mm")


def _situ_betas(activation: str, beta: float, linear_beta: float) -> tuple[float, float] | None:
    """What GroupedSwiGLU takes as its activation: None for SwiGLU, (beta, linear_beta) for SiTU-GLU."""
    return None if activation == "swiglu" else (float(beta), float(linear_beta))


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
        self.expert_split = ParamLayout()  # keep_shard: this rank's share of each stacked weight
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

    def keep_shard(self, rank: int, ep: int, group: dist.ProcessGroup) -> None:
        """Keep experts [rank E/ep, (rank+1) E/ep) of every stacked weight (whole experts; E divisible by ep), each
        1/ep of the whole weight held across `group`."""
        per_rank = self.w_gate.shape[0] // ep
        for name in ("w_gate", "w_up", "w_down"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()))
        self.expert_split = ParamLayout(expert_parallel=ep, expert_group=group)

    def param_layouts(self) -> dict[str, ParamLayout]:
        """Each stacked weight: whole, or after keep_shard this rank's 1/ep of it (k3train/models/layout.py)."""
        return {name: self.expert_split for name in ("w_gate", "w_up", "w_down")}
