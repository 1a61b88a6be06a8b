"""MoE: dispatch against a per-token reference, routing rules, bias state, and Quantile Balancing convergence."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from k3train.models.common.situ import situ_glu
from k3train.models.k3.moe import MoE, reference_moe_forward

D, N_EXP, K = 16, 8, 2


def make_moe(balancing="quantile_balancing", n_shared=1, scale=2.5, seed=0) -> MoE:
    torch.manual_seed(seed)
    return MoE(
        D, N_EXP, K, expert_ffn_dim=24, n_shared_experts=n_shared, routed_scaling_factor=scale, balancing=balancing
    )


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, one chosen expert at a time: y_i = shared(x_i) + sum_j w_ij expert_j(x_i)."""
    ex = moe.experts
    out = []
    for x_i in x.reshape(-1, D):
        s = torch.sigmoid(moe.router.weight @ x_i)
        chosen = torch.topk(s + moe.expert_bias, K).indices
        w = s[chosen] / s[chosen].sum() * moe.routed_scaling_factor
        y = moe.shared(x_i) if moe.shared is not None else torch.zeros(D)
        for e, w_e in zip(chosen.tolist(), w):
            y = y + w_e * (ex.w_down[e] @ (F.silu(ex.w_gate[e] @ x_i) * (ex.w_up[e] @ x_i)))
        out.append(y)
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize("n_shared", [0, 1])
def test_dispatch_equals_per_token_loop(n_shared):
    moe = make_moe(n_shared=n_shared).eval()
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, N_EXP))  # a bias that changes some choices
    x = torch.randn(3, 10, D)
    torch.testing.assert_close(moe(x), per_token_reference(moe, x), rtol=1e-5, atol=1e-6)
    # gradients flow to the router (through the gate weights) and to the experts that got tokens
    moe(x).square().sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.w_down.grad.abs().sum() > 0


def test_gate_weights_come_from_unbiased_scores():
    moe = make_moe(scale=2.5).eval()
    logits = torch.randn(64, N_EXP)
    with torch.no_grad():
        moe.expert_bias.zero_()
        moe.expert_bias[3] = 10.0  # forces expert 3 into every token's top-k
    weights, experts = moe.route(logits)
    assert (experts == 3).any(dim=1).all()
    s = torch.sigmoid(logits)
    chosen = s.gather(1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(1, keepdim=True) * 2.5)
    # with the bias, expert 3's weight is its own (small) score share, not inflated by the bias
    assert (weights.sum(1) - 2.5).abs().max() < 1e-5


@pytest.mark.parametrize("balancing", ["quantile_balancing", "aux_free_bias"])
def test_bias_changes_only_in_training_forward_and_is_state(balancing):
    moe = make_moe(balancing)
    assert "expert_bias" in moe.state_dict()
    x = torch.randn(4, 32, D) + 0.5 * torch.randn(D)  # a shared offset makes the routing uneven
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert torch.equal(moe.expert_bias, torch.zeros(N_EXP)) and moe.diagnostics() == {}
    moe.train()
    moe(x)
    trained_bias = moe.expert_bias.clone()
    assert trained_bias.abs().sum() > 0
    diag = moe.diagnostics()  # the window's figures too, read once: the next read starts a new window
    assert {"load_cv", "dead_share", "bias_drift"} <= diag.keys()
    moe.eval()
    moe(torch.randn(4, 32, D))
    last_pass = {k: v for k, v in diag.items() if k not in ("load_cv", "dead_share", "bias_drift")}
    assert torch.equal(moe.expert_bias, trained_bias) and moe.diagnostics() == last_pass
    fresh = make_moe(balancing, seed=1)
    fresh.load_state_dict(moe.state_dict())
    assert torch.equal(fresh.expert_bias, trained_bias)


def test_no_balancing_keeps_zero_bias():
    moe = make_moe("none").train()
    moe(torch.randn(2, 16, D) + torch.randn(D))
    assert torch.equal(moe.expert_bias, torch.zeros(N_EXP))


