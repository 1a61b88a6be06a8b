"""How MuonAdamW shares out its Newton-Schulz on a mesh (k3train/optim/muon.py, muon_distributed.py), per Muon
group: which ranks orthogonalise what, the bytes they exchange, the FLOPs of the busiest rank and the largest buffers.

A group's parameters fall into shares, each handled one way (the optimizer's muon_placement decides which,
k3train/optim/muon_distributed.py):
- "own": expert-parallel weights whose experts a rank holds whole (plain under DDP, dim 0 under FSDP2): each rank
  orthogonalises its own, alone; nothing is exchanged.
- "owners": FSDP2 shards (every parameter under FSDP2 but whole local experts; routed experts sliced on dim 1 when
  fewer remain than ranks, a share of their own over the dp_shard / ep ranks holding them): one owner per matrix
  (balanced by cost), in rounds of one matrix per owner, each round two all-to-alls of the Newton-Schulz dtype: every
  rank's shard to the owners, and each owner's update back, one shard a rank.
- "all-gather": replicated parameters ("replicated": DDP): owners the same way, then one all-gather of every
  owner's outputs, ranks x the largest share.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from k3train.optim.muon_distributed import assign_owners, muon_placement, newton_schulz_cost
from k3train.plan.mesh import Mesh, rank_rows, row_breaks
from k3train.plan.spec import Param, RunSpec
from k3train.runtime.parallel_layout import expert_shard_dim

NS_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class MuonShare:
    how: str  # "own", "owners" or "all-gather"
    ranks: int  # the ranks that share it out (1: "own")
    payload: float  # bytes the busiest rank hands to torch.distributed per step: the all-gather's output, or the
    # all-to-alls' inputs (its shard of every matrix, then the whole updates of the matrices it owns)
    calls: int  # collectives per step
    flops_per_rank: float  # the most Newton-Schulz FLOPs a rank does for it (one update)
    transient: float  # the most bytes its exchange holds at once on a rank (beside Newton-Schulz's own iterates)
    routed: bool  # routed experts (their groups stride over ep)
    # "owners": each rank's all-to-all inputs in rank order as (bytes, ranks) runs, a few at any rank count (payload
    # is the largest)
    sent: tuple[tuple[float, int], ...] = ()

    def sent_by(self, rank: int) -> float:
        """Rank `rank`'s all-to-all inputs ("owners")."""
        first = 0
        for value, count in self.sent:
            first += count
            if rank < first:
                return value
        raise IndexError(f"rank {rank} of {first}")


def muon_groups(spec: RunSpec) -> list[str]:
    return sorted({p.group for p in spec.params if p.kind == "muon"})


# A group's shares depend on its parameters and the mesh's data-parallel shape, not on the recipe (precision,
# batch, checkpointing, cp), and take about a second at 1,024 ranks; a plan asks for them three times (memory,
# communication, time) and the recipe search (search.py) once per recipe on the same meshes. Kept with the
# parameters they were worked out for, so that an id reused by a later tuple never answers for it.
_SHARES: dict[tuple, tuple[tuple[Param, ...], list[MuonShare]]] = {}
_SHARES_KEPT = 4096


def muon_shares(spec: RunSpec, mesh: Mesh, group: str, ns_steps: int = 5, device_type: str = "cuda") -> list[MuonShare]:
    """The shares of one Muon group on `mesh` (module docstring), in the order the optimizer takes them."""
    key = (id(spec.params), spec.ns_dtype, mesh.dp_replicate, mesh.dp_shard, mesh.ep, group, ns_steps, device_type)
    kept = _SHARES.get(key)
    if kept is None or kept[0] is not spec.params:
        if len(_SHARES) >= _SHARES_KEPT:
            _SHARES.clear()
        kept = _SHARES[key] = (spec.params, _muon_shares(spec, mesh, group, ns_steps, device_type))
    return list(kept[1])


