"""The MoE layer: the router (router.py), the balancing bias (balancing.py), the routed and shared experts
(experts.py) and a token dispatcher (dispatch.py) composed.

    MoE: x [B, T, d] -> [B, T, d] = shared(x) + sum over the k chosen of n routed experts of gate_e * expert_e(x)
    latent MoE (latent_dim = r): shared(x) + latent_up(RMSNorm_r(sum_e gate_e * expert_e(latent_down(x))))

Latent MoE (Kimi K3): the routed experts run at width r < d. latent_down [r, d] maps each token into the latent
space, the k chosen experts (input and output width r) are summed there with their gate weights, the sum is
RMS-normalised (eps: the model's norm_eps) and latent_up [d, r] maps it back; the router and the shared experts
read the full-width x. An expert then costs 3 r ffn multiply-adds instead of 3 d ffn, for 2 d r per token more in
the two projections (flops.py: moe_macs). Upstream, KimiK3MoE (routed_expert_down_proj / routed_expert_norm /
routed_expert_up_proj there):
https://github.com/NVIDIA-NeMo/Automodel/blob/00ef9ca241e8b06fb7f59eb70b1cad1cc5c357bb/nemo_automodel/components/models/kimi_k3/model.py

What the code around a MoE may change, each through a method of the MoE:
- balance_over(group): the ranks whose tokens Quantile Balancing balances together (the run's data-parallel group,
  handed over by the parallelize function; None: this process's alone). `process_group` reads it, and assigning
  it is the same call.
- shard_experts(group): expert parallelism, this rank's 1/ep of the routed experts and the all-to-all dispatcher;
  use_dispatcher(d) installs any other dispatcher.
- replaying(routes): a checkpointed Block's forward records the experts chosen, its recompute routes by them
  (replayed_routes).
And forward(x, checkpoint_experts=True) (the block's choice under selective checkpointing) recomputes the routed
experts in the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3train.models.common.norm import RMSNorm
from k3train.models.common.situ import check_activation
from k3train.models.common.swiglu import SwiGLU
from k3train.models.k3.moe.balancing import Balancer
from k3train.models.k3.moe.dispatch import AllToAllDispatch, Dispatcher, LocalDispatch
from k3train.models.k3.moe.experts import RoutedExperts
from k3train.models.k3.moe.router import Router


class MoE(nn.Module):
    """x [B, T, d] -> [B, T, d]: shared expert(s) plus k of n routed experts per token.

    activation / situ_beta / situ_linear_beta: every expert's FFN, shared and routed (SwiGLU's arguments).
    latent_dim: None, the routed experts at width d (Kimi Linear); r, a latent MoE (module docstring), with
    `latent_down` (Linear d -> r), `latent_norm` (RMSNorm over r, eps norm_eps) and `latent_up` (Linear r -> d).
    balancing / aux_free_bias_rate: how the bias `expert_bias` moves (balancing.py).
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
        self.balancer = Balancer(balancing, aux_free_bias_rate)
        if not 0 < experts_per_token < n_routed_experts:
            raise ValueError(f"experts_per_token={experts_per_token} must be in [1, n_routed_experts)")

        act = dict(activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
        self.latent_dim = latent_dim
        self.router = Router(d_model, n_routed_experts, experts_per_token, routed_scaling_factor)  # weight [n, d]
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
        self.dispatcher: Dispatcher = LocalDispatch(n_routed_experts)
        # Under a checkpointed Block (replaying): {} while its forward runs, then {"experts": ...} for the recompute
        # to route the same way. None: no checkpointed Block around this pass.
        self.routes: dict | None = None

    @property
    def n_experts(self) -> int:
        return self.router.out_features

    @property
    def k(self) -> int:
        return self.router.k

    @property
    def routed_scaling_factor(self) -> float:
        return self.router.scaling_factor

    # --- what the code around the MoE sets -------------------------------------------------------------------

    def balance_over(self, group: dist.ProcessGroup | None) -> None:
        """Balance over the tokens of every rank of `group` in training-mode passes (balancing.py); None: over this
        process's tokens alone."""
        self.balancer.balance_over(group)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group balance_over was given (None: this process's tokens alone); assigning it calls balance_over."""
        return self.balancer.group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self.balance_over(group)

    def use_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Send the token slots to the routed experts through `dispatcher` from now on (dispatch.py)."""
        self.dispatcher = dispatcher

    def shard_experts(self, group: dist.ProcessGroup) -> None:
        """Expert parallelism: keep this rank's 1/ep of the routed experts (whole experts) and dispatch across
        `group` by all-to-all from now on. Every rank must hold the same full experts before (the same seed, or a
        loaded checkpoint)."""
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.n_experts % ep:
            raise ValueError(f"{self.n_experts} routed experts do not split over parallel.ep={ep}: choose a divisor")
        self.experts.keep_shard(rank, ep, group)
        self.use_dispatcher(AllToAllDispatch(group, self.n_experts))

    def route_evenly(self) -> None:
        """From now on token i chooses experts (i k + j) mod n, j < k, whatever its scores: every expert receives the
        same number of slots (to one), and an expert-parallel rank takes the counts it receives as what it sends,
        without exchanging them. A dry run's routing (k3train/run/dry_run.py): the sizes a balanced run moves, not
        those of the meaningless values a fake process group leaves (Automodel's fake balanced gate does the
        same)."""
        self.router.evenly = True
        if isinstance(self.dispatcher, AllToAllDispatch):
            self.dispatcher.evenly = True

    @contextlib.contextmanager
    def replaying(self, routes: dict) -> Iterator[None]:
        """Within: record the experts chosen in `routes`, or, once they are there, route by them and leave the bias
        alone (a checkpointed Block's recompute)."""
        self.routes = routes
        try:
            yield
        finally:
            self.routes = None

    # --- the forward ---------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, checkpoint_experts: bool = False) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]; checkpoint_experts: the routed experts recomputed in the backward."""
        B, T, d = x.shape
        x_flat = x.reshape(B * T, d)
        weights, experts = self.route(self.router_logits(x_flat))  # [N, k], [N, k]
        if checkpoint_experts and torch.is_grad_enabled():
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
        """x [N, d] -> router logits [N, n] in fp32 (float64 for float64 x), whatever autocast is on (Router.logits)."""
        return self.router.logits(x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, n] -> gate weights [N, k] fp32 (float64 for float64 logits) and chosen experts [N, k]; in
        training, updates the bias."""
        scores = self.router.scores(logits)
        replay = self.routes is not None and "experts" in self.routes  # a checkpointed Block's recompute
        if replay:
            experts = self.routes["experts"]  # the forward's choice: the bias has moved on since
        else:
            experts = self.router.choose(scores, self.expert_bias)
            if self.routes is not None:
                self.routes["experts"] = experts
        weights = self.router.gate_weights(scores, experts)
        if self.training and not replay:
            self._after_training_route(scores.detach(), experts)
        return weights, experts

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, w], weights/experts [N, k] -> sum_j weights[:, j] * expert_{experts[:, j]}(x)  [N, w] (w: d, or
        the latent width r, which x is then already in), through the dispatcher."""
        slots = self.dispatcher.dispatch(x, weights, experts)
        # through the module, so FSDP2 (which may shard these experts again over expert_dp) gathers them first
        y = self.experts(slots.rows, slots.counts, slots.scale)
        return self.dispatcher.combine(y, slots.back)

    def _after_training_route(self, scores: torch.Tensor, experts: torch.Tensor) -> None:
        self.balancer.update(self.expert_bias, scores, experts)

    @property
    def last_load(self) -> torch.Tensor | None:
        """Tokens per expert [n] of the last training-mode pass (over the balancing group); not state."""
        return self.balancer.last_load

    def diagnostics(self) -> dict[str, float]:
        """Router health of the last training-mode pass (Balancer.diagnostics); empty before the first pass."""
        return self.balancer.diagnostics(self.expert_bias)


def shard_experts(moe: MoE, group: dist.ProcessGroup) -> None:
    """MoE.shard_experts, as a function."""
    moe.shard_experts(group)


@contextlib.contextmanager
def replayed_routes(ffn: nn.Module, routes: dict) -> Iterator[None]:
    """Within: a MoE `ffn` records the experts it chooses in `routes`, or, once they are there, routes by them and
    leaves its bias alone (a checkpointed Block's recompute; MoE.replaying). Any other FFN: nothing."""
    if not isinstance(ffn, MoE):
        yield
        return
    with ffn.replaying(routes):
        yield
