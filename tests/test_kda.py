"""Kimi Delta Attention: chunk vs the per-step reference (outputs, final state, every gradient), the layer's
shape, causality and implementations, both output gates and the gate's lower bound against a readable reference,
decoding against the full forward, and the optional FLA path (its inputs, its errors)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from k3train.models.kda import KimiDeltaAttention, chunk_kda, fla_chunk_kda, naive_recurrent_kda
from k3train.models.kda.layer import CausalConvSiLU, causal_depthwise_conv
from k3train.models.layout import parameter_layouts
from k3train.optim.param_groups import partition_parameters

from helpers.kda_problems import assert_close, make_inputs, run

pytestmark = pytest.mark.usefixtures("one_thread")


# (B, T, H, HV, K, V, chunk_size, decay, with_state)
SHAPES = {
    "T_not_multiple_of_chunk": (2, 100, 2, 2, 16, 8, 32, 1.0, True),
    "T_shorter_than_chunk": (1, 10, 1, 1, 8, 8, 64, 1.0, False),
    "several_heads_exact_chunks": (1, 96, 3, 3, 16, 32, 32, 1.0, True),
    "gva_two_values_per_head": (2, 70, 2, 4, 16, 16, 16, 1.0, True),
    "huge_decays_no_overflow": (1, 96, 2, 2, 16, 16, 32, 300.0, True),  # the doubling levels only
    "fast_decays_16_row_blocks": (1, 128, 2, 2, 16, 16, 64, 3.0, True),  # factored 16-row blocks, then 2 levels
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_chunk_matches_recurrent_float64(shape):
    B, T, H, HV, K, V, C, decay, with_state = shape
    inputs = make_inputs(B, T, H, HV, K, V, decay=decay, with_state=with_state)
    assert_close(run(chunk_kda, inputs, chunk_size=C), run(naive_recurrent_kda, inputs), tol=1e-10)


@pytest.mark.parametrize("chunk_size,decay", [(16, 1.0), (64, 1.0), (64, 3.0), (64, 10.0)])
def test_chunk_fp32_matches_float64_reference(chunk_size, decay):
    inputs64 = make_inputs(1, 150, 2, 2, 32, 32, decay=decay)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    assert_close(run(chunk_kda, inputs32, chunk_size=chunk_size), run(naive_recurrent_kda, inputs64), tol=1e-5)


@pytest.mark.parametrize("per_step,block", [(0.5, 64), (1.0, 64), (2.0, 32), (4.0, 16), (8.0, 8), (16.0, 1)])
def test_factored_blocks_shrink_as_the_decays_grow(per_step, block):
    """A block is factored about its middle row only while every |G_i - G_m| stays within FACTORED_SPAN (40): with
    a constant decay d per step a b-row block spans d b / 2. Below 8 rows only the doubling levels remain."""
    from k3train.models.kda.chunk import FACTORED_SPAN, _decays

    G = (-per_step * torch.arange(1, 65, dtype=torch.float64)).expand(2, 3, 64).unsqueeze(-1).expand(2, 3, 64, 4)
    decays = _decays(G)
    assert decays.block == block
    assert [h for h, *_ in decays.levels] == [h for h in (1, 2, 4, 8, 16, 32) if h >= block]
    if block > 1:
        assert per_step * block / 2 <= FACTORED_SPAN  # and the next size up would not be:
        assert block == 64 or per_step * block > FACTORED_SPAN
        assert (decays.row_factor * decays.col_factor).sub(1).abs().max() < 1e-12  # exp(d) exp(-d) per row


def test_chunk_computes_in_fp32_under_bf16_autocast():
    inputs = [x.detach().float() for x in make_inputs(1, 80, 2, 2, 16, 16)]
    o_ref, S_ref = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    # bf16 matmuls inside would miss by ~1e-2.
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(S, S_ref, rtol=1e-6, atol=1e-6)
    o_bf16, S_bf16 = chunk_kda(*(x.bfloat16() for x in inputs[:5]), initial_state=inputs[5], output_final_state=True)
    assert o_bf16.dtype == torch.bfloat16 and S_bf16.dtype == torch.float32


def test_chunk_backward_stays_fp32_when_called_under_bf16_autocast():
    """The written-out backward's matmuls must not follow an autocast region the caller's backward() runs in."""
    inputs = make_inputs(1, 80, 2, 2, 16, 16, dtype=torch.float32)
    expected = run(chunk_kda, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(chunk_kda, inputs)
    assert_close(got, expected, tol=1e-6)


def test_chunk_rejects_bad_arguments():
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in make_inputs(1, 8, 2, 3, 4, 4))
    with pytest.raises(ValueError, match="multiple of H=2"):
        chunk_kda(q, k, v, g, beta)
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 8, 2, 2, 4, 4))
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV, K\]"):
        chunk_kda(q, k, v, g[..., :2], beta)
    with pytest.raises(ValueError, match="at least one time step"):
        naive_recurrent_kda(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0])


def test_chunk_matches_fla_naive_chunk():
    naive = pytest.importorskip("fla.ops.kda.naive", reason="flash-linear-attention not installed (optional)")
    inputs = [x.detach().float().requires_grad_() for x in make_inputs(1, 256, 2, 4, 32, 32)]
    assert_close(run(chunk_kda, inputs), run(naive.naive_chunk_kda, inputs), tol=1e-5)


def make_layer(implementation="chunk", **kwargs):
    torch.manual_seed(0)
    return KimiDeltaAttention(32, n_heads=2, head_dim=8, implementation=implementation, chunk_size=16, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"n_value_heads": 4}, {"gate": "sigmoid"}], ids=["mha", "gva", "sigmoid"])
def test_layer_shape_backward_and_chunk_equals_recurrent(kwargs):
    # a fixed x: fp32 chunk vs recurrent gradients miss rtol 1e-4 on a few small elements for ~1 x in 10
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(0))
    outputs, grads = [], []
    for implementation in ("chunk", "recurrent"):
        layer = make_layer(implementation, **kwargs)
        y = layer(x)
        assert y.shape == x.shape
        y.square().sum().backward()
        missing = [n for n, p in layer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing, f"parameters without gradient: {missing}"
        outputs.append(y.detach())
        grads.append(torch.cat([p.grad.flatten() for p in layer.parameters()]))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("implementation", ["chunk", "recurrent"])
def test_layer_is_causal(implementation):
    layer = make_layer(implementation)
    x = torch.randn(1, 40, 32)
    changed = x.clone()
    changed[:, 21:] = torch.randn(1, 19, 32)
    y, y_changed = layer(x), layer(changed)
    torch.testing.assert_close(y[:, :21], y_changed[:, :21], rtol=0, atol=1e-6)
    assert (y[:, 21:] - y_changed[:, 21:]).abs().max() > 1e-3


def autograd_conv_silu(x, weight):
    """The short conv as plain autograd sees it: the reference for CausalConvSiLU's written-out backward."""
    return F.silu(causal_depthwise_conv(F.pad(x, (0, 0, weight.shape[-1] - 1, 0)), weight))