def test_diagnostics_values():
    moe = make_moe().train()
    logits = torch.full((8, N_EXP), -5.0)
    logits[:, 0] = logits[:, 1] = 5.0  # every token picks experts 0 and 1
    moe.route(logits)
    diag = moe.diagnostics()
    assert diag["load_max"] == pytest.approx(N_EXP / 2) and diag["load_min"] == 0.0
    assert diag["routing_entropy"] == pytest.approx(1 / 3)  # log(2) / log(8)
    assert diag["bias_range"] == pytest.approx((moe.expert_bias.max() - moe.expert_bias.min()).item())


def steps_to_balance(balancing: str, n_steps: int, tol: float = 0.2) -> tuple[int | None, list[float]]:
    """Route a stream of fresh batches whose logits are skewed by linspace(-2, 2) over experts (at step 0 the
    top experts get ~3.2x their share, the bottom ones ~0). Returns the first step from which every later step has
    every expert's load within +-tol of kN/n, and the worst relative deviation per step."""
    torch.manual_seed(0)
    moe = make_moe(balancing).train()
    n_tokens, skew = 2048, torch.linspace(-2, 2, N_EXP)
    worst = []
    for _ in range(n_steps):
        _, experts = moe.route(torch.randn(n_tokens, N_EXP) + skew)
        load = torch.bincount(experts.reshape(-1), minlength=N_EXP) / (n_tokens * K / N_EXP)
        worst.append((load - 1).abs().max().item())
    settled = [i for i in range(n_steps) if max(worst[i:]) <= tol]
    return (settled[0] if settled else None), worst


def test_quantile_balancing_converges_faster_than_aux_free_bias():
    qb_step, qb_worst = steps_to_balance("quantile_balancing", 400)
    af_step, af_worst = steps_to_balance("aux_free_bias", 400)
    assert qb_worst[0] > 1.0 and af_worst[0] > 1.0  # the skew really unbalances the first pass
    # Measured (seed 0, 2048 tokens per batch): QB is within +-20% from step 2 on; aux_free_bias (rate 1e-3, a
    # bias step of 1e-3 per pass against a skew of 4 in logit space) only from step 345.
    assert qb_step is not None and qb_step <= 10, qb_worst[:12]
    assert af_step is not None and af_step > 10 * max(qb_step, 1), af_worst[::50]
    assert max(qb_worst[10:]) <= 0.2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantile_balancing_evens_a_fixed_batch(seed):
    """Repeated on one batch, every expert ends within 2% of m = N k / n. Without the tie-break of the runner-up
    expert's required bias (its old bias exactly, for a block of tokens the quantile could not split), biases
    stuck at their old value and some experts stayed 3-6% off m (7-16 tokens of 256 here)."""
    torch.manual_seed(seed)
    n_experts, n_tokens = 16, 2048
    moe = MoE(D, n_experts, K, expert_ffn_dim=24).train()
    logits = torch.randn(n_tokens, n_experts) + torch.linspace(-2, 2, n_experts)
    for _ in range(10):
        moe.route(logits)
    _, experts = moe.eval().route(logits)
    load = torch.bincount(experts.reshape(-1), minlength=n_experts)
    m = n_tokens * K / n_experts
    assert (load - m).abs().max() <= 0.02 * m, load.tolist()


def loop_experts(x, w_gate, w_up, w_down, counts, row_scale=None, situ=None):
    """The routed experts through plain autograd: one SwiGLU per expert on its rows (SiTU-GLU through situ_glu
    with situ = (beta, linear_beta)), each output row times its row_scale after w_down."""

    def act(g, u):
        return F.silu(g) * u if situ is None else situ_glu(g, u, *situ)

    outs = [act(xs @ w_gate[e].T, xs @ w_up[e].T) @ w_down[e].T for e, xs in enumerate(x.split(counts)) if xs.shape[0]]
    out = torch.cat(outs)
    return out if row_scale is None else out * row_scale[:, None].to(out.dtype)


