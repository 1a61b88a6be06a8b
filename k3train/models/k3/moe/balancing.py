"""Balancing: the expert bias b [n] that steers the router's choice (router.py), and how it moves.

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

Data-parallel training: when the balancing group (MoE.balance_over) has more than one rank (the run's data-parallel
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

import math

import torch
import torch.distributed as dist

from k3train.models.k3.moe.router import expert_counts
from k3train.runtime.distributed import chunk_sizes

BALANCING = ("quantile_balancing", "aux_free_bias", "none")
# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); k3train supports torch >= 2.9.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_all_to_all_single = dist.all_to_all_single  # module attributes, so tests can count what they carry


class Balancer:
    """How one MoE's bias moves after each training-mode routing (`method`: one of BALANCING), over the tokens of
    `group` (balance_over; None: this process's alone), and the load of the last such pass (`last_load`, tokens per
    expert [n]) and of every pass since diagnostics were last read (`window_load`): diagnostics, not state."""

    def __init__(self, method: str, aux_free_bias_rate: float = 1e-3) -> None:
        if method not in BALANCING:
            raise ValueError(f"balancing={method!r} must be one of {BALANCING}")
        self.method, self.aux_free_bias_rate = method, aux_free_bias_rate
        self.group: dist.ProcessGroup | None = None
        self.last_load: torch.Tensor | None = None
        self.window_load: torch.Tensor | None = None
        self.window_bias: torch.Tensor | None = None  # the bias when the window began

    def balance_over(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    @torch.no_grad()
    def update(self, bias: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor) -> None:
        """After a training-mode routing of scores [N, n] (detached) to experts [N, k] with `bias` [n]: set or step
        `bias` in place, and record the load."""
        n, k = scores.shape[1], experts.shape[1]
        group = self._group()
        load = expert_counts(experts.reshape(-1), n).float()
        if group is not None:
            load, tokens_per_rank = global_load(load, scores.shape[0], group)
        self.last_load = load
        self.window_load = load.clone() if self.window_load is None else self.window_load.add_(load)
        if self.window_bias is None:
            self.window_bias = bias.detach().float().clone()
        if self.method == "quantile_balancing":
            required = required_bias(scores, bias, k)
            if group is None:
                new = quantile_bias(required, k)
            else:
                check_equal_tokens(tokens_per_rank)
                new = global_quantile_bias(required, k, group)
            bias.copy_(new - new.mean())
        elif self.method == "aux_free_bias":
            bias.add_(self.aux_free_bias_rate * torch.sign(load.mean() - load))

    def _group(self) -> dist.ProcessGroup | None:
        """The group whose tokens are balanced together, or None to balance over this process's tokens alone."""
        group = self.group
        return group if group is not None and dist.get_world_size(group) > 1 else None

    def diagnostics(self, bias: torch.Tensor) -> dict[str, float]:
        """Router health of the last training-mode pass: max/min expert load over the mean, bias range, and the
        entropy of the load distribution over log(n) (1.0 = perfectly even); and over every training pass since the
        last call (which starts a new window): the load's coefficient of variation (std / mean of tokens per
        expert), the share of experts that received no token, and the bias's largest move. Empty before the first
        pass."""
        if self.last_load is None:
            return {}
        load = self.last_load
        share = load / load.sum()
        entropy = -(share * share.clamp_min(1e-12).log()).sum() / math.log(load.numel())
        out = {
            "load_max": (load.max() / load.mean()).item(),
            "load_min": (load.min() / load.mean()).item(),
            "bias_range": (bias.max() - bias.min()).item(),
            "routing_entropy": entropy.item(),
        }
        if self.window_load is not None:  # every training pass since the last read (Automodel's load CV, dead experts)
            window = self.window_load
            out["load_cv"] = (window.std(correction=0) / window.mean()).item()
            out["dead_share"] = (window == 0).float().mean().item()  # experts no token reached
            out["bias_drift"] = (bias.detach().float() - self.window_bias).abs().max().item()
            self.window_load, self.window_bias = None, None
        return out


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
