"""Kimi Delta Attention: chunk vs the per-step reference (outputs, final state, every gradient), the layer's
shape, causality and implementations, and the optional FLA path's errors."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from k3train.models.kda import KimiDeltaAttention, chunk_kda, fla_chunk_kda, naive_recurrent_kda
from k3train.models.kda.layer import CausalConvSiLU, causal_depthwise_conv

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
    x = torch.randn(2, 37, 32)
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


def test_layer_input_projections_in_one_matmul_equal_each_projection():
    layer, x = make_layer(n_value_heads=4), torch.randn(2, 7, 32)
    separate = [p(x) for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.f_a_proj, layer.g_a_proj, layer.b_proj)]
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
    assert layer.q_proj.weight.head_split == (2, 0) and layer.k_proj.weight.head_split == (2, 0)
    assert layer.v_proj.weight.head_split == (4, 0) and layer.o_proj.weight.head_split == (4, 1)
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


@pytest.mark.slow
def test_package_import_does_not_import_fla():
    code = "import sys, k3train.models.kda; assert 'fla' not in sys.modules, 'fla imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)