def expert_inputs(dtype, counts=(5, 0, 3, 9, 1, 0, 6, 4), d=6, ffn=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, S = len(counts), sum(counts)
    tensors = [
        torch.randn(S, d, generator=g),
        torch.randn(E, ffn, d, generator=g),
        torch.randn(E, ffn, d, generator=g),
        torch.randn(E, d, ffn, generator=g),
    ]
    return [t.to(dtype).requires_grad_() for t in tensors], list(counts)


@pytest.mark.parametrize("with_scale", [False, True])
def test_grouped_swiglu_gradcheck_float64(with_scale):
    """Its hand-written backward against finite differences, experts with no rows included, with and without the
    row scale (the gate weights)."""
    from k3train.models.k3.moe import GroupedSwiGLU

    tensors, counts = expert_inputs(torch.float64)
    scale = [torch.rand(tensors[0].shape[0], dtype=torch.float64, requires_grad=True)] if with_scale else []
    assert torch.autograd.gradcheck(lambda x, *w: GroupedSwiGLU.apply(x, *w[:3], counts, *w[3:]), tensors + scale)


@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_swiglu_equals_the_autograd_loop(autocast):
    """Outputs and every gradient, the row scale's included, as plain autograd gives them, in fp32 and under bf16
    autocast (where both compute their matmuls in bf16 and return gradients in the inputs' fp32)."""
    from k3train.models.k3.moe import GroupedSwiGLU

    results = []
    for fn in (loop_experts, GroupedSwiGLU.apply):
        tensors, counts = expert_inputs(torch.float32, seed=1)
        scale = (torch.rand(tensors[0].shape[0], generator=torch.Generator().manual_seed(3)) + 0.5).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*tensors, counts, scale)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
        results.append([out.detach().float(), *(t.grad for t in tensors), scale.grad])
        assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert all(t.grad.dtype == torch.float32 for t in [*tensors, scale])
    for name, got, want in zip(("out", "x", "w_gate", "w_up", "w_down", "scale"), results[1], results[0]):
        # bf16 keeps ~3 significant digits, and the two round their intermediate products in different places
        tol = dict(rtol=2e-2, atol=1e-2 * want.abs().max().item()) if autocast else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("situ", [None, (4.0, 25.0)])
@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_mm_runs_the_same_experts_as_the_loop(situ, autocast):
    """GroupedSwiGLU given the counts as a tensor (F.grouped_mm over device-side offsets, the CUDA path) against the
    same counts as a host list (one torch.mm per expert), experts with no rows included, the row scale on: the output
    and every gradient, fp32 and bf16 autocast. In fp32 both are judged against the loop in fp64 (F.grouped_mm has no
    fp64), within a bound from fp32's resolution and the tensors' scale: how a CPU's grouped_mm sums its products
    differs between CPUs (bitwise on an AMD EPYC, 1.4e-6 apart on an Intel Xeon), the math must not.
    tests/test_moe_gpu.py compares them on a GPU."""
    from k3train.models.k3.moe import GroupedSwiGLU

    d, ffn = 8, 16  # grouped_mm: rows of 16 bytes
    results = []
    for dtype, as_tensor in ((torch.float64, False), (torch.float32, False), (torch.float32, True)):
        tensors, counts = expert_inputs(dtype, d=d, ffn=ffn, seed=4)
        scale = torch.rand(tensors[0].shape[0], generator=torch.Generator().manual_seed(3)) + 0.5
        scale = scale.to(dtype).requires_grad_()
        rows = torch.tensor(counts) if as_tensor else counts
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and dtype == torch.float32):
            out = GroupedSwiGLU.apply(*tensors, rows, scale, situ)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
        results.append([out.detach().double(), *(t.grad.double() for t in tensors), scale.grad.double()])
    exact, loop, grouped = results
    names = ("out", "x", "w_gate", "w_up", "w_down", "scale")
    for name, got, want, truth in zip(names, grouped, loop, exact):
        if autocast:  # x's gradient sums two products: the loop rounds each to bf16 (addmm), grouped_mm only their sum
            tol = dict(rtol=2e-2, atol=1e-2 * want.abs().max().item())
            torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{n}: {m}")
            continue
        # a sum of n fp32 products is within n x eps of the exact one, relative to the products' size; the largest
        # sum here has 2 x ffn terms (x's gradient: both halves at once)
        bound = 2 * ffn * torch.finfo(torch.float32).eps * truth.abs().max().item()
        for path, value in (("grouped_mm", got), ("loop", want)):
            torch.testing.assert_close(value, truth, rtol=0, atol=bound, msg=lambda m, n=name, p=path: f"{p} {n}: {m}")
    assert grouped[2][1].abs().sum() == 0 and grouped[2][5].abs().sum() == 0  # experts 1 and 5 had no rows