def _muon_shares(spec: RunSpec, mesh: Mesh, group: str, ns_steps: int, device_type: str) -> list[MuonShare]:
    members = [p for p in spec.params if p.kind == "muon" and p.group == group]
    element = NS_BYTES[spec.ns_dtype]
    placed = [(p, placement(p, mesh)) for p in members]
    own = [p for p, where in placed if where == "own"]
    owners = [p for p, where in placed if where == "owners"]
    replicated = [p for p, where in placed if where == "replicated"]
    shares = []
    if own:  # a rank's own experts, or every parameter in one process (ep is 1 there)
        flops = ns_steps * sum(newton_schulz_cost(_local_matrices(p, mesh)) for p in own)
        shares.append(MuonShare("own", 1, 0.0, 0, flops, 0.0, mesh.ep > 1))
    sliced = [p for p in owners if _expert_parallel(p, mesh)]
    dense = [p for p in owners if not _expert_parallel(p, mesh)]
    for some, ranks, dim in ((dense, mesh.dp_shard, 0), (sliced, mesh.expert_shard, 1)):
        if some:
            shares.append(_owners(some, mesh, ranks, dim, element, ns_steps))
    if replicated:
        shares.append(_all_gather(replicated, mesh, element, ns_steps, device_type))
    return shares


def placement(p: Param, mesh: Mesh) -> str:
    """Where MuonAdamW orthogonalises `p` on `mesh`: the optimizer's own rule (muon_distributed.muon_placement),
    asked of what the mesh makes of `p`. Under FSDP2 every parameter is sharded but the experts FSDP2 leaves whole
    per rank (or ignores, expert_shard 1: whole too)."""
    return muon_placement(
        sharded=mesh.dp_shard > 1,
        expert_parallel=_expert_parallel(p, mesh),
        whole_experts=experts_whole(p, mesh),
        data_parallel=mesh.world > 1,
    )


def _expert_parallel(p: Param, mesh: Mesh) -> bool:
    return p.routed and mesh.ep > 1


def _owners(params: list[Param], mesh: Mesh, ranks: int, dim: int, element: int, ns_steps: int) -> MuonShare:
    """k3train/optim/muon_distributed.exchange_with_owners over `ranks`, shards on `dim` of each (local) tensor."""
    shapes = tuple(_local_shape(p, mesh) for p in params)
    matrices = tuple(_local_matrices(p, mesh) for p in params)
    return _owners_of(shapes, matrices, ranks, dim, element, ns_steps)


# The same tensors over the same ranks share out the same way: FSDP's non-expert parameters on 1 x N x ep for every
# ep, which the recipe search plans side by side. Keyed by the shapes themselves (a few thousand tuples to hash).
_OWNERS: dict[tuple, MuonShare] = {}


