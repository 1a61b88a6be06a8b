"""Muon's Newton-Schulz spread over data-parallel ranks (used by MuonAdamW in k3train/optim/muon.py).

Under DDP every rank holds the same all-reduced gradients, so every rank would repeat the same Newton-Schulz on
every matrix. Instead each parameter gets one owner rank that orthogonalises it, and one all-gather per param group
hands every rank every result, so all ranks apply the identical update. This follows
KellerJordan/Muon's distributed `Muon` and modded-nanogpt's (rank r orthogonalises its share, then `all_gather`),
with two changes:
- Shares are balanced by Newton-Schulz cost (greedy: largest first, to the least-loaded rank), not round-robin, so
  one 64-expert stack and a few small attention heads do not land on the same rank by chance.
- What is exchanged is the orthogonalised update, not the updated parameter, and every rank keeps the full
  momentum buffers (updating them is element-wise and cheap). So every rank's optimizer state is the whole state,
  identical to a 1-process run's: rank 0 can save it alone and any world size can resume it.
The results travel in the Newton-Schulz dtype (bf16 or fp32) as raw bits, so the exchanged update is exactly the
owner's: a 2-rank step equals a 1-process step bit for bit (tests/test_muon_distributed.py).
Requirements and costs: every rank must hold gradients for the same parameters (DDP's all-reduce sees to it), or
the ranks disagree on the plan and the all-gather fails; the gathered buffer holds a whole group's updates at once
(for k3_small's expert group, ~0.8 GB in fp32), where a 1-process step holds one parameter's.

FSDP2 (parameters that are DTensors sharded on one dim of a 1-D mesh, torch.distributed.fsdp.fully_shard; routed
experts sliced on dim 1 when there are fewer of them than ranks): no rank gathers what it does not orthogonalise.
Each matrix again has one owner among its mesh's ranks, and the owners work in rounds, one matrix each per round:
one all-to-all sends every rank's shard of the round's momenta to their owners, each owner assembles its matrix
and orthogonalises it, and a second all-to-all returns each rank its shard of every update (`exchange_with_owners`;
microsoft/dion's and torchtitan's distributed Muon exchange the same way). A rank receives whole only the matrices
it owns, so the transient is a few of the largest matrix, not the world size times it (Kimi K3's 1,024 ranks
would each have received 1,024 copies of its largest matrix, 500 GB, from one all-gather of whole updates), and a
rank sends and receives its shard of every matrix plus the matrices it owns, not every matrix whole. Each rank's
momentum stays on its shard. Shards travel in the Newton-Schulz dtype (casting is elementwise, so the owner's
matrix is bitwise the 1-process one's cast) and the updates return bit for bit.

Sources: KellerJordan/Muon, modded-nanogpt, dion, torchtitan:
https://github.com/KellerJordan/Muon/blob/857d1adc159e098212f828d927460782d3da59e9/muon.py
https://github.com/KellerJordan/modded-nanogpt/blob/1b51e26d304f647c7c12201b3f1513ee5a429ec4/train_gpt.py
https://github.com/microsoft/dion/blob/0a059a4542e5aa74b40dcd1dce363836c7afcd48/dion/muon.py
https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/distributed/flex_shard/dist_muon.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from k3train.runtime.distributed import chunk_sizes

try:  # DTensor is what FSDP2 makes of a parameter; a torch build without distributed has none.
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover
    DTensor = None

# Recent torch deprecates all_gather_into_tensor in favour of all_gather_single; older torch has only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_all_to_all_single = dist.all_to_all_single  # a module attribute, so tests can count what it sends


def data_parallel_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to spread Newton-Schulz over, or None when there is no other rank to share with: no group given
    (one process: the run's ParallelDims hands None) or a group of one."""
    if process_group is None:
        return None
    return process_group if dist.get_world_size(process_group) > 1 else None


def newton_schulz_cost(matrices_shape: Sequence[int]) -> int:
    """Matmul FLOPs of one Newton-Schulz iteration on a batch of matrices [N, A, B]: per matrix, with a <= b,
    X X^T (2a^2 b), gram^2 (2a^3) and poly X (2a^2 b)."""
    n, a, b = matrices_shape
    a, b = min(a, b), max(a, b)
    return n * (4 * a * a * b + 2 * a**3)