@pytest.mark.parametrize("implementation, grouped_calls", [("auto", 0), ("loop", 0), ("grouped_mm", 8)])
def test_expert_implementation_chooses_the_matmuls_and_trains_the_same(implementation, grouped_calls):
    """model.expert_implementation: "grouped_mm" runs every expert matmul through F.grouped_mm (3 forward, 5 backward
    calls), "loop" and "auto" on a CPU none; a training step gives the same output and gradients either way."""
    results = {}
    for impl in ("loop", implementation):
        torch.manual_seed(0)
        moe = MoE(D, N_EXP, K, 16, activation="situ", latent_dim=8, expert_implementation=impl).train()
        x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(5), requires_grad=True)
        with mock.patch("torch.nn.functional.grouped_mm", wraps=F.grouped_mm) as grouped_mm:
            moe(x).backward(torch.randn(2, 9, D, generator=torch.Generator().manual_seed(6)))
        results[impl] = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
        calls = grouped_mm.call_count
    assert calls == grouped_calls
    for name, want in results["loop"].items():
        torch.testing.assert_close(results[implementation][name], want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="expert_implementation='cutlass' must be one of"):
        MoE(D, N_EXP, K, expert_ffn_dim=8, expert_implementation="cutlass")
    with pytest.raises(ValueError, match="multiples of 8 .* these are 16 and 12: use loop or auto"):
        MoE(D, N_EXP, K, expert_ffn_dim=12, expert_implementation="grouped_mm")


def test_expert_counts_equal_bincount():
    from k3train.models.k3.moe import expert_counts

    experts = torch.randint(0, 11, (500,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(experts, 13), torch.bincount(experts, minlength=13))


# --- SiTU-GLU in the experts, the latent MoE, the fp32 router (Kimi K3) ------------------------------------------


def make_k3_moe(activation="situ", latent_dim=None, n_shared=1, dtype=torch.float64, seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(
        D,
        N_EXP,
        K,
        expert_ffn_dim=12,
        n_shared_experts=n_shared,
        routed_scaling_factor=2.5,
        activation=activation,
        latent_dim=latent_dim,
        norm_eps=1e-6,
        **kw,
    )
    with torch.no_grad():
        for p in moe.parameters():  # larger than the 0.02 init, so that SiTU's tanh branches are nonlinear here
            p.normal_(0, 0.6, generator=torch.Generator().manual_seed(p.numel()))
        if moe.latent_norm is not None:
            moe.latent_norm.weight.uniform_(0.5, 1.5)
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, N_EXP))  # a bias that changes some choices
    return moe.to(dtype).eval()