@pytest.mark.parametrize("T", [1, 3, 17], ids=["T1", "T_below_width", "T17"])
def test_short_conv_backward_matches_autograd(T):
    x = torch.randn(2, T, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(CausalConvSiLU.apply, (x, weight))
    upstream = torch.randn(2, T, 6, dtype=torch.float64)
    grads = torch.autograd.grad((CausalConvSiLU.apply(x, weight) * upstream).sum(), (x, weight))
    expected = torch.autograd.grad((autograd_conv_silu(x, weight) * upstream).sum(), (x, weight))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_short_conv_keeps_dtypes_of_bf16_input_and_fp32_weight():
    """Under autocast the projections hand the conv bf16 rows; its weight stays fp32, as do the results."""
    x = torch.randn(2, 9, 6).bfloat16().requires_grad_()
    weight = torch.randn(6, 1, 4, requires_grad=True)
    y = CausalConvSiLU.apply(x, weight)
    y_ref = autograd_conv_silu(x, weight)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref)
    upstream = torch.randn(y.shape)
    grads = torch.autograd.grad((y * upstream).sum(), (x, weight))
    expected = torch.autograd.grad((y_ref * upstream).sum(), (x, weight))
    for got, want in zip(grads, expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("output_gate", ["low_rank", "full_rank"])
def test_layer_input_projections_in_one_matmul_equal_each_projection(output_gate):
    layer, x = make_layer(n_value_heads=4, output_gate=output_gate), torch.randn(2, 7, 32)
    gate_in = layer.g_a_proj if output_gate == "low_rank" else layer.g_proj
    separate = [p(x) for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.f_a_proj, gate_in, layer.b_proj)]
    separate = [torch.cat(separate[:3], dim=-1), *separate[3:]]  # q, k, v side by side
    for fused in (True, False):
        got = layer._input_projections(x, fused=fused)
        assert [t.shape for t in got] == [t.shape for t in separate]
        for a, b in zip(got, separate):
            torch.testing.assert_close(a, b)