def assign_owners(costs: Sequence[int], world_size: int) -> list[int]:
    """The rank that orthogonalises each item: greedy longest-processing-time (largest cost first, ties by index;
    each to the least-loaded rank, ties to the lowest rank). Deterministic, so every rank computes the same plan."""
    load = [0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def all_gather_outputs(
    mine: dict[int, Tensor],
    shapes: Sequence[torch.Size],
    owners: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
) -> list[Tensor]:
    """Every rank's Newton-Schulz outputs, in item order, from one all-gather.

    `mine` maps item index -> this rank's output of shapes[index]; each rank packs its outputs (in index order)
    into one flat buffer padded to the largest share, and unpacks every rank's buffer with the same plan. The
    bytes travel as uint8, so a bf16 result crosses a gloo group unchanged and arrives bit for bit.
    """
    world = dist.get_world_size(group)
    numels = [torch.Size(s).numel() for s in shapes]
    share = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world)]
    width = max(share)
    send = torch.zeros(width, dtype=dtype, device=device)
    offset = 0
    for i in sorted(mine):
        send[offset : offset + numels[i]] = mine[i].reshape(-1)
        offset += numels[i]
    received = torch.empty(world * width, dtype=dtype, device=device)
    _all_gather_single(received.view(torch.uint8), send.view(torch.uint8), group=group)
    outputs: list[Tensor] = []
    cursor = [r * width for r in range(world)]
    for n, shape, rank in zip(numels, shapes, owners):
        outputs.append(received[cursor[rank] : cursor[rank] + n].view(shape))
        cursor[rank] += n
    return outputs


