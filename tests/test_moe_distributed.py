"""MoE balancing over data-parallel ranks: 2 gloo ranks, each on its half of a global batch, against one process on
the whole batch. One spawn runs every 2-rank scenario (module fixture); the tests below compare its parts."""

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from k3train.models.k3 import KimiK3
from k3train.models.k3.moe import BALANCING, MoE

from helpers.tiny_k3 import TINY

pytestmark = pytest.mark.slow  # spawns processes

WORLD = 2
D, N_EXP, K = 16, 8, 2
ROUTE_STEPS, TOKENS = 6, 512  # global tokens per routing step: 256 per rank
MOE_STEPS, MOE_B, MOE_T = 5, 8, 32
# The KimiK3 of these tests is helpers.tiny_k3.TINY: 4 experts top-2, so m + 1 = N k / n + 1 exceeds a rank's N
# and every rank sends all its r (the other gather branch).
K3_STEPS, K3_B, K3_T = 3, 4, 32
# Each rank keeps the bias it computed, so a rank that disagreed shows instead of being overwritten by rank 0's
# (torch 2.13 renamed the flag; the sync at DDP's start that it keeps copies fresh zero biases).
NO_BUFFER_SYNC = {
    (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else "broadcast_buffers"
    ): False
}


def rank_rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank r's share of a global batch: rows r*B/W .. (r+1)*B/W - 1, as k3train's loaders slice it."""
    return t.chunk(WORLD)[rank]


def route_logits(step: int) -> torch.Tensor:
    """[TOKENS, N_EXP] logits skewed over experts, so the bias has real work to do; the two halves (ranks) are
    skewed in opposite directions, so a bias from one rank's tokens is far from the global one."""
    g = torch.Generator().manual_seed(100 + step)
    skew = torch.linspace(-2, 2, N_EXP)
    return torch.randn(TOKENS, N_EXP, generator=g) + torch.cat(
        [skew.expand(TOKENS // 2, -1), -0.5 * skew.expand(TOKENS // 2, -1)]
    )


def make_moe(balancing: str, on_ranks: bool = False) -> MoE:
    """on_ranks: balanced over the data-parallel group (dist's default group), as a run's parallelize function
    hands it over; otherwise over this process's tokens alone."""
    torch.manual_seed(0)
    return with_group(MoE(D, N_EXP, K, expert_ffn_dim=24, balancing=balancing).train(), on_ranks)


def with_group(model: torch.nn.Module, on_ranks: bool) -> torch.nn.Module:
    for module in model.modules():
        if hasattr(module, "process_group"):
            module.process_group = dist.group.WORLD if on_ranks else None
    return model


def route_run(balancing: str, rank: int | None = None) -> list[dict]:
    """Route ROUTE_STEPS batches (rank None: all tokens; else that rank's half).

    Returns per step the bias, the choices and the diagnostics."""
    moe = make_moe(balancing, on_ranks=rank is not None)
    steps = []
    for step in range(ROUTE_STEPS):
        logits = route_logits(step)
        _, experts = moe.route(logits if rank is None else rank_rows(logits, rank))
        steps.append(dict(bias=moe.expert_bias.clone(), experts=experts, diagnostics=moe.diagnostics()))
    return steps


def moe_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    offset = 0.5 * torch.randn(D, generator=torch.Generator().manual_seed(7))  # a shared offset skews the routing
    return torch.randn(MOE_B, MOE_T, D, generator=g) + offset, torch.randn(MOE_B, MOE_T, D, generator=g)


def train_run(model: torch.nn.Module, biases, batches, loss_of, rank: int | None = None) -> list[dict]:
    """SGD steps on `batches` (rank None: whole batches; else that rank's half, through DDP) -> per step loss,
    the biases the step left, and the output."""
    live = model if rank is None else DistributedDataParallel(model, **NO_BUFFER_SYNC)
    steps = []
    for batch in batches:
        x, y = batch if rank is None else (rank_rows(t, rank) for t in batch)
        out, loss = loss_of(live, x, y)
        model.zero_grad()
        loss.backward()  # DDP averages the ranks' gradients: the gradient of the global mean loss
        with torch.no_grad():  # plain SGD by hand: torch.optim's first step imports torch._dynamo (seconds)
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
        steps.append(dict(loss=loss.detach(), biases=[b.clone() for b in biases(model)], out=out.detach()))
    return steps


def moe_loss(moe, x, y):
    out = moe(x)
    return out, F.mse_loss(out, y)


def k3_loss(model, x, y):
    """-> (the final norm's output [B, T, d], what the LM head reads; loss): KimiK3 returns no logits with targets,
    and a routing flip upstream moves this output as it would the logits."""
    outputs = []
    module = model.module if isinstance(model, DistributedDataParallel) else model
    hook = module.norm.register_forward_hook(lambda _module, _inputs, output: outputs.append(output))
    try:
        _, loss = model(x, y)
    finally:
        hook.remove()
    return outputs[0], loss


def k3_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(300)
    return [
        (torch.randint(0, 61, (K3_B, K3_T), generator=g), torch.randint(0, 61, (K3_B, K3_T), generator=g))
        for _ in range(K3_STEPS)
    ]


def make_k3() -> KimiK3:
    torch.manual_seed(0)
    return KimiK3.from_fields(**TINY).train()


def k3_biases(model: KimiK3) -> list[torch.Tensor]:
    return [moe.expert_bias for moe in model.moe_layers().values()]


def two_rank_scenarios(rank: int, world_size: int) -> dict:
    """Everything a rank of the 2-rank group does, in one spawn (a spawn costs seconds of imports)."""
    out = {"route": {b: route_run(b, rank) for b in BALANCING}}
    moe = make_moe("quantile_balancing", on_ranks=True)
    out["moe"] = train_run(moe, lambda m: [m.expert_bias], [moe_batch(s) for s in range(MOE_STEPS)], moe_loss, rank)
    out["k3"] = train_run(with_group(make_k3(), True), k3_biases, k3_batches(), k3_loss, rank)

    # Eval passes are collective-free: rank 0 alone runs one (a collective there would pair with rank 1's next
    # one and fail, or time out).
    if rank == 0:
        with torch.no_grad():
            moe.eval()(moe_batch(0)[0])
        moe.train()

    # moe.process_group: a group of this rank alone balances over its own tokens, as one process would.
    own = [dist.new_group([r]) for r in range(world_size)][rank]
    local = make_moe("quantile_balancing")
    local.process_group = own
    local.route(rank_rows(route_logits(0), rank))
    out["own_group_bias"] = local.expert_bias.clone()
    # No group handed over: the MoE never asks torch.distributed for one and balances over its own tokens.
    ungrouped = make_moe("quantile_balancing")
    ungrouped.route(rank_rows(route_logits(0), rank))
    out["no_group_bias"] = ungrouped.expert_bias.clone()

    # Uneven token counts: every rank refuses, with the counts.
    try:
        make_moe("quantile_balancing", on_ranks=True).route(torch.randn(32 + 16 * rank, N_EXP))
        out["uneven"] = None
    except ValueError as e:
        out["uneven"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks(gloo_ranks, tmp_path_factory) -> list[dict]:
    return gloo_ranks(two_rank_scenarios, tmp_path_factory.mktemp("gloo"), world_size=WORLD)


@pytest.mark.parametrize("balancing", BALANCING)
def test_routing_two_ranks_equals_one_rank_exactly(ranks, balancing):
    """Given the same logits, everything after the router matmul is exact: sigmoid is elementwise, top-k is per
    token, the quantile depends only on the values of r (not their order) and the summed loads are integers. So
    every rank's bias, choices and diagnostics equal one process's on the whole batch, bit for bit."""
    whole = route_run(balancing)
    for step, one in enumerate(whole):
        for rank, result in enumerate(ranks):
            two = result["route"][balancing][step]
            assert torch.equal(two["bias"], one["bias"]), (balancing, step, rank)
            assert torch.equal(two["experts"], rank_rows(one["experts"], rank)), (balancing, step, rank)
            assert two["diagnostics"] == one["diagnostics"], (balancing, step, rank)
    if balancing != "none":  # a bias from one rank's tokens alone would differ: the test tells the two apart
        local = route_run(balancing, rank=1)
        assert all(not torch.equal(a["bias"], b["bias"]) for a, b in zip(whole, local)), balancing


def compare_training(ranks: list[dict], key: str, whole: list[dict]) -> dict[str, float]:
    """Per step: the ranks agree exactly with each other; against one process, the worst loss, bias and output
    differences and the share of routing-relevant outputs that agree."""
    worst = dict(loss_rel=0.0, bias=0.0, out=0.0)
    for step, one in enumerate(whole):
        r0, r1 = (result[key][step] for result in ranks)
        assert all(torch.equal(a, b) for a, b in zip(r0["biases"], r1["biases"])), (key, step)  # one global bias
        global_loss = (r0["loss"] + r1["loss"]) / 2  # equal token counts: the mean of means is the global mean
        worst["loss_rel"] = max(worst["loss_rel"], ((global_loss - one["loss"]).abs() / one["loss"]).item())
        worst["bias"] = max(worst["bias"], max((a - b).abs().max().item() for a, b in zip(r0["biases"], one["biases"])))
        out = torch.cat([r0["out"], r1["out"]])
        worst["out"] = max(worst["out"], (out - one["out"]).abs().max().item())
    return worst


def test_moe_training_on_two_ranks_matches_one_rank(ranks):
    """DDP + SGD on an MoE: the router matmul over 128 tokens per rank and the DDP gradient (the mean of two
    halves' means) round differently from one process on 256 tokens, so the two runs drift by float32 rounding
    (~1e-7 relative per step). The biases follow continuously (a quantile of r moves with r) and stay within 1e-5;
    a routing flip (a near tie) would move an output by the gap between two experts, far above 1e-5."""
    moe = make_moe("quantile_balancing")
    whole = train_run(moe, lambda m: [m.expert_bias], [moe_batch(s) for s in range(MOE_STEPS)], moe_loss)
    worst = compare_training(ranks, "moe", whole)
    assert worst["loss_rel"] < 1e-5 and worst["bias"] < 1e-5 and worst["out"] < 1e-5, worst
    assert whole[-1]["biases"][0].abs().max() > 0.05  # the bias had real work to do


def test_tiny_k3_training_on_two_ranks_matches_one_rank(ranks):
    """The same through a whole KimiK3 (3 MoE layers, 4 experts top-2: every rank sends its whole r)."""
    whole = train_run(make_k3(), k3_biases, k3_batches(), k3_loss)
    worst = compare_training(ranks, "k3", whole)
    assert worst["loss_rel"] < 1e-5 and worst["bias"] < 1e-5 and worst["out"] < 1e-4, worst


def test_a_process_group_of_one_rank_balances_over_its_own_tokens(ranks):
    for rank, result in enumerate(ranks):
        alone = make_moe("quantile_balancing")
        alone.route(rank_rows(route_logits(0), rank))
        assert torch.equal(result["own_group_bias"], alone.expert_bias), rank
        assert torch.equal(result["no_group_bias"], alone.expert_bias), rank
        assert not torch.equal(result["own_group_bias"], result["route"]["quantile_balancing"][0]["bias"]), rank


def test_uneven_token_counts_are_refused_on_every_rank(ranks):
    for result in ranks:
        assert result["uneven"] is not None and "[32, 48]" in result["uneven"], result["uneven"]
        assert "same number of tokens on every rank" in result["uneven"]


def _three_rank_quantiles(rank: int, world_size: int) -> dict:
    """global_quantile_bias on 3 ranks, each its third of a fixed r, with what each rank received in the all-to-all."""
    from k3train.models.k3.moe import balancing as moe_module
    from k3train.models.k3.moe import global_quantile_bias

    received = []
    real = moe_module._all_to_all_single

    def counting(output, input, output_split_sizes, input_split_sizes, group=None):
        received.append(output.numel())
        return real(output, input, output_split_sizes, input_split_sizes, group=group)

    moe_module._all_to_all_single = counting
    try:
        out = {}
        for n, tokens, k in THREE_RANK_CASES:
            r = torch.randn(3 * tokens, n, generator=torch.Generator().manual_seed(n + tokens))
            out[(n, tokens, k)] = global_quantile_bias(r.chunk(3)[rank], k, dist.group.WORLD)
        return {"bias": out, "received": received}
    finally:
        moe_module._all_to_all_single = real


# (experts, tokens a rank, k): experts split 3/3/2, 1/1/0 (fewer experts than ranks) and 6/6/4; candidates fewer
# than a rank's tokens (m + 1 = 3 * 64 * 2 / 8 + 1 = 49 < 64) and all of them (m + 1 > 16)
THREE_RANK_CASES = [(8, 64, 2), (2, 16, 1), (16, 16, 4)]


def test_three_ranks_take_a_block_of_experts_each_and_agree_exactly(tmp_path):
    from k3train.models.k3.moe import quantile_bias, quantile_rank
    from k3train.runtime.distributed import chunk_sizes

    from helpers.spawn import spawn_ranks

    ranks = spawn_ranks(_three_rank_quantiles, tmp_path, nprocs=3)
    for case, (n, tokens, k) in enumerate(THREE_RANK_CASES):
        r = torch.randn(3 * tokens, n, generator=torch.Generator().manual_seed(n + tokens))
        want = quantile_bias(r, k)
        c = min(quantile_rank(3 * tokens, k, n) + 1, tokens)
        for rank, got in enumerate(ranks):
            assert torch.equal(got["bias"][(n, tokens, k)], want), (n, rank)
            # each rank received every rank's candidates for its block of experts only
            assert got["received"][case] == 3 * c * chunk_sizes(n, 3)[rank], (n, rank)
