"""Muon for hidden matrices and AdamW for everything else, as ONE torch.optim.Optimizer.

Each param group has a "name" and a "kind":
- "muon": 2D weights and 3D stacked expert weights [E, out, in]. The momentum (Nesterov) is orthogonalised by a
  Newton-Schulz quintic per *matrix view*: a plain 2D weight is one matrix; one whose group gives it a head split (H,
  dim) (its module's layout, k3train/models/layout.py) is H head matrices; a 3D expert stack is E matrices. Views of one
  parameter are orthogonalised as one batch. The update is scaled by rms_match * sqrt(max(A, B)) of the view's matrix
  shape so that its RMS matches AdamW's (Moonlight, arXiv 2502.16982), which lets Muon share AdamW's lr and weight
  decay.
- "adamw": decoupled AdamW with bias correction (embeddings, LM head, norms, biases, gates, conv kernels, ...).

Momentum follows torch.optim.Muon exactly (EMA form: buf.lerp_(g, 1 - mu); Nesterov: g.lerp(buf, mu)); an EMA
buffer is (1 - mu) times a classic `mu * buf + g` buffer, so checkpoints of the two forms are not interchangeable.
Which parameter goes to which group, and why, is decided in k3train/optim/param_groups.py.

Data-parallel (`process_group` with more than one rank; the run hands its ParallelDims' data-parallel group, None in one
process): each rank orthogonalises a share of every Muon group's replicated parameters (DDP) and the results are
all-gathered, so every rank applies the same update as a 1-process run would, bit for bit, and keeps the whole optimizer
state (rank 0's state_dict is the checkpoint). FSDP2's shards are orthogonalised at one owner per matrix on their mesh,
which receives the matrix's shards and returns each rank its shard of the update; each rank's momentum stays on its
shard, and again the result is a 1-process run's bit for bit (k3train/optim/muon_distributed.py). Expert-parallel shards
(`expert_shards`: each rank holds other experts, the rest on `expert_group`) are orthogonalised by their own rank, never
spread; under FSDP2 they are sharded again on the expert dimension, so each rank still holds whole experts and
orthogonalises those, exchanging nothing, or, with fewer experts than ranks to shard them over, on dim 1, and then the
ranks holding slices of the same experts share them out as owners as above
(k3train/runtime/parallel_layout.expert_shard_dim; which of the three a parameter gets is
k3train/optim/muon_distributed.muon_placement, the planner's too). A checkpoint holds every rank's own experts
(k3train/checkpoint/expert_shards.py).

Sources: KellerJordan/Muon, torch.optim.Muon and Moonlight's Muon:
https://github.com/KellerJordan/Muon/blob/857d1adc159e098212f828d927460782d3da59e9/muon.py
https://github.com/pytorch/pytorch/blob/cf30153c4c131c8164ee7798e5022d810682e2cb/torch/optim/_muon.py
https://github.com/MoonshotAI/Moonlight/blob/c2ad5b20c605086526a179d36901bfc41b52b44b/examples/toy_train.py
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from k3train.optim.checks import check_adamw_settings, check_muon_settings
from k3train.optim.muon_distributed import (
    all_gather_outputs,
    assign_owners,
    data_parallel_group,
    exchange_with_owners,
    global_square_sum,
    holds_whole_experts,
    is_sharded,
    local_part,
    muon_placement,
    newton_schulz_cost,
    shard_group,
    shard_placement,
    sum_over_shards,
)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
KINDS = ("muon", "adamw")

HeadSplit = tuple[int, int]  # (n_heads, dim): a ParamLayout's head_split (k3train/models/layout.py)
# Newton-Schulz dtypes: bf16 is torch.optim.Muon's (and fast on GPUs and CPUs with native bf16); fp32 is the
# choice on CPUs without it, where bf16 matmuls run far slower (k3train/optim/build.py picks for "auto"; measured:
# docs/decisions/cpu-runtime.md).
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def zeropower_via_newtonschulz5(
    G: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalise each matrix of G [..., A, B] in `dtype`; returns [..., A, B] in `dtype`.

    The quintic pushes every singular value of X / ||X||_F towards 1 but, tuned for speed, lands them roughly in
    [0.5, 1.5] rather than at 1 (KellerJordan/Muon, above). Tall matrices are transposed so the Gram matrix X X^T is the
    small one. Leading dims are a batch; per matrix the bf16 result equals torch.optim.Muon's, bit for bit.
    """
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    a, b, c = coefficients
    X = G.to(dtype).reshape(-1, *G.shape[-2:])  # [N, A, B]
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    # Frobenius norm per matrix bounds the spectral norm by 1, inside the iteration's basin.
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = X @ X.mT  # [N, a, a], a = min(A, B)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*gram + c*gram^2
        X = torch.baddbmm(X, poly, X, beta=a)  # a*X + poly X
    if tall:
        X = X.mT
    return X.reshape(G.shape)


