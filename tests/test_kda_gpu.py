"""KDA on a CUDA GPU: our pure-PyTorch chunk_kda there, FLA's Triton chunk_kda (through k3train's fla_chunk_kda)
against it (output, final state and every gradient, in fp32, fp16 and bf16), and the layer and the whole model
with implementation="fla" against "chunk". Skipped without CUDA; the FLA checks also without flash-linear-attention
and triton (pip install 'k3train[gpu]'). `python -m pytest -m gpu` runs them; benchmarks/gpu_kda_speed.py times.

Metric for FLA, as FLA's own tests/ops/test_kda.py: RMS(fast - reference) / RMS(reference) per tensor."""

from __future__ import annotations

import contextlib

import pytest
import torch

from k3train.models.kda import KimiDeltaAttention, chunk_kda, fla_chunk_kda, naive_recurrent_kda

from helpers.kda_problems import NAMES, assert_close, document_ids_of, make_inputs, run
from helpers.tiny_k3 import batch, tiny_model

# slow too: on a GPU machine Triton's autotuning alone takes minutes, too long for the fast tier.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# FLA's test_chunk accepts these error ratios for fp16 inputs. Its fp32 dots run in TF32, which keeps fp16's 10
# mantissa bits, so fp32 gets them too; bf16 keeps 7, 8x fp16's rounding error, so 8x the tolerance.
FLA_TOLERANCE = {
    "o": 0.005,
    "final_state": 0.005,
    "dq": 0.008,
    "dk": 0.008,
    "dv": 0.008,
    "dg": 0.02,
    "dbeta": 0.02,
    "dinitial_state": 0.008,
}
DTYPE_FACTOR = {torch.float32: 1, torch.float16: 1, torch.bfloat16: 8}

# (B, T, H, HV, K, V): the CPU benchmark's shape, grouped values with a T that is no multiple of the chunk, and
# the paper's head size.
FLA_SHAPES = {
    "cpu_bench": (1, 2048, 4, 4, 64, 64),
    "gva_ragged_T": (2, 1000, 4, 8, 64, 64),
    "head_dim_128": (2, 2048, 8, 8, 128, 128),
}


@pytest.fixture(scope="module")
def fla():
    pytest.importorskip("triton", reason="triton not installed: pip install 'k3train[gpu]'")
    pytest.importorskip("fla.ops.kda", reason="flash-linear-attention not installed: pip install 'k3train[gpu]'")