def _owners_of(
    shapes: tuple[tuple[int, ...], ...], matrices: tuple, ranks: int, dim: int, element: int, ns_steps: int
) -> MuonShare:
    key = (shapes, matrices, ranks, dim, element, ns_steps)
    if key in _OWNERS:
        return _OWNERS[key]
    costs = [newton_schulz_cost(m) for m in matrices]
    owners = owners_of(costs, ranks)
    whole = [math.prod(s) * element for s in shapes]
    row_bytes = [math.prod(s) // s[dim] * element for s in shapes]  # one row on `dim`, as DTensor's Shard lays out

    def kinds_of(items) -> Counter:
        """Tensors of the same row bytes and rows are laid out alike: each kind is summed once (thousands of
        tensors, a few dozen kinds)."""
        return Counter((row_bytes[i], shapes[i][dim]) for i in items)

    def shard_bytes_at(kinds: Counter, rank: int) -> int:
        """Rank `rank`'s bytes of the shards of the tensors `kinds` counts. Never more on a later rank: torch.chunk
        gives the first ranks the most rows."""
        return sum(count * row * rank_rows(size, ranks, rank) for (row, size), count in kinds.items())

    queues: list[list[int]] = [[] for _ in range(min(ranks, len(costs)))]  # the ranks past these own nothing
    for i, owner in enumerate(owners):
        queues[owner].append(i)
    every = kinds_of(range(len(shapes)))
    sent = _runs([shard_bytes_at(every, r) + sum(whole[i] for i in queue) for r, queue in enumerate(queues)])
    # the owner-less ranks send their shards only: constant between the ranks where some kind's rows change
    breaks = sorted({b for kind in every for b in row_breaks(kind[1], ranks) if len(queues) < b < ranks})
    starts = [len(queues), *breaks]
    for start, end in zip(starts, [*breaks, ranks]):
        if start < end:
            sent = _runs([shard_bytes_at(every, start)], end - start, sent)
    load = [sum(costs[i] for i in queue) for queue in queues]
    rounds = max(len(q) for q in queues)
    largest_round = 0.0
    for j in range(rounds):  # alive: the owner's matrix twice (received, assembled; then its update and the copy
        # sent back) and a rank's shards of the round's matrices twice (to send, then returned); rank 0's the most
        items = [q[j] for q in queues if j < len(q)]
        largest_round = max(largest_round, 2 * max(whole[i] for i in items) + 2 * shard_bytes_at(kinds_of(items), 0))
    if len(_OWNERS) >= _SHARES_KEPT:
        _OWNERS.clear()
    share = _OWNERS[key] = MuonShare(
        "owners", ranks, max(v for v, _ in sent), 2 * rounds, ns_steps * max(load), largest_round, dim == 1, sent
    )
    return share


def owners_of(costs: list[int], ranks: int) -> list[int]:
    """k3train/optim/muon_distributed.assign_owners(costs, ranks), without a load for every rank: its greedy gives
    each item the lowest least-loaded rank, and while item j is placed some rank up to j is still empty, so no item
    goes past rank len(costs) - 1, and the same greedy over that many ranks places every item alike."""
    return assign_owners(costs, min(ranks, len(costs)))


def _runs(values: list[float], count: int = 1, runs: tuple = ()) -> tuple[tuple[float, int], ...]:
    """`runs` ((value, ranks), in rank order) followed by each of `values` for `count` ranks, equal neighbours
    merged."""
    out = list(runs)
    for v in values:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + count)
        else:
            out.append((v, count))
    return tuple(out)


def _all_gather(params: list[Param], mesh: Mesh, element: int, ns_steps: int, device_type: str) -> MuonShare:
    """k3train/optim/muon_distributed.all_gather_outputs over every rank: alive at the gather, the received buffer,
    this rank's outputs and its padded send buffer, and on gloo (a CPU) a flat copy of the received one
    (benchmarks/bench_plan.py measured them on 2 ranks)."""
    ranks = mesh.world
    costs = [newton_schulz_cost(p.matrices) for p in params]
    owners = owners_of(costs, ranks)
    owning = range(min(ranks, len(costs)))  # the other ranks own nothing: a share of 0
    share = [sum(p.numel for p, o in zip(params, owners) if o == r) for r in owning]
    load = [sum(c for c, o in zip(costs, owners) if o == r) for r in owning]
    payload = ranks * max(share) * element
    transient = payload * (ranks + 2) / ranks + (payload if device_type == "cpu" else 0.0)
    return MuonShare("all-gather", ranks, payload, 1, ns_steps * max(load), transient, False)


def _local_shape(p: Param, mesh: Mesh) -> tuple[int, ...]:
    """The tensor a rank's optimizer sees as the parameter's whole: its ep share of the routed experts."""
    if not _expert_parallel(p, mesh):
        return tuple(p.shape)
    return (p.shape[0] // mesh.ep, *p.shape[1:])


def _local_matrices(p: Param, mesh: Mesh) -> tuple[int, int, int]:
    n, a, b = p.matrices
    if not _expert_parallel(p, mesh):
        return (n, a, b)
    return (n // mesh.ep // (mesh.expert_shard if experts_whole(p, mesh) else 1), a, b)


def experts_whole(p: Param, mesh: Mesh) -> bool:
    """Whether FSDP2 shards a routed-expert weight's local experts whole (dim 0) over the ranks holding them, as the
    model's parallelize decides it (k3train/runtime/parallel_layout.expert_shard_dim), else on dim 1 (see
    memory.shard_bytes)."""
    return expert_shard_dim(p.shape[0] // mesh.ep, mesh.expert_shard) == 0
