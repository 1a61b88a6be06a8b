"""Expert parallelism's token exchange (k3train/models/k3/expert_parallel.py) on 2 gloo ranks against one process:
each rank holds half the routed experts and sends its token slots to them by all-to-all. The MoE output of each
rank's batch, the gradient of every weight it holds and the Quantile-Balancing bias (quantiles over both ranks'
tokens) equal the one-process MoE's on the same batches, for the plain and the latent (K3) MoE."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from k3train.models.k3.moe import MoE

from helpers.spawn import spawn_ranks

D, E, K = 32, 8, 2
CASES = {
    "swiglu": dict(),
    "k3_latent_situ": dict(latent_dim=16, activation="situ"),
}


def make_moe(case: str) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, E, K, expert_ffn_dim=32, n_shared_experts=1, **CASES[case]).double()
    with torch.no_grad():
        moe.expert_bias.copy_(0.1 * torch.randn(E, dtype=torch.float64))
    return moe


def batch(rank: int) -> torch.Tensor:
    return torch.randn(2, 24, D, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def cotangent(rank: int) -> torch.Tensor:
    return torch.randn(2, 24, D, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64)


def run(moe: MoE, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """One training-mode pass (the bias moves) and a backward of `grad`."""
    y = moe(x)
    y.backward(grad)
    return {
        "y": y.detach(),
        "grads": {n: p.grad.clone() for n, p in moe.named_parameters()},
        "bias": moe.expert_bias.clone(),
    }


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    from k3train.models.k3.expert_parallel import shard_experts

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        out = {}
        for case in CASES:
            moe = make_moe(case)
            moe.process_group = dist.group.WORLD  # Quantile Balancing over both ranks' tokens
            shard_experts(moe, dist.group.WORLD)
            out[case] = run(moe, batch(rank), cotangent(rank))
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp_path = tmp_path_factory.mktemp("ep-2-ranks")
    return spawn_ranks(_rank_main, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_with_half_the_experts_each_equal_one_process(two_ranks: list[dict], case: str) -> None:
    # one process on both batches at once: the same routing, the same quantiles over all tokens
    moe = make_moe(case)
    want = run(moe, torch.cat([batch(0), batch(1)]), torch.cat([cotangent(0), cotangent(1)]))
    half = E // 2
    for rank, got in enumerate(r[case] for r in two_ranks):
        torch.testing.assert_close(got["y"], want["y"][2 * rank : 2 * rank + 2], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["bias"], want["bias"], rtol=1e-10, atol=1e-12)
        for name, g in got["grads"].items():
            if name.startswith("experts."):  # this rank's experts: every token that chose them, from both ranks
                torch.testing.assert_close(
                    g, want["grads"][name][rank * half : (rank + 1) * half], rtol=1e-10, atol=1e-12
                )
    for name, g in want["grads"].items():  # the rest: each rank's share, which DDP's all-reduce sums
        if not name.startswith("experts."):
            total = two_ranks[0][case]["grads"][name] + two_ranks[1][case]["grads"][name]
            torch.testing.assert_close(total, g, rtol=1e-10, atol=1e-12, msg=name)
    assert two_ranks[0][case]["grads"]["experts.w_gate"].shape[0] == half


def test_experts_that_do_not_split_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from k3train.models.k3.expert_parallel import shard_experts

    # a stand-in group of 3 ranks: the check comes before any communication
    monkeypatch.setattr(dist, "get_world_size", lambda group: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)
    with pytest.raises(ValueError, match="8 routed experts do not split over parallel.ep=3"):
        shard_experts(make_moe("swiglu"), object())