@pytest.mark.parametrize(
    "activation, latent_dim, n_shared", [("situ", None, 1), ("situ", 6, 1), ("swiglu", 6, 0), ("swiglu", None, 1)]
)
def test_fast_path_equals_the_reference_float64(activation, latent_dim, n_shared):
    """MoE.forward (sorted dispatch, GroupedSwiGLU's written backward, RMSNorm's function) against
    reference_moe_forward (plain autograd, one expert at a time), fp64: the output and every gradient."""
    results = []
    for fn in (reference_moe_forward, lambda m, x: m(x)):
        moe = make_k3_moe(activation, latent_dim, n_shared)
        x = torch.randn(2, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
        out = fn(moe, x)
        out.backward(torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6)))
        results.append({"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}})
    want, have = results
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    if latent_dim is not None:  # the latent modules took part: they have gradients
        assert all(have[n].abs().sum() > 0 for n in ("latent_down.weight", "latent_norm.weight", "latent_up.weight"))


def test_the_reference_is_the_per_token_loop():
    """reference_moe_forward at the defaults is the per-token loop above, which the fast path matches too."""
    moe = make_moe().eval()
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, N_EXP))
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(reference_moe_forward(moe, x), per_token_reference(moe, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_latent_moe_gradcheck_float64(activation):
    """Finite differences through the whole latent MoE (eval: a fixed bias; small steps flip no top-k choice)."""
    moe = make_k3_moe(activation, latent_dim=5)
    x = torch.randn(1, 4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7), requires_grad=True)
    assert torch.autograd.gradcheck(moe, (x,))


def test_latent_moe_parameters():
    """latent_down [r, d], latent_norm [r] and latent_up [d, r]; the routed experts at width r; the router and the
    shared experts at d. Without latent_dim none of the three exists."""
    moe = make_k3_moe(latent_dim=6, dtype=torch.float32)
    shapes = {n: tuple(p.shape) for n, p in moe.state_dict().items()}
    assert shapes["latent_down.weight"] == (6, D) and shapes["latent_up.weight"] == (D, 6)
    assert shapes["latent_norm.weight"] == (6,) and moe.latent_norm.eps == 1e-6
    assert shapes["experts.w_gate"] == (N_EXP, 12, 6) and shapes["experts.w_down"] == (N_EXP, 6, 12)
    assert shapes["router.weight"] == (N_EXP, D) and shapes["shared.w_gate.weight"] == (12, D)
    assert not any(n.startswith("latent") for n in make_moe().state_dict())
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="latent_dim"):
            MoE(D, N_EXP, K, expert_ffn_dim=12, latent_dim=bad)
    with pytest.raises(ValueError, match="activation"):
        MoE(D, N_EXP, K, expert_ffn_dim=12, activation="gelu")


@pytest.mark.parametrize("latent_dim", [None, 6])
def test_router_is_fp32_under_bf16_autocast(latent_dim):
    """Under a bf16 autocast the router's logits are fp32, bit for bit the fp32 matmul without autocast, and the
    MoE routes on them; the experts still run in bf16."""
    moe = make_k3_moe(latent_dim=latent_dim, dtype=torch.float32)
    x = torch.randn(2, 9, D)
    seen = []
    route = moe.route
    with mock.patch.object(moe, "route", side_effect=lambda logits: seen.append(logits) or route(logits)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = moe.router_logits(x.reshape(-1, D))
            out = moe(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, F.linear(x.reshape(-1, D), moe.router.weight))
    assert torch.equal(seen[0], logits)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), moe(x), rtol=5e-2, atol=5e-2 * moe(x).abs().max().item())


def test_renormalisation_survives_underflowing_scores():
    """k chosen scores that all underflow to 0 give gate weights 0 (sum + 1e-20), not 0/0 = NaN."""
    moe = make_moe().eval()
    weights, _ = moe.route(torch.full((4, N_EXP), -200.0))
    assert torch.equal(weights, torch.zeros(4, K))


def test_quantile_balancing_balances_the_latent_moe():
    """The bias comes from the full-width router alone: a latent MoE and a plain one with the same router weight see
    the same biases pass after pass, bit for bit; on a fixed skewed batch every expert ends within 2% of N k / n."""
    n_tokens = 2048
    x = torch.randn(1, n_tokens, D, generator=torch.Generator().manual_seed(0))
    moes = [make_k3_moe(latent_dim=r, dtype=torch.float32, balancing="quantile_balancing") for r in (6, None)]
    with torch.no_grad():
        for moe in moes:
            moe.expert_bias.zero_()
            moe.router.weight.copy_(0.3 * torch.randn(N_EXP, D, generator=torch.Generator().manual_seed(1)))
            moe.router.weight[:, 0] += torch.linspace(-2, 2, N_EXP)  # with x's first channel, skews the loads
        x[..., 0] = 1.0
        for moe in moes:
            moe.train()
        for step in range(10):
            biases = []
            for moe in moes:
                moe(x)
                biases.append(moe.expert_bias.clone())
            assert torch.equal(*biases)
            if step == 0:  # the first pass, routed with a zero bias, was skewed
                assert moes[0].diagnostics()["load_max"] > 1.5, moes[0].diagnostics()
    _, experts = moes[0].eval().route(moes[0].router_logits(x.reshape(-1, D)))
    load = torch.bincount(experts.reshape(-1), minlength=N_EXP)
    m = n_tokens * K / N_EXP
    assert (load - m).abs().max() <= 0.02 * m, load.tolist()


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("with_scale", [False, True])
def test_grouped_situ_gradcheck_float64(activation, with_scale):
    """GroupedSwiGLU with SiTU-GLU: its written backward against finite differences (experts with no rows included),
    the inputs scaled up so that both tanh branches bend."""
    from k3train.models.k3.moe import GroupedSwiGLU

    tensors, counts = expert_inputs(torch.float64)
    with torch.no_grad():
        for t in tensors[1:3]:
            t.mul_(3.0)
    scale = [torch.rand(tensors[0].shape[0], dtype=torch.float64, requires_grad=True)] if with_scale else [None]
    situ = (4.0, 25.0) if activation == "situ" else None
    assert torch.autograd.gradcheck(lambda x, *w: GroupedSwiGLU.apply(x, *w[:3], counts, *w[3:], situ), tensors + scale)