def test_layer_gates_and_annotations():
    layer = make_layer(gate="sigmoid", n_value_heads=4)
    g = layer._forget_gate(layer.f_a_proj(torch.randn(2, 5, 32)))
    assert g.shape == (2, 5, 4, 8) and g.dtype == torch.float32
    assert (g <= 0).all() and (g >= -5).all()
    softplus_layer = make_layer()
    g = softplus_layer._forget_gate(softplus_layer.f_a_proj(torch.randn(2, 5, 32)))
    assert (g < 0).all()
    splits = {name: layout.head_split for name, layout in parameter_layouts(layer).items()}
    assert splits == {"q_proj.weight": (2, 0), "k_proj.weight": (2, 0), "v_proj.weight": (4, 0)} | {
        "o_proj.weight": (4, 1)
    }
    A = layer.A_log.exp()
    assert (A >= 1).all() and (A <= 16).all()
    dt = F.softplus(layer.dt_bias)
    assert (dt >= 1e-3 * 0.999).all() and (dt <= 1e-1 * 1.001).all()
    assert "implementation='chunk'" in repr(layer)


def test_layer_bf16_autocast_keeps_output_dtype():
    layer, x = make_layer(), torch.randn(1, 20, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), layer(x), rtol=0.05, atol=0.05)


def test_layer_rejects_bad_config():
    with pytest.raises(ValueError, match="implementation must be one of"):
        make_layer("triton")
    with pytest.raises(ValueError, match="gate must be one of"):
        make_layer(gate="relu")
    with pytest.raises(ValueError, match="multiple of n_heads"):
        make_layer(n_value_heads=3)
    with pytest.raises(ValueError, match="power of two"):
        KimiDeltaAttention(32, 2, 8, chunk_size=24)
    with pytest.raises(ValueError, match="output_gate must be one of"):
        make_layer(output_gate="low-rank")
    with pytest.raises(ValueError, match="gate_lower_bound must be < 0"):
        make_layer(gate="sigmoid", gate_lower_bound=0.0)
    with pytest.raises(ValueError, match="qk_norm_eps must be > 0"):
        make_layer(qk_norm_eps=0.0)


