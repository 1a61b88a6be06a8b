"""MuonAdamW with its Newton-Schulz spread over 2 gloo ranks equals 1-process MuonAdamW bit for bit, and the work is
really split; the balancing plan on its own."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from k3train.optim import muon as muon_module
from k3train.optim.muon import MuonAdamW
from k3train.optim.muon_distributed import assign_owners, data_parallel_group, newton_schulz_cost

STEPS = 3
SPAWN_TIMEOUT_S = 120  # a hung collective fails the test instead of the suite


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


def test_single_process_does_not_spread() -> None:
    assert not dist.is_initialized()
    assert data_parallel_group(None) is None


# ---- 2 processes ------------------------------------------------------------------------------------------------
# Shapes cover every matrix view Muon has: plain, per-head on rows and on columns, a 3D expert stack; one param
# gets no gradient; one group runs Newton-Schulz in fp32 and one in bf16 (its bits must survive the gather).
MUON_FP32 = [((16, 12), (4, 0)), ((12, 16), (4, 1)), ((3, 8, 12), None), ((30, 12), None), ((20, 20), None)]
MUON_BF16 = [((24, 40), None), ((40, 24), None), ((2, 16, 16), None)]
ADAMW = [(12,), (30, 12)]
NO_GRAD = 4  # index of MUON_FP32's param that never gets a gradient


def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [s for s, _ in MUON_FP32] + [s for s, _ in MUON_BF16] + ADAMW
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _optimizer(params: list[nn.Parameter]) -> MuonAdamW:
    n32, n16 = len(MUON_FP32), len(MUON_BF16)
    return MuonAdamW([
        dict(name="m32", kind="muon", params=params[:n32], head_splits=[h for _, h in MUON_FP32], ns_dtype="fp32"),
        dict(name="m16", kind="muon", params=params[n32:n32 + n16], head_splits=[h for _, h in MUON_BF16],
             ns_dtype="bf16"),
        dict(name="a", kind="adamw", params=params[n32 + n16:]),
    ], lr=0.02, weight_decay=0.1, orthogonality_check_interval=1)


def _train(params: list[nn.Parameter], opt: MuonAdamW) -> None:
    """STEPS steps with the same gradients on every rank, as DDP's all-reduce leaves them."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            p.grad = None if i == NO_GRAD else g
        opt.step()


def _run_counting_newton_schulz() -> dict:
    calls = []
    real = muon_module.zeropower_via_newtonschulz5
    muon_module.zeropower_via_newtonschulz5 = lambda G, *a, **kw: calls.append(tuple(G.shape)) or real(G, *a, **kw)
    try:
        params = _params()
        opt = _optimizer(params)
        _train(params, opt)
    finally:
        muon_module.zeropower_via_newtonschulz5 = real
    return {"params": [p.detach() for p in params], "state": opt.state_dict(), "diagnostics": opt.diagnostics(),
            "calls": calls}


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # as the 1-process reference: the same matmul kernels, so the same bits
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        torch.save(_run_counting_newton_schulz(), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(world_size: int, tmp_path: Path) -> list[dict]:
    ctx = mp.spawn(_rank_main, args=(world_size, str(tmp_path / "init"), str(tmp_path)), nprocs=world_size,
                   join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world_size} ranks did not finish in {SPAWN_TIMEOUT_S} s (a hung collective?)")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"] and a["orthogonality_error"] == b["orthogonality_error"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[n], sb[n]) if torch.is_tensor(sa[n]) else sa[n] == sb[n] for n in sa)


@pytest.mark.slow
def test_two_ranks_equal_one_process_bitwise_and_split_the_work(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _run_counting_newton_schulz()
    finally:
        torch.set_num_threads(threads)
    ranks = _spawn(2, tmp_path)
    initial = _params()
    for rank in ranks:
        assert all(torch.equal(a, b) for a, b in zip(rank["params"], single["params"]))
        _assert_state_equal(rank["state"], single["state"])  # every rank holds the whole state: rank 0 can save it
        assert rank["diagnostics"] == single["diagnostics"]
    assert not torch.equal(ranks[0]["params"][0], initial[0])
    assert torch.equal(ranks[0]["params"][NO_GRAD], initial[NO_GRAD])
    # Each matrix was orthogonalised once, by one rank: the ranks' calls are a split of the 1-process calls.
    calls = [r["calls"] for r in ranks]
    assert len(single["calls"]) == STEPS * (len(MUON_FP32) - 1 + len(MUON_BF16))
    assert sorted(calls[0] + calls[1]) == sorted(single["calls"])
    assert calls[0] and calls[1]