def to_cuda(inputs: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """As the layer hands them over: q, k, v, beta in dtype; the log decay g and the initial state in fp32."""
    dtypes = (dtype, dtype, dtype, torch.float32, dtype, torch.float32)
    return [x.detach().to("cuda", dt).requires_grad_() for x, dt in zip(inputs, dtypes)]


def err_ratio(a: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (a.double() - ref.double()).square().mean().sqrt()
    return (diff / ref.double().square().mean().sqrt().clamp(min=1e-30)).item()


def test_chunk_on_cuda_matches_float64_reference():
    """The pure-PyTorch path on the GPU: fp32 CUDA against the float64 per-step reference on the CPU."""
    inputs64 = make_inputs(2, 150, 2, 4, 32, 32)
    result = run(chunk_kda, to_cuda(inputs64, torch.float32), chunk_size=64)
    assert result["o"].is_cuda and result["dq"].is_cuda
    assert_close(result, run(naive_recurrent_kda, inputs64), tol=1e-5)


def test_chunk_computes_in_fp32_under_cuda_bf16_autocast():
    inputs = [x.detach() for x in to_cuda(make_inputs(1, 80, 2, 2, 16, 16), torch.float32)]
    o_ref, S_ref = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        o, S = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)  # bf16 matmuls inside would miss by ~1e-2
    torch.testing.assert_close(S, S_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("fla")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", FLA_SHAPES.values(), ids=FLA_SHAPES.keys())
def test_fla_matches_chunk(shape, dtype):
    B, T, H, HV, K, V = shape
    inputs = to_cuda(make_inputs(B, T, H, HV, K, V, dtype=torch.float32), dtype)
    # The reference sees the same (possibly rounded) values and computes in fp32.
    reference = run(chunk_kda, [x.detach().float().requires_grad_() for x in inputs])
    result = run(fla_chunk_kda, inputs)
    assert result["o"].dtype == dtype and result["final_state"].dtype == torch.float32
    errors = {name: err_ratio(result[name], reference[name]) for name in NAMES}
    too_far = {
        name: f"{err:.2e}" for name, err in errors.items() if not err < FLA_TOLERANCE[name] * DTYPE_FACTOR[dtype]
    }  # `not <` also catches NaN
    assert not too_far, f"error ratios over tolerance: {too_far} (all: {errors})"


# The layer's forms for the layer check: FLA's own (softplus gate, low-rank output gate) on whole rows, and Kimi K3's
# (sigmoid gate with lower bound -5, hence chunk_kda's safe_gate; full-rank output gate) on rows packing documents
# (FLA's varlen conv and chunk_kda), one start at the chunk edge 512.
LAYER_FORMS = {
    "softplus_low_rank": ({}, None),
    "k3_sigmoid_full_rank_documents": ({"gate": "sigmoid", "output_gate": "full_rank"}, [[300, 724], [512, 200, 312]]),
}


@pytest.mark.usefixtures("fla")
@pytest.mark.parametrize("form", LAYER_FORMS.values(), ids=LAYER_FORMS.keys())
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16_autocast"])
def test_fla_layer_matches_chunk_layer(autocast, form):
    """The layer's forward on FLA's fused kernels (short conv, in-kernel gate, beta sigmoid and q/k L2 norm, gated
    RMSNorm: layer.py's _forward_fla) against chunk's. Under bf16 autocast FLA's conv writes q, k, v in bf16 where
    chunk's product with the fp32 conv weight promotes them to fp32: bf16's factor on the tolerances."""
    kwargs, lengths = form
    d_model, T = 512, 1024
    torch.manual_seed(0)
    reference = KimiDeltaAttention(d_model, n_heads=4, head_dim=d_model // 4, **kwargs).cuda()
    layer = KimiDeltaAttention(d_model, n_heads=4, head_dim=d_model // 4, implementation="fla", **kwargs).cuda()
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(2, T, d_model, device="cuda")
    document_ids = None if lengths is None else document_ids_of(lengths).cuda()
    outputs, grads = [], []
    for module in (layer, reference):
        with torch.autocast("cuda", dtype=autocast) if autocast else contextlib.nullcontext():
            y = module(x, documents=document_ids)
        y.float().square().mean().backward()
        outputs.append(y.detach())
        grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
    factor = DTYPE_FACTOR[autocast or torch.float32]
    assert outputs[0].dtype == (autocast or torch.float32)
    assert err_ratio(outputs[0], outputs[1]) < FLA_TOLERANCE["o"] * factor
    # Every weight's gradient passes through dq..dbeta; the loosest of their tolerances bounds the whole.
    assert err_ratio(grads[0], grads[1]) < FLA_TOLERANCE["dg"] * factor


@pytest.mark.usefixtures("fla")
def test_k3_model_with_fla_matches_chunk_under_bf16_autocast():
    """The whole model as training runs it on a GPU: one bf16-autocast forward and backward with KDA through FLA
    gives chunk's loss, and every weight a finite gradient."""
    x, y = batch(B=4, T=256)
    losses, grads = [], []
    for implementation in ("fla", "chunk"):
        model = tiny_model(kda_implementation=implementation, max_seq_len=256).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x.cuda(), y.cuda())
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.isfinite().all()]
        assert not missing, f"{implementation}: no or non-finite gradient for {missing}"
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert abs(losses[0] - losses[1]) < 1e-2 * losses[1], losses
    assert err_ratio(grads[0], grads[1]) < FLA_TOLERANCE["dg"] * DTYPE_FACTOR[torch.bfloat16]
