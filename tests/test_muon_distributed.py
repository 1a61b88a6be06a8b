"""MuonAdamW with its Newton-Schulz spread over gloo ranks equals 1-process MuonAdamW bit for bit, with replicated
parameters (DDP, 2 ranks) and with FSDP2-sharded ones (2 ranks; 3 ranks with uneven shards and slices on dim 1, where
each rank must receive whole only the matrices it owns), and the work is really split; the balancing plan alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from k3train.optim import muon as muon_module
from k3train.optim import muon_distributed
from k3train.optim.muon import MuonAdamW
from k3train.optim.muon_distributed import assign_owners, data_parallel_group, newton_schulz_cost
from k3train.runtime.distributed import chunk_sizes

from helpers.spawn import spawn_ranks

STEPS = 3


def test_assign_owners_balances_cost_deterministically() -> None:
    costs = [100, 1, 1, 1, 50, 49, 3]
    owners = assign_owners(costs, 2)
    assert owners == assign_owners(costs, 2)  # every rank computes the same plan
    load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert sorted(load) == [102, 103]  # round-robin over this order would give 153 / 52
    assert owners[0] != owners[4] and owners[0] != owners[5]  # the big one shares its rank with small ones only
    assert assign_owners(costs, 1) == [0] * len(costs)
    assert sorted(set(assign_owners([5] * 8, 4))) == [0, 1, 2, 3]


def test_newton_schulz_cost_is_symmetric_in_a_matrix_transpose() -> None:
    assert newton_schulz_cost((1, 8, 32)) == newton_schulz_cost((1, 32, 8)) == 4 * 8 * 8 * 32 + 2 * 8**3
    assert newton_schulz_cost((64, 8, 32)) == 64 * newton_schulz_cost((1, 8, 32))


def test_chunk_sizes_follow_dtensor_shard() -> None:
    from torch.distributed.tensor import Shard

    for size in (0, 1, 5, 8, 10, 16):
        for world in (1, 2, 3, 4, 6):
            want = [len(c) for c in Shard(0)._split_tensor(torch.empty(size), world, with_padding=False)[0]]
            assert chunk_sizes(size, world) == want, (size, world)


def test_spread_only_over_the_group_handed_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # even with torch.distributed up ...
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group == "pair" else 1)
    assert data_parallel_group(None) is None  # ... no group handed in: Newton-Schulz alone, no collective
    assert data_parallel_group("one") is None  # a group of one rank: nobody to share with
    assert data_parallel_group("pair") == "pair"


# ---- 2 processes ------------------------------------------------------------------------------------------------
# Shapes cover every matrix view Muon has: plain, per-head on rows and on columns, a 3D expert stack (its dim 1
# divides by 2 and 3: FSDP2 slices no other way); one param gets no gradient; one group runs Newton-Schulz in fp32
# and one in bf16 (its bits must survive the exchange).
MUON_FP32 = [((16, 12), (4, 0)), ((12, 16), (4, 1)), ((3, 6, 12), None), ((30, 12), None), ((20, 20), None)]
MUON_BF16 = [((24, 40), None), ((40, 24), None), ((2, 12, 16), None)]
ADAMW = [(12,), (30, 12)]
NO_GRAD = 4  # index of MUON_FP32's param that never gets a gradient


def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [s for s, _ in MUON_FP32] + [s for s, _ in MUON_BF16] + ADAMW
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _optimizer(params: list[nn.Parameter], process_group=None) -> MuonAdamW:
    n32, n16 = len(MUON_FP32), len(MUON_BF16)
    return MuonAdamW(
        [
            dict(name="m32", kind="muon", params=params[:n32], head_splits=[h for _, h in MUON_FP32], ns_dtype="fp32"),
            dict(
                name="m16",
                kind="muon",
                params=params[n32 : n32 + n16],
                head_splits=[h for _, h in MUON_BF16],
                ns_dtype="bf16",
            ),
            dict(name="a", kind="adamw", params=params[n32 + n16 :]),
        ],
        lr=0.02,
        weight_decay=0.1,
        orthogonality_check_interval=1,
        process_group=process_group,
    )


def _run_counting_newton_schulz(params: list[nn.Parameter] | None = None, grad_layout=lambda g, p: g) -> dict:
    """Train _params() (or the given ones, e.g. FSDP2-sharded), counting Newton-Schulz calls; what came out, as
    plain tensors. grad_layout(g, p) turns a full gradient into what p.grad holds on this rank."""
    calls = []
    real = muon_module.zeropower_via_newtonschulz5
    muon_module.zeropower_via_newtonschulz5 = lambda G, *a, **kw: calls.append(tuple(G.shape)) or real(G, *a, **kw)
    try:
        params = _params() if params is None else params
        opt = _optimizer(params, dist.group.WORLD if dist.is_initialized() else None)
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):  # the same gradients on every rank, as DDP's all-reduce leaves them
            for i, p in enumerate(params):
                g = torch.randn(p.shape, generator=gen)
                p.grad = None if i == NO_GRAD else grad_layout(g, p)
            opt.step()
    finally:
        muon_module.zeropower_via_newtonschulz5 = real
    return {
        "params": [full_matrix(p.detach()) for p in params],
        "diagnostics": opt.diagnostics(),
        "calls": calls,
        "momentum": [
            full_matrix(opt.state[p]["momentum_buffer"]) if "momentum_buffer" in opt.state[p] else None for p in params
        ],
        "steps": [opt.state[p].get("step") for p in params],
        "orthogonality": opt.state_dict()["orthogonality_error"],
    }


def full_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fsdp2_params(world_size: int, expert_slices: bool = False) -> tuple[list[nn.Parameter], object]:
    """_params() as FSDP2 makes them: DTensors sharded on dim 0, or with expert_slices the 3D stacks on dim 1 (as
    k3train/train/parallel.py slices routed experts when there are fewer than ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world_size,))
    holder = nn.Module()
    for i, p in enumerate(_params()):
        holder.register_parameter(f"p{i}", p)
    fully_shard(holder, mesh=mesh, shard_placement_fn=lambda p: Shard(1 if expert_slices and p.ndim == 3 else 0))
    return list(holder.parameters()), mesh