def exchange_with_owners(
    shapes: Sequence[torch.Size],
    shard_dims: Sequence[int],
    costs: Sequence[int],
    local_input: Callable[[int], Tensor],
    orthogonalise: Callable[[int, Tensor], Tensor],
    dtype: torch.dtype,
    group: dist.ProcessGroup,
) -> Iterator[tuple[int, Tensor]]:
    """Orthogonalise sharded matrices at their owners; yield (item, this rank's shard of its output) per item.

    Item i is a tensor of shapes[i] sharded on shard_dims[i] over `group` (Shard semantics, see chunk_sizes);
    local_input(i) is this rank's shard of it, orthogonalise(i, whole) (called on its owner only) turns the whole
    into an output of the same shape. Owners are balanced by `costs` (assign_owners); each round every owner takes
    its next item, and two all-to-alls (shards in, shards of the outputs back) carry them, as raw bytes in `dtype`
    so that any dtype crosses a gloo group unchanged. A collective: every rank of `group` calls it with the same
    shapes, dims and costs, and consumes every item it yields (a round's items come after its second exchange).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    owners = assign_owners(costs, world)
    queues = [[i for i, o in enumerate(owners) if o == r] for r in range(world)]
    rows = [chunk_sizes(shape[d], world) for shape, d in zip(shapes, shard_dims)]

    def shard_shape(i: int, r: int) -> torch.Size:
        shape = list(shapes[i])
        shape[shard_dims[i]] = rows[i][r]
        return torch.Size(shape)

    def nbytes(i: int, r: int) -> int:
        return shard_shape(i, r).numel() * dtype.itemsize

    for round_ in range(max(map(len, queues))):
        items = [q[round_] if round_ < len(q) else None for q in queues]  # owner rank -> its item this round
        send = [local_input(i).to(dtype).reshape(-1) for i in items if i is not None]
        device = send[0].device  # an owner-less rank's empty buffer goes there too: NCCL takes no CPU tensor
        for i, part in zip((i for i in items if i is not None), send):
            if part.numel() != shard_shape(i, rank).numel():
                raise RuntimeError(f"item {i}: this rank's shard has {part.numel()} elements, expected the Shard "
                                   f"layout's {tuple(shard_shape(i, rank))}")  # fmt: skip
        mine = items[rank]
        received = _exchange(
            torch.cat(send),
            [0 if i is None else nbytes(i, rank) for i in items],
            [0 if mine is None else nbytes(mine, r) for r in range(world)],
            group,
        ).view(dtype)
        del send
        outputs: list[Tensor] = []
        if mine is not None:
            pieces = received.split([shard_shape(mine, r).numel() for r in range(world)])
            whole = torch.cat([x.view(shard_shape(mine, r)) for r, x in enumerate(pieces)], dim=shard_dims[mine])
            del received, pieces
            out = orthogonalise(mine, whole).to(dtype)
            del whole
            outputs = [x.contiguous().reshape(-1) for x in out.split(rows[mine], dim=shard_dims[mine])]
            del out
        returned = _exchange(
            torch.cat(outputs) if outputs else torch.empty(0, dtype=dtype, device=device),
            [0 if mine is None else nbytes(mine, r) for r in range(world)],
            [0 if i is None else nbytes(i, rank) for i in items],
            group,
        ).view(dtype)
        del outputs
        offset = 0
        for i in items:
            if i is not None:
                n = shard_shape(i, rank).numel()
                yield i, returned[offset : offset + n].view(shard_shape(i, rank))
                offset += n


def _exchange(send: Tensor, send_bytes: list[int], receive_bytes: list[int], group: dist.ProcessGroup) -> Tensor:
    """One all-to-all of raw bytes: send_bytes[r] of `send` to rank r, receive_bytes[r] from it (uint8)."""
    received = torch.empty(sum(receive_bytes), dtype=torch.uint8, device=send.device)
    if send.numel() == 0 and dist.get_backend(group) == "fake":
        return received  # a dry run (k3train/run/dry_run.py): torch's fake group refuses an empty send; sizes count
    _all_to_all_single(received, send.view(torch.uint8), receive_bytes, send_bytes, group=group)
    return received


def is_sharded(t: Tensor) -> bool:
    """A DTensor (an FSDP2 parameter, its gradient or a state tensor made like it)."""
    return DTensor is not None and isinstance(t, DTensor)


def check_fsdp_layout(t: Tensor) -> None:
    """Only FSDP2's layouts are supported: sharded on one dim (0; 1 for routed experts) over one mesh dimension,
    replicated over any other (HSDP's replicas, which hold the same shards and so take the same updates)."""
    shards = [pl for pl in t.placements if isinstance(pl, Shard)]
    if len(shards) != 1 or any(not (isinstance(pl, Shard) or pl.is_replicate()) for pl in t.placements):
        raise NotImplementedError(
            f"MuonAdamW supports DTensor parameters sharded on one dim over one mesh dimension and replicated over "
            f"the others (FSDP2's fully_shard, HSDP); got placements {t.placements} on a {t.device_mesh.ndim}-D mesh"
        )


def shard_placement(t: Tensor) -> tuple[int, int]:
    """(mesh dimension, tensor dim) an FSDP2 or HSDP DTensor is sharded over and on (check_fsdp_layout's form)."""
    check_fsdp_layout(t)
    return next((m, pl.dim) for m, pl in enumerate(t.placements) if isinstance(pl, Shard))


def shard_group(t: Tensor) -> dist.ProcessGroup:
    """The ranks holding the other shards of an FSDP2 or HSDP DTensor: its sharded mesh dimension's group (the
    replicas beside them hold the same shards again)."""
    return t.device_mesh.get_group(shard_placement(t)[0])


def local_part(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor as a plain tensor, or t itself."""
    return t.to_local() if is_sharded(t) else t


def holds_whole_experts(p: Tensor) -> bool:
    """Of an expert-parallel weight: whether this rank holds each of its experts whole: plain, or FSDP2-sharded on
    dim 0 (the experts); on dim 1 each rank holds a slice of every expert."""
    return not is_sharded(p) or shard_placement(p)[1] == 0


def muon_placement(*, sharded: bool, expert_parallel: bool, whole_experts: bool, data_parallel: bool) -> str:
    """Where MuonAdamW orthogonalises a parameter, from what a rank holds of it (MuonAdamW asks it of each tensor,
    k3train/plan/muon.py of each planned one):
    - "owners": an FSDP2 shard (`sharded`), other ranks holding the rest of each matrix: one owner per matrix on its
      mesh (exchange_with_owners), but for expert-parallel weights this rank holds whole experts of
      (`whole_experts`: FSDP2 shards them on dim 0);
    - "own": this rank's own whole experts (`expert_parallel`: no other rank of its mesh holds them), or any
      parameter when there is no other data-parallel rank to share with (`data_parallel` false);
    - "replicated": the same on every data-parallel rank (DDP): shared out, then all-gathered (all_gather_outputs).
    """
    if sharded and not (expert_parallel and whole_experts):
        return "owners"
    if expert_parallel or not data_parallel:
        return "own"
    return "replicated"


def global_square_sum(
    params: Sequence[Tensor], expert_shards: frozenset[int] = frozenset(), expert_group: dist.ProcessGroup | None = None
) -> Tensor:
    """The sum of squares of the whole `params`: FSDP2 shards summed over their mesh, expert-parallel ones (ids in
    `expert_shards`) also over the ranks holding the other experts, `expert_group` (a collective: every rank calls
    it, in step())."""
    total = torch.zeros(())
    for kind in (False, True):
        some = [p for p in params if (id(p) in expert_shards) == kind]
        if some:
            sq = sum_over_shards(sum(local_part(p.detach()).float().square().sum() for p in some), some)
            if kind:
                sq = sq.clone()
                dist.all_reduce(sq, group=expert_group)
            total = total + sq
    return total


def sum_over_shards(local_sum: Tensor, params: Sequence[Tensor]) -> Tensor:
    """A sum over the local shards of `params` made the sum over the whole parameters: all-reduced over their
    mesh (a collective: called by every rank in step(), never in diagnostics(), which may run on rank 0 only).
    Unchanged when no parameter is sharded."""
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return local_sum
    if len(sharded) != len(params):
        raise NotImplementedError(
            "a MuonAdamW param group mixes FSDP2-sharded (DTensor) and plain parameters; "
            "shard the whole model with fully_shard or none of it"
        )
    total = local_sum.clone()
    dist.all_reduce(total, group=shard_group(sharded[0]))
    return total