def as_matrices(t: Tensor, head_split: HeadSplit | None) -> Tensor:
    """View a Muon parameter (or its gradient) as a batch of matrices [N, A, B] that Muon orthogonalises."""
    if t.ndim == 3:  # stacked experts [E, out, in]
        return t
    if head_split is None:
        return t.unsqueeze(0)
    n_heads, dim = head_split
    rows, cols = t.shape
    if dim == 0:  # [H*dh, d] -> [H, dh, d]
        return t.view(n_heads, rows // n_heads, cols)
    return t.view(rows, n_heads, cols // n_heads).transpose(0, 1)  # [d, H*dh] -> [H, d, dh]


def from_matrices(m: Tensor, head_split: HeadSplit | None, shape: torch.Size) -> Tensor:
    """Inverse of as_matrices: [N, A, B] back to the parameter's shape."""
    if head_split is not None and head_split[1] == 1:
        m = m.transpose(0, 1)  # [H, d, dh] -> [d, H, dh]
    return m.reshape(shape)


def check_head_split(shape: torch.Size, head_split: Any, name: str) -> HeadSplit | None:
    """Validate a head split against its parameter's shape; returns it as a tuple (or None)."""
    if head_split is None:
        return None
    n_heads, dim = head_split
    if len(shape) != 2 or dim not in (0, 1) or n_heads < 1 or shape[dim] % n_heads:
        raise ValueError(
            f"{name}: head_split={tuple(head_split)} does not fit shape {tuple(shape)}; it must be "
            "(n_heads, dim) with dim 0 or 1 of a 2D weight and shape[dim] divisible by n_heads"
        )
    return int(n_heads), int(dim)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer, param groups of kind "muon" or "adamw" (each with a "name"); see the module docstring.

    Group keys (missing ones are filled from the constructor's defaults):
      all:   name, kind, params, lr, weight_decay; optional lr_scales (one per param: its update's lr over the
             group's, as muP's k3train/optim/mup.py sets them; absent: 1 for every param). The weight decay stays
             lr * weight_decay a step whatever the factor, as the mup package's MuAdam keeps it)
      muon:  momentum, nesterov, ns_steps, ns_coefficients, ns_eps, ns_dtype ("bf16" | "fp32"), rms_match,
             head_splits (one per param, or None)
      adamw: betas, eps
    Per-param state: "step" (int) and "momentum_buffer" (muon) or "exp_avg", "exp_avg_sq" (adamw). Everything that
    shapes the next update lives in state and param_groups, so state_dict/load_state_dict resumes exactly.
    """

    def __init__(
        self,
        param_groups: Iterable[dict[str, Any]],
        *,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_eps: float = 1e-7,
        rms_match: float = 0.2,
        orthogonality_check_interval: int = 50,
        ns_dtype: str = "bf16",
        process_group: dist.ProcessGroup | None = None,
        expert_shards: Iterable[Tensor] = (),
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        check_adamw_settings("", lr, weight_decay, betas, eps)
        check_muon_settings("", momentum, ns_steps, rms_match, orthogonality_check_interval)
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype={ns_dtype!r} must be one of {sorted(NS_DTYPES)}")
        self._kind_defaults = {
            "muon": dict(
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                ns_coefficients=tuple(ns_coefficients),
                ns_eps=ns_eps,
                ns_dtype=ns_dtype,
                rms_match=rms_match,
            ),
            "adamw": dict(betas=tuple(betas), eps=eps),
        }
        self.orthogonality_check_interval = orthogonality_check_interval
        self.process_group = process_group  # the data-parallel ranks to spread Newton-Schulz over (None: alone)
        # Expert parallelism: the weights of which this rank holds its own experts, the rest on expert_group's ranks
        self.expert_shards = frozenset(id(p) for p in expert_shards)
        self.expert_group = expert_group
        # Diagnostics: they never shape an update. The update RMS is the last step's; the orthogonality error is
        # the last measurement (every orthogonality_check_interval steps), so it travels in state_dict: a resumed
        # run reports it at the same steps as an uninterrupted one.
        self._update_sq: dict[str, tuple[Tensor, int]] = {}  # group name -> (sum of squared updates, numel)
        self._ortho_error: dict[str, float] = {}
        self._sharded_weight_sq: dict[str, float] = {}  # FSDP2 groups: squared weight norm after the last step
        self._lr_scales: dict[int, float] = {}  # id(param) -> its group's lr_scales entry, read at each step
        super().__init__(list(param_groups), dict(lr=lr, weight_decay=weight_decay))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        kind, name = param_group.get("kind"), param_group.get("name")
        if kind not in KINDS or not isinstance(name, str):
            raise ValueError(
                f"each MuonAdamW param group needs a 'name' (str) and a 'kind' in {KINDS}; "
                f"got name={name!r}, kind={kind!r}"
            )
        if any(g["name"] == name for g in self.param_groups):
            raise ValueError(f"duplicate param group name {name!r}")
        for key, value in self._kind_defaults[kind].items():
            param_group.setdefault(key, value)
        params = list(param_group["params"])
        param_group["params"] = params
        if kind == "muon":
            splits = param_group.get("head_splits", [None] * len(params))
            if len(splits) != len(params):
                raise ValueError(f"group {name!r}: {len(splits)} head_splits for {len(params)} params")
            for i, p in enumerate(params):
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"group {name!r} param {i} has shape {tuple(p.shape)}: Muon takes 2D "
                        "matrices or 3D expert stacks [E, out, in]; send it to an AdamW group"
                    )
            param_group["head_splits"] = [
                check_head_split(p.shape, s, f"group {name!r} param {i}")
                for i, (p, s) in enumerate(zip(params, splits))
            ]
        if "lr_scales" in param_group:
            scales = [float(s) for s in param_group["lr_scales"]]
            if len(scales) != len(params) or not all(math.isfinite(s) and s > 0 for s in scales):
                raise ValueError(f"group {name!r}: lr_scales must be {len(params)} finite numbers > 0, one per param")
            param_group["lr_scales"] = scales
        if kind != "muon" and "head_splits" in param_group:
            raise ValueError(f"group {name!r} is AdamW; head_splits only make sense for Muon groups")
        if param_group.get("ns_dtype", "bf16") not in NS_DTYPES:
            raise ValueError(f"group {name!r}: ns_dtype={param_group['ns_dtype']!r} must be one of {sorted(NS_DTYPES)}")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "orthogonality_error": dict(self._ortho_error)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self._ortho_error = dict(state_dict.pop("orthogonality_error", {}))  # absent in older checkpoints
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # checkpoints from before ns_dtype existed ran Newton-Schulz in bf16
            if group["kind"] == "muon":
                group.setdefault("ns_dtype", "bf16")

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lr_scales = {
            id(p): s for group in self.param_groups for p, s in zip(group["params"], group.get("lr_scales", ()))
        }
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
            # diagnostics() runs no collective: the squared norm is taken here
            if any(is_sharded(p) or id(p) in self.expert_shards for p in group["params"]):
                squares = global_square_sum(group["params"], self.expert_shards, self.expert_group)
                self._sharded_weight_sq[group["name"]] = float(squares)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        with_grad = [(p, s) for p, s in zip(group["params"], group["head_splits"]) if p.grad is not None]
        ranks = data_parallel_group(self.process_group)
        # Where each parameter is orthogonalised (muon_placement): an FSDP2 shard (or a slice of experts) at its
        # owner on its mesh; an expert-parallel shard differs by rank, so its own rank does it (each expert is its own
        # matrix); the rest, replicated, shared out over the data-parallel ranks, or here in one process.
        placed = [
            muon_placement(
                sharded=is_sharded(p),
                expert_parallel=id(p) in self.expert_shards,
                whole_experts=id(p) in self.expert_shards and holds_whole_experts(p),
                data_parallel=ranks is not None,
            )
            for p, _ in with_grad
        ]
        in_turn = itertools.chain(
            self._orthogonalise_here(group, with_grad, [i for i, where in enumerate(placed) if where == "own"]),
            self._orthogonalise_spread(
                group, with_grad, [i for i, where in enumerate(placed) if where == "replicated"], ranks
            ),
        )
        squares = []  # each update's sum of squares (lr-scaled), summed in parameter order as one process would
        for i, O in in_turn:
            p, split = with_grad[i]
            squares.append(self._apply_update(group, with_grad, i, from_matrices(O, split, local_part(p).shape)))
            if self._orthogonality_due(self.state[p]["step"], i, len(with_grad)):
                self._ortho_error[group["name"]] = orthogonality_error(O[0])
        squares += self._orthogonalise_at_owners(
            group, with_grad, [i for i, where in enumerate(placed) if where == "owners"]
        )
        if squares:
            self._update_sq[group["name"]] = (sum(squares), sum(p.numel() for p, _ in with_grad))

    def _apply_update(
        self, group: dict[str, Any], with_grad: list[tuple[Tensor, HeadSplit | None]], i: int, update: Tensor
    ) -> Tensor:
        """Weight decay, then the update (this rank's part of p, in its layout) scaled to AdamW's RMS; returns the
        scaled update's sum of squares."""
        p, split = with_grad[i]
        matrix = as_matrices(torch.empty(p.shape, device="meta"), split).shape
        scaled_lr = group["lr"] * self._lr_scales.get(id(p), 1.0) * (group["rms_match"] * math.sqrt(max(matrix[-2:])))
        p.mul_(1 - group["lr"] * group["weight_decay"])  # the group's lr: muP's factor leaves the decay as it was
        local_part(p).add_(update, alpha=-scaled_lr)
        # squared into a row-major tensor: a sum's order follows the layout, and one process's tall updates are
        # transposed views where the ranks' are row-major copies, so their sums would differ in the last bit
        square = torch.square(update, out=torch.empty(update.shape, dtype=torch.float32, device=update.device))
        return square.sum() * scaled_lr**2

    def _orthogonalise_here(
        self, group: dict[str, Any], with_grad: list[tuple[Tensor, HeadSplit | None]], items: list[int]
    ) -> Iterator[tuple[int, Tensor]]:
        """One process, or a rank's own whole experts: Newton-Schulz of each momentum in turn (a generator, so only
        one parameter's output is alive at once)."""
        for i in items:
            p, split = with_grad[i]
            yield i, self._newton_schulz(group, local_part(self._momentum(group, p)), split)

    def _orthogonalise_spread(
        self,
        group: dict[str, Any],
        with_grad: list[tuple[Tensor, HeadSplit | None]],
        items: list[int],
        ranks: dist.ProcessGroup | None,
    ) -> Iterator[tuple[int, Tensor]]:
        """Replicated parameters on data-parallel ranks: every rank updates every momentum buffer (identical state
        everywhere), orthogonalises its own share and gets the others' from one all-gather
        (k3train/optim/muon_distributed.py)."""
        if not items:  # the same on every rank (they hold the same gradients): nothing to exchange
            return
        rank = dist.get_rank(ranks)
        shapes = [as_matrices(torch.empty(with_grad[i][0].shape, device="meta"), with_grad[i][1]).shape for i in items]
        owners = assign_owners([newton_schulz_cost(s) for s in shapes], dist.get_world_size(ranks))
        mine = {}
        for k, (i, owner) in enumerate(zip(items, owners)):
            p, split = with_grad[i]
            momentum = self._momentum(group, p, needed=owner == rank)
            if owner == rank:
                mine[k] = self._newton_schulz(group, momentum, split)
        dtype = NS_DTYPES[group["ns_dtype"]]
        yield from zip(items, all_gather_outputs(mine, shapes, owners, dtype, with_grad[0][0].device, ranks))

    def _orthogonalise_at_owners(
        self, group: dict[str, Any], with_grad: list[tuple[Tensor, HeadSplit | None]], items: list[int]
    ) -> list[Tensor]:
        """FSDP2 shards: each matrix orthogonalised by one owner on its mesh, the updates returned shard by shard
        (muon_distributed.exchange_with_owners), applied as they arrive. The update's sum of squares and the
        orthogonality error are then summed (taken the largest of) over the mesh, so every rank reports the same.
        Returns each mesh's sum of squares."""
        by_mesh: dict[Any, list[int]] = {}
        for i in items:  # meshes in the order their first parameter comes: the same on every rank
            p = with_grad[i][0]
            by_mesh.setdefault((p.device_mesh, shard_placement(p)[0]), []).append(i)
        return [
            self._orthogonalise_on_mesh(group, with_grad, members, shard_group(with_grad[members[0]][0]))
            for members in by_mesh.values()
        ]

    def _orthogonalise_on_mesh(
        self,
        group: dict[str, Any],
        with_grad: list[tuple[Tensor, HeadSplit | None]],
        members: list[int],
        shards: dist.ProcessGroup,
    ) -> Tensor:
        """The members sharded over one group of ranks (`shards`: a mesh dimension; under HSDP each replica's
        group does the same): their exchange with the owners, every rank's updates applied; the sum of their
        updates' squares over the group (a collective, as is the orthogonality error's maximum when due)."""
        device = with_grad[members[0]][0].device  # the collectives' (NCCL's) device
        ortho = torch.zeros((), dtype=torch.float64, device=device)
        steps = [self.state[with_grad[i][0]].get("step", 0) + 1 for i in members]  # the step about to be taken
        due = {i for i, step in zip(members, steps) if self._orthogonality_due(step, i, len(with_grad))}

        def local_input(k: int) -> Tensor:
            return local_part(self._momentum(group, with_grad[members[k]][0]))

        def orthogonalise(k: int, whole: Tensor) -> Tensor:
            p, split = with_grad[members[k]]
            O = self._newton_schulz(group, whole, split)
            if members[k] in due:
                ortho.fill_(orthogonality_error(O[0]))
            return from_matrices(O, split, p.shape)

        matrices = [as_matrices(torch.empty(with_grad[i][0].shape, device="meta"), with_grad[i][1]) for i in members]
        sq = torch.zeros((), device=device)
        for k, update in exchange_with_owners(
            [with_grad[i][0].shape for i in members],
            [shard_placement(with_grad[i][0])[1] for i in members],
            [newton_schulz_cost(m.shape) for m in matrices],
            local_input,
            orthogonalise,
            NS_DTYPES[group["ns_dtype"]],
            shards,
        ):
            sq = sq + self._apply_update(group, with_grad, members[k], update)
        dist.all_reduce(sq, group=shards)
        if due:
            dist.all_reduce(ortho, op=dist.ReduceOp.MAX, group=shards)
            self._ortho_error[group["name"]] = float(ortho)
        return sq

    def _momentum(self, group: dict[str, Any], p: Tensor, needed: bool = True) -> Tensor | None:
        """Advance p's momentum buffer with p.grad; return what Newton-Schulz orthogonalises (Nesterov or the
        buffer), or None when not `needed` (another rank orthogonalises p)."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["momentum_buffer"] = torch.zeros_like(p)
        state["step"] += 1
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        if not needed:
            return None
        return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _newton_schulz(self, group: dict[str, Any], momentum: Tensor, split: HeadSplit | None) -> Tensor:
        """The momentum's matrix views orthogonalised, [N, A, B] in the group's ns_dtype."""
        return zeropower_via_newtonschulz5(
            as_matrices(momentum, split),
            group["ns_steps"],
            group["ns_coefficients"],
            group["ns_eps"],
            NS_DTYPES[group["ns_dtype"]],
        )

    def _orthogonality_due(self, step: int, index: int, n_params: int) -> bool:
        """Every `orthogonality_check_interval` steps (from step 1), check one matrix, round-robin over params."""
        interval = self.orthogonality_check_interval
        return (step - 1) % interval == 0 and index == ((step - 1) // interval) % n_params

    def _adamw_step(self, group: dict[str, Any]) -> None:
        # Same arithmetic as torch.optim.AdamW's single-tensor path, except that the update is materialised
        # (exp_avg / denom) so its RMS can be reported.
        wd, eps = group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        update_sq, numel = torch.zeros(()), 0
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
            lr = group["lr"] * self._lr_scales.get(id(p), 1.0)
            p.mul_(1 - group["lr"] * wd)  # the group's lr: muP's factor leaves the decay as it was
            exp_avg.lerp_(p.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            step_size = lr / (1 - beta1**t)
            denom = (exp_avg_sq.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
            update = exp_avg / denom
            p.add_(update, alpha=-step_size)
            update_sq = update_sq + local_part(update).square().sum() * step_size**2
            numel += p.numel()
        if numel:
            self._update_sq[group["name"]] = (sum_over_shards(update_sq, group["params"]), numel)

    def diagnostics(self) -> dict[str, float]:
        """Flat {"<group>/<metric>": float}: lr, weight_norm, update_rms (the lr-scaled update of the last
        step, weight decay excluded), and for Muon groups ns_orthogonality_error (max |singular value - 1| of one
        Newton-Schulz output, measured every `orthogonality_check_interval` steps; expect ~0.3-0.5 with 5 steps).
        Data-parallel, every rank measures the same gathered outputs, so every rank reports the same figures.
        With FSDP2-sharded parameters the weight norm is measured at the end of step() (summing shards needs every
        rank), so it does not see a change made to the weights after the step, such as QK-Clip's."""
        out: dict[str, float] = {}
        for group in self.param_groups:
            prefix = f"{group['name']}/"
            out[prefix + "lr"] = float(group["lr"])
            weight_sq = self._sharded_weight_sq.get(group["name"])
            if weight_sq is None:
                weight_sq = sum(p.detach().float().square().sum() for p in group["params"])
            out[prefix + "weight_norm"] = float(weight_sq) ** 0.5
            if group["name"] in self._update_sq:
                update_sq, numel = self._update_sq[group["name"]]
                out[prefix + "update_rms"] = (float(update_sq) / numel) ** 0.5
            if group["name"] in self._ortho_error:
                out[prefix + "ns_orthogonality_error"] = self._ortho_error[group["name"]]
        return out


def orthogonality_error(O: Tensor) -> float:
    """max |sigma - 1| over the singular values of one Newton-Schulz output O [A, B]."""
    return float((torch.linalg.svdvals(O.float()) - 1).abs().max())