def test_fla_without_package_says_how_to_install(monkeypatch):
    for name in ("fla", "fla.ops", "fla.ops.kda"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import fla...` fail as if not installed
    with pytest.raises(ImportError, match=r"pip install 'k3train\[gpu\]'"):
        make_layer("fla")
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 8, 2, 2, 4, 4))
    with pytest.raises(ImportError, match=r"k3train\[gpu\]"):
        fla_chunk_kda(q, k, v, g, beta)


def test_fla_on_cpu_tensors_says_it_needs_cuda(monkeypatch):
    fake = types.ModuleType("fla.ops.kda")
    fake.chunk_kda = lambda **kwargs: pytest.fail("the kernel must not be called with CPU tensors")
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fake)
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 8, 2, 2, 4, 4))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        fla_chunk_kda(q, k, v, g, beta)


def reference_qkv(layer, x):
    """q, k [B, T, H, K] and v [B, T, HV, K] as the layer's docstring states them: Linear, causal depthwise Conv1d
    (zero-padded in front, torch's own conv), SiLU; q and k x / sqrt(sum x^2 + qk_norm_eps) per head."""
    B, T, _ = x.shape
    H, HV, K = layer.n_heads, layer.n_value_heads, layer.head_dim

    def conv_silu(proj, conv):
        z = proj(x).transpose(1, 2)  # [B, D, T]
        z = F.conv1d(F.pad(z, (layer.conv_size - 1, 0)), conv.weight, groups=z.shape[1])
        return F.silu(z).transpose(1, 2)

    def l2(t):
        return t / torch.sqrt(t.square().sum(-1, keepdim=True) + layer.qk_norm_eps)

    q = l2(conv_silu(layer.q_proj, layer.q_conv).view(B, T, H, K))
    k = l2(conv_silu(layer.k_proj, layer.k_conv).view(B, T, H, K))
    return q, k, conv_silu(layer.v_proj, layer.v_conv).view(B, T, HV, K)


def reference_forget_gate(layer, x):
    """The forget gate as the docstring states it, in at least fp32 as the layer computes it (its sums over T need
    it; an fp64 layer keeps fp64)."""
    B, T, _ = x.shape
    dtype = torch.promote_types(layer.dt_bias.dtype, torch.float32)
    f = layer.f_b_proj(layer.f_a_proj(x)).to(dtype).view(B, T, layer.n_value_heads, layer.head_dim)
    f = f + layer.dt_bias.to(dtype).view(layer.n_value_heads, layer.head_dim)
    rate = layer.A_log.to(dtype).exp()[:, None]
    if layer.gate == "softplus":
        return -rate * F.softplus(f)
    return layer.gate_lower_bound * torch.sigmoid(rate * f)


def reference_output_gate(layer, x, o):
    """o [B, T, HV, K] -> o_proj(RMSNorm_head(o) * w * sigmoid(logits)): logits g_proj x (full rank, no bias) or
    g_b_proj(g_a_proj x) (low rank, g_b_proj with its bias if it has one)."""
    B, T, HV, K = o.shape
    if layer.output_gate == "full_rank":
        logits = x @ layer.g_proj.weight.T
    else:
        logits = (x @ layer.g_a_proj.weight.T) @ layer.g_b_proj.weight.T
        if layer.g_b_proj.bias is not None:
            logits = logits + layer.g_b_proj.bias
    normed = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
    gated = normed * torch.sigmoid(logits.view(B, T, HV, K))
    return gated.reshape(B, T, HV * K) @ layer.o_proj.weight.T


def reference_layer(layer, x):
    q, k, v = reference_qkv(layer, x)
    beta = torch.sigmoid(layer.b_proj(x))
    o = naive_recurrent_kda(q, k, v, reference_forget_gate(layer, x).to(x.dtype), beta)[0]
    return reference_output_gate(layer, x, o)


OUTPUT_GATE_CASES = {
    "low_rank_default": {},
    "full_rank": {"output_gate": "full_rank"},
    "full_rank_gva_sigmoid": {"output_gate": "full_rank", "n_value_heads": 4, "gate": "sigmoid"},
    "low_rank_bound_eps": {"gate": "sigmoid", "gate_lower_bound": -2.0, "qk_norm_eps": 1e-2},
    "low_rank_no_bias": {"output_gate_bias": False},
}


@pytest.mark.parametrize("kwargs", OUTPUT_GATE_CASES.values(), ids=OUTPUT_GATE_CASES.keys())
@pytest.mark.parametrize("implementation", ["chunk", "recurrent"])
def test_layer_matches_readable_reference_float64(implementation, kwargs):
    layer = make_layer(implementation, **kwargs).double()
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    y, y_ref = layer(x), reference_layer(layer, x)
    err = ((y - y_ref).abs().max() / y_ref.abs().max()).item()
    assert err < 1e-10, f"max |layer - reference| / max |reference| = {err:.1e}"


@pytest.mark.parametrize("output_gate", ["low_rank", "full_rank"])
def test_output_gate_gradcheck_float64(output_gate):
    """The gate's path end to end in fp64 (the forget gate's fp32 would defeat finite differences): x, o and every
    weight the output gate touches."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(8, n_heads=1, head_dim=4, n_value_heads=2, output_gate=output_gate).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    o = torch.randn(1, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    gate_in = layer.g_a_proj if output_gate == "low_rank" else layer.g_proj
    weights = [p for p in layer.parameters() if p.requires_grad]

    def gated(x, o, *_):
        return layer._gated_output(gate_in(x), o)

    y = gated(x, o)
    torch.testing.assert_close(y, reference_output_gate(layer, x, o), rtol=1e-13, atol=1e-14)
    used = [p for p in weights if torch.autograd.grad(y.sum(), p, retain_graph=True, allow_unused=True)[0] is not None]
    assert len(used) == (5 if output_gate == "low_rank" else 3)  # g_a, g_b (+ bias) or g_proj; o_norm, o_proj
    assert torch.autograd.gradcheck(gated, (x, o, *used))


def test_full_rank_gate_parameters_and_annotations():
    low, full = make_layer(n_value_heads=4), make_layer(n_value_heads=4, output_gate="full_rank")
    assert low.g_b_proj.bias is not None and not hasattr(low, "g_proj")
    assert not hasattr(full, "g_a_proj") and not hasattr(full, "g_b_proj")
    assert full.g_proj.weight.shape == (4 * 8, 32) and full.g_proj.bias is None
    assert parameter_layouts(full)["g_proj.weight"].head_split == (4, 0)  # per value head, as v_proj
    assert "g_b_proj.weight" not in parameter_layouts(low)  # low rank: a gate, not per head
    gate_keys = {"g_a_proj.weight", "g_b_proj.weight", "g_b_proj.bias"}
    assert set(low.state_dict()) - set(full.state_dict()) == gate_keys
    assert set(full.state_dict()) - set(low.state_dict()) == {"g_proj.weight"}
    (g_proj,) = [a for a in partition_parameters(full) if a.name == "g_proj.weight"]
    assert g_proj.group == "muon_attention" and g_proj.view == "heads(4, dim=0)"
    assert "output_gate='full_rank'" in repr(full) and "qk_norm_eps=1e-06" in repr(full)


def test_low_rank_gate_without_bias_as_kimi_linear_releases_it():
    """output_gate_bias=False: g_b_proj has no bias (Kimi Linear, transformers' kimi_linear); kimi_linear_tiny uses
    it. The full-rank gate never has one, and asking for one is refused."""
    layer = make_layer(output_gate_bias=False)
    assert layer.g_b_proj.bias is None and "g_b_proj.bias" not in layer.state_dict()
    assert "output_gate_bias=False" in repr(layer)
    with pytest.raises(ValueError, match="full_rank' has no bias"):
        make_layer(output_gate="full_rank", output_gate_bias=True)
    from k3train.models.k3.config import KimiK3Config

    from helpers.config import model_config

    assert model_config("kimi_linear_tiny").kda_output_gate_bias is False
    with pytest.raises(ValueError, match="kda_output_gate_bias=true needs kda_output_gate=low_rank"):
        KimiK3Config(vocab_size=257, kda_output_gate="full_rank", kda_output_gate_bias=True)


@pytest.mark.parametrize("lower_bound", [-5.0, -2.0, -0.5])
def test_gate_lower_bound_reaches_the_sigmoid_gate(lower_bound):
    """g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)): in (lower_bound, 0), and the same layer with another
    bound scales g by the ratio of the bounds. The softplus gate has no bound: the argument leaves it alone."""
    f_a = 4 * torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(0))  # f of std ~2: sigmoid over (0, 1)
    layer, default = make_layer(gate="sigmoid", gate_lower_bound=lower_bound), make_layer(gate="sigmoid")
    assert ((layer._forget_gate(f_a) >= lower_bound) & (layer._forget_gate(f_a) <= 0)).all()
    for same_weights in (layer, default):  # A = 1, dt_bias = 0: sigmoid(f) away from fp32's 0 and 1
        with torch.no_grad():
            same_weights.A_log.zero_(), same_weights.dt_bias.zero_()
    g = layer._forget_gate(f_a)
    assert ((g > lower_bound) & (g < 0)).all() and g.min() < 0.9 * lower_bound and g.max() > 0.1 * lower_bound
    torch.testing.assert_close(g, default._forget_gate(f_a) * (lower_bound / -5.0), rtol=1e-6, atol=0)
    softplus = [make_layer(gate_lower_bound=b)._forget_gate(f_a) for b in (lower_bound, -5.0)]
    torch.testing.assert_close(softplus[0], softplus[1], rtol=0, atol=0)


def test_qk_norm_eps_reaches_q_and_k():
    """q and k carry ||x|| / sqrt(||x||^2 + eps) < 1: a large eps shrinks them visibly, and changes the output."""
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    small, large = make_layer(qk_norm_eps=1e-6).double(), make_layer(qk_norm_eps=1.0).double()
    for layer in (small, large):
        q, k, _ = reference_qkv(layer, x)
        assert (torch.linalg.vector_norm(q, dim=-1) < 1).all() and (torch.linalg.vector_norm(k, dim=-1) < 1).all()
    assert (small(x) - large(x)).abs().max() > 1e-3


@pytest.mark.parametrize("kwargs", OUTPUT_GATE_CASES.values(), ids=OUTPUT_GATE_CASES.keys())
@pytest.mark.parametrize("implementation", ["chunk", "recurrent"])
def test_forward_cached_continues_forward_float64(implementation, kwargs):
    """A prompt, then one token at a time, then a second prompt: the same outputs as one full forward (the same
    gate, the same q/k normalisation), in fp64 within 1e-10."""
    layer = make_layer(implementation, **kwargs).double()
    x = torch.randn(2, 29, 32, dtype=torch.float64)
    state = layer.empty_state(2, x.device, x.dtype)
    steps = [layer.forward_cached(x[:, :11], state)]
    steps += [layer.forward_cached(x[:, t : t + 1], state) for t in range(11, 20)]
    steps.append(layer.forward_cached(x[:, 20:], state))
    y, y_cached = layer(x), torch.cat(steps, dim=1)
    err = ((y_cached - y).abs().max() / y.abs().max()).item()
    assert err < 1e-10, f"max |cached - full| / max |full| = {err:.1e}"


def test_fla_path_receives_the_normalised_q_and_k(monkeypatch):
    """implementation="fla" on tensors FLA's kernels cannot take (a CPU without Triton's interpreter) keeps k3train's
    steps around fla_chunk_kda: it hands the kernel q, k already normalised with qk_norm_eps and the same gate; CPU
    stand-ins for the kernels record what they get (no FLA needed). The fused route (in-kernel gate and l2norm) is
    tests/fla's, under the interpreter, and tests/test_kda_gpu.py's."""
    import k3train.models.kda.layer as layer_module

    seen = []

    def recorder(kernel):
        def fake(q, k, v, g, beta, **kwargs):
            seen.append((q, k, g))
            return kernel(q, k, v, g, beta, **kwargs)

        return fake

    monkeypatch.setattr(layer_module, "fla_chunk_kda", recorder(chunk_kda))
    monkeypatch.setattr(layer_module, "fla_fused_recurrent_kda", recorder(naive_recurrent_kda))
    layer = make_layer(output_gate="full_rank", gate="sigmoid", gate_lower_bound=-3.0, qk_norm_eps=1e-3).double()
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    y_chunk = layer(x)
    layer.implementation = "fla"  # built as "chunk": FLA's import check passed by
    y = layer(x)
    state = layer.empty_state(1, x.device, x.dtype)
    y_cached = torch.cat([layer.forward_cached(x[:, :8], state), layer.forward_cached(x[:, 8:], state)], dim=1)
    assert len(seen) == 3  # forward, the prompt (chunk), the one token (fused recurrent)
    q_ref, k_ref, _ = reference_qkv(layer, x)
    q, k, g = seen[0]
    torch.testing.assert_close(q, q_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(k, k_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, reference_forget_gate(layer, x), rtol=1e-12, atol=1e-14)  # fused f_a_proj
    torch.testing.assert_close(torch.cat([seen[1][0], seen[2][0]], dim=1), q_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(y, y_chunk, rtol=0, atol=0)
    torch.testing.assert_close(y_cached, y, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_package_import_does_not_import_fla():
    code = "import sys, k3train.models.kda; assert 'fla' not in sys.modules, 'fla imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)