@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_situ_equals_the_autograd_loop(autocast):
    """SiTU experts: outputs and every gradient, the row scale's included, against plain autograd through
    situ.situ_glu, in fp64 (to 1e-10), and in fp32 and under bf16 autocast (as the SwiGLU test above)."""
    from k3train.models.k3.moe import GroupedSwiGLU

    for dtype in [torch.float64, torch.float32] if not autocast else [torch.float32]:
        results = []
        for fn in (loop_experts, GroupedSwiGLU.apply):
            tensors, counts = expert_inputs(dtype, seed=1)
            with torch.no_grad():
                for t in tensors[1:3]:
                    t.mul_(3.0)
            scale = torch.rand(tensors[0].shape[0], generator=torch.Generator().manual_seed(3)) + 0.5
            scale = scale.to(dtype).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = fn(*tensors, counts, scale, (4.0, 25.0))
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
            results.append([out.detach().to(dtype), *(t.grad for t in tensors), scale.grad])
            assert all(t.grad.dtype == dtype for t in [*tensors, scale])
        for name, got, want in zip(("out", "x", "w_gate", "w_up", "w_down", "scale"), results[1], results[0]):
            if autocast:
                tol = dict(rtol=2e-2, atol=1e-2 * want.abs().max().item())
            else:
                tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_moe_macs_counts_the_latent_moe():
    """flops.moe_macs against torch's FLOP counter over one forward of a latent MoE: the router at d, the two
    latent projections (2 d r per token), k experts at width r and the shared ones at d."""
    from torch.utils.flop_counter import FlopCounterMode

    from k3train.models.k3.config import KimiK3Config
    from k3train.models.k3.flops import moe_macs

    for latent_dim, n_shared in [(6, 1), (6, 0), (None, 2)]:
        moe = MoE(D, N_EXP, K, expert_ffn_dim=12, n_shared_experts=n_shared, latent_dim=latent_dim)
        config = KimiK3Config(
            d_model=D,
            n_routed_experts=N_EXP,
            experts_per_token=K,
            expert_ffn_dim=12,
            n_shared_experts=n_shared,
            expert_latent_dim=latent_dim,
        )
        x = torch.randn(2, 10, D)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            moe(x)
        assert counter.get_total_flops() == 2 * 20 * moe_macs(config), (latent_dim, n_shared)


def test_the_moe_sends_its_slots_through_the_dispatcher_it_is_given() -> None:
    """use_dispatcher's seam: a dispatcher wrapping LocalDispatch sees every slot once and changes no bit; and
    assigning process_group is balance_over."""
    from k3train.models.k3.moe import LocalDispatch

    class Counting(LocalDispatch):
        def dispatch(self, x, weights, experts):
            slots = super().dispatch(x, weights, experts)
            seen.append(int(slots.counts.sum()))
            return slots

    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3))
    want = make_moe().eval()(x)
    moe = make_moe().eval()
    seen: list[int] = []
    moe.use_dispatcher(Counting(N_EXP))
    assert torch.equal(moe(x), want) and seen == [2 * 5 * K]
    assert moe.process_group is None
    moe.process_group = "group"
    assert moe.balancer.group == "group" and moe.process_group == "group"
    moe.balance_over(None)
    assert moe.process_group is None