def _rank_main(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import distribute_tensor

    ddp = _run_counting_newton_schulz()
    params, mesh = _fsdp2_params(world_size)
    fsdp2 = _run_counting_newton_schulz(  # this rank's shard of the full gradient, as FSDP2's reduce-scatter
        params, lambda g, p: distribute_tensor(g, mesh, p.placements, src_data_rank=None)
    )
    return {"ddp": ddp, "fsdp2": fsdp2}


def _three_ranks_main(rank: int, world_size: int) -> dict:
    """FSDP2 with uneven shards and slices on dim 1; what each rank sent to and received from the others."""
    from torch.distributed.tensor import distribute_tensor

    params, mesh = _fsdp2_params(world_size, expert_slices=True)
    exchanged = []
    real = muon_distributed._all_to_all_single

    def counting(output, input, output_split_sizes, input_split_sizes, group=None):
        exchanged.append((list(output_split_sizes), list(input_split_sizes)))
        return real(output, input, output_split_sizes, input_split_sizes, group=group)

    muon_distributed._all_to_all_single = counting
    gathers = []
    full_tensor = type(params[0]).full_tensor
    type(params[0]).full_tensor = lambda self: gathers.append(self.shape) or full_tensor(self)
    try:
        run = _run_counting_newton_schulz(
            params, lambda g, p: distribute_tensor(g, mesh, p.placements, src_data_rank=None)
        )
    finally:
        muon_distributed._all_to_all_single = real
        type(params[0]).full_tensor = full_tensor
    # what the run hands back (every parameter, every momentum) is gathered once at the end, by the test
    gathered_by_the_step = len(gathers) - len(params) - sum(m is not None for m in run["momentum"])
    return {**run, "exchanged": exchanged, "placements": [p.placements[0].dim for p in params],
            "gathered_by_the_step": gathered_by_the_step}  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both cases on 2 gloo ranks, from one spawn (starting processes is most of the cost)."""
    tmp_path = tmp_path_factory.mktemp("muon-2-ranks")
    return spawn_ranks(_rank_main, tmp_path)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ranks(_three_ranks_main, tmp_path_factory.mktemp("muon-3-ranks"), nprocs=3)


@pytest.fixture(scope="module")
def one_process() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_counting_newton_schulz()
    finally:
        torch.set_num_threads(threads)


def _assert_same_training(got: dict, single: dict) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got["params"], single["params"]))
    # every rank holds the whole optimizer state (rank 0 can save it alone): the same as 1 process's
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(got["momentum"], single["momentum"]))
    assert got["steps"] == single["steps"] and got["orthogonality"] == single["orthogonality"]
    initial = _params()
    assert not torch.equal(got["params"][0], initial[0])
    assert torch.equal(got["params"][NO_GRAD], initial[NO_GRAD])


def _assert_work_split(ranks: list[dict], single: dict) -> None:
    """Each matrix was orthogonalised once, by one rank: the ranks' calls are a split of the 1-process calls."""
    calls = [r["calls"] for r in ranks]
    assert len(single["calls"]) == STEPS * (len(MUON_FP32) - 1 + len(MUON_BF16))
    assert sorted(calls[0] + calls[1]) == sorted(single["calls"])
    assert calls[0] and calls[1]


@pytest.mark.slow
def test_two_ranks_equal_one_process_bitwise_and_split_the_work(two_ranks: list[dict], one_process: dict) -> None:
    for rank in two_ranks:
        _assert_same_training(rank["ddp"], one_process)
        assert rank["ddp"]["diagnostics"] == one_process["diagnostics"]
    _assert_work_split([r["ddp"] for r in two_ranks], one_process)


@pytest.mark.slow
def test_fsdp2_sharded_params_equal_one_process_bitwise(two_ranks: list[dict], one_process: dict) -> None:
    for rank in two_ranks:
        _assert_same_training(rank["fsdp2"], one_process)
        diag = rank["fsdp2"]["diagnostics"]
        assert diag.keys() == one_process["diagnostics"].keys()
        for key, value in diag.items():
            # the Muon figures come from the gathered outputs (identical); AdamW's update RMS and the weight norms
            # are sums of per-shard sums, added in another order than 1 process's
            assert value == pytest.approx(one_process["diagnostics"][key], rel=1e-5), key
    assert two_ranks[0]["fsdp2"]["diagnostics"] == two_ranks[1]["fsdp2"]["diagnostics"]
    _assert_work_split([r["fsdp2"] for r in two_ranks], one_process)


@pytest.mark.slow
def test_fsdp2_owners_receive_only_what_they_orthogonalise(three_ranks: list[dict], one_process: dict) -> None:
    """3 ranks, shards of 6/6/4 rows and the like, expert stacks sliced on dim 1: the same training bit for bit, and
    the bytes exchanged are exactly each owner's whole matrices in and every rank's shards back; nothing is
    gathered whole (DTensor.full_tensor) by the step."""
    assert three_ranks[0]["placements"][2] == 1 and three_ranks[0]["placements"][0] == 0
    for rank in three_ranks:
        _assert_same_training(rank, one_process)
        for key, value in rank["diagnostics"].items():
            assert value == pytest.approx(one_process["diagnostics"][key], rel=1e-5), key
        assert rank["gathered_by_the_step"] == 0
    assert three_ranks[0]["diagnostics"] == three_ranks[1]["diagnostics"] == three_ranks[2]["diagnostics"]
    calls = [r["calls"] for r in three_ranks]
    assert sorted(calls[0] + calls[1] + calls[2]) == sorted(one_process["calls"]) and all(calls)

    groups = [(MUON_FP32, 4), (MUON_BF16, 2)]  # (params, Newton-Schulz bytes per element)
    for rank, got in enumerate(three_ranks):
        received_whole, shards, sent_back = 0, 0, 0
        for params, itemsize in groups:
            with_grad = [(s, h) for n, (s, h) in enumerate(params) if not (params is MUON_FP32 and n == NO_GRAD)]
            costs = [newton_schulz_cost(_matrices(s, h)) for s, h in with_grad]
            owners = assign_owners(costs, 3)
            for (shape, _), owner in zip(with_grad, owners):
                dim = 1 if len(shape) == 3 else 0
                rows = chunk_sizes(shape[dim], 3)
                numel = torch.Size(shape).numel()
                shards += numel // shape[dim] * rows[rank] * itemsize
                if owner == rank:
                    received_whole += numel * itemsize
                    sent_back += numel * itemsize
        exchanged = got["exchanged"]
        to_owners, back = exchanged[0::2], exchanged[1::2]  # each round: shards in, then the updates back
        assert sum(sum(o) for o, _ in to_owners) == STEPS * received_whole
        assert sum(sum(i) for _, i in to_owners) == STEPS * shards
        assert sum(sum(i) for _, i in back) == STEPS * sent_back
        assert sum(sum(o) for o, _ in back) == STEPS * shards
        # a round's largest receipt is one whole matrix, never the world's share of them
        largest = max(torch.Size(s).numel() * itemsize for params, itemsize in groups for s, _ in params)
        assert max(sum(o) for o, _ in to_owners) <= largest


def _matrices(shape: tuple[int, ...], head_split) -> torch.Size:
    return muon_module.as_matrices(torch.empty(shape, device="meta"), head_split).shape
