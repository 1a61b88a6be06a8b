"""The whole KimiDeltaAttention layer with implementation="fla" (FLA's short conv, in-kernel gate, beta sigmoid and
q/k L2 norm, fused gated RMSNorm: layer.py's _forward_fla) against implementation="chunk" with the same weights,
run by Triton's interpreter on CPU tensors in fp32 (tests/helpers/fla_interpreter.py): the output and the
gradients of x and of every parameter within 1e-4 of each tensor's largest value (the interpreter's dots are exact
fp32, so only fp32 rounding separates them; measured: a few 1e-6)."""

from __future__ import annotations

import pytest
import torch

import k3train.models.kda.layer as layer_module
from k3train.models.kda import KimiDeltaAttention

from helpers.fla_interpreter import NEEDS_INTERPRETER  # under TRITON_INTERPRET=1: patches the interpreter
from helpers.kda_problems import document_ids_of

pytestmark = NEEDS_INTERPRETER

TOLERANCE = 1e-4
D_MODEL = 64


def layers(**kwargs) -> tuple[KimiDeltaAttention, KimiDeltaAttention]:
    """(chunk, fla) layers of 2 heads of 32 with the same weights (fla's loads chunk's state_dict, strict)."""
    torch.manual_seed(0)
    chunk = KimiDeltaAttention(D_MODEL, n_heads=2, head_dim=32, **kwargs)
    fla = KimiDeltaAttention(D_MODEL, n_heads=2, head_dim=32, implementation="fla", **kwargs)
    fla.load_state_dict(chunk.state_dict())
    return chunk, fla


def forward_backward(layer: KimiDeltaAttention, x: torch.Tensor, document_ids=None) -> dict[str, torch.Tensor]:
    """y, dx and every parameter's gradient under a fixed random upstream gradient."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer(x, documents=document_ids)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    return {"y": y.detach(), "dx": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


def assert_close(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert have.keys() == want.keys()
    errors = {name: ((have[name] - want[name]).abs().max() / want[name].abs().max()).item() for name in want}
    too_far = {name: f"{err:.2e}" for name, err in errors.items() if not err < TOLERANCE}  # `not <` catches NaN
    assert not too_far, f"max |fla - chunk| / max |chunk| over {TOLERANCE}: {too_far}"


# Two rows of 96: documents of 20 / 50 / 26 (starts inside the first and second chunk of 64) and 64 / 32 (a start at
# the chunk edge); each start also cuts the short conv's window.
DOCUMENTS = document_ids_of([[20, 50, 26], [64, 32]])


def x_of(B: int, T: int) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def fused_calls(monkeypatch) -> list[tuple[str, dict]]:
    """The layer's calls into FLA's fused wrappers (name, keyword arguments), passed on unchanged: shows a test
    went through _forward_fla, not k3train's steps around fla_chunk_kda."""
    calls = []

    def spy(name):
        wrapped = getattr(layer_module, name)

        def call(*args, **kwargs):
            calls.append((name, kwargs))
            return wrapped(*args, **kwargs)

        monkeypatch.setattr(layer_module, name, call)

    for name in ("fla_short_conv_silu", "fla_chunk_kda_from_projections", "fla_rms_norm_sigmoid_gated"):
        spy(name)
    return calls


def test_fla_layer_with_the_softplus_gate_and_documents_equals_chunk(fused_calls):
    """FLA's own layer form (softplus gate, low-rank output gate with bias), rows packing documents: the conv and
    chunk_kda through FLA's varlen form, q and k normalised inside chunk_kda (qk_norm_eps is FLA's 1e-6)."""
    chunk, fla = layers()
    x = x_of(2, 96)
    want = forward_backward(chunk, x, DOCUMENTS)
    assert (want["y"] - forward_backward(chunk, x)["y"]).abs().max() > 1e-2  # the documents change the output
    assert_close(forward_backward(fla, x, DOCUMENTS), want)
    assert [name for name, _ in fused_calls] == [
        "fla_short_conv_silu",
        "fla_chunk_kda_from_projections",
        "fla_rms_norm_sigmoid_gated",
    ]
    kernel_options = fused_calls[1][1]
    assert kernel_options["normalize_qk"] and kernel_options["lower_bound"] is None
    assert kernel_options["cu_seqlens"].tolist() == [0, 20, 70, 96, 160, 192]


# tl.sigmoid is 1 / (1 + exp(-x)) and x = exp(A_log) (f + dt_bias) reaches ~ -100 with A_log's init: numpy's exp
# overflows to inf, the sigmoid to 0, where torch's sigmoid rounds to 0 in fp32 too.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_k3_layer_form_with_documents_equals_chunk(fused_calls):
    """Kimi K3's form: the sigmoid gate with its lower bound -5 (chunk_kda's in-kernel gate with lower_bound, and
    safe_gate), the full-rank output gate, grouped values (4 value heads over 2 q/k heads), documents."""
    chunk, fla = layers(gate="sigmoid", output_gate="full_rank", n_value_heads=4)
    x = x_of(2, 96)
    assert_close(forward_backward(fla, x, DOCUMENTS), forward_backward(chunk, x, DOCUMENTS))
    assert fused_calls[1][1]["lower_bound"] == -5.0


def test_what_fla_cannot_fuse_runs_outside_its_kernels_and_still_equals_chunk(fused_calls):
    """qk_norm_eps other than FLA's fixed 1e-6: q and k normalised by k3train before chunk_kda; a lower bound below
    safe_gate's -5: the in-kernel gate without safe_gate. T = 100 leaves a padded tail chunk, no documents."""
    chunk, fla = layers(gate="sigmoid", gate_lower_bound=-8.0, qk_norm_eps=1e-2)
    x = x_of(1, 100)
    assert_close(forward_backward(fla, x), forward_backward(chunk, x))
    kernel_options = fused_calls[1][1]
    assert not kernel_options["normalize_qk"] and kernel_options["lower_bound"] == -8.0


@torch.no_grad()
def test_fla_decoding_continues_the_prompt_as_chunk_does():
    """forward_cached with implementation="fla": a prompt of 40 (fla_chunk_kda), then two tokens one at a time
    (fused_recurrent_kda), the output norm through FLA's gated RMSNorm; against chunk's forward_cached."""
    chunk, fla = layers(gate="sigmoid", output_gate="full_rank")
    x = x_of(1, 42)
    outputs = []
    for layer in (chunk, fla):
        state = layer.empty_state(1, x.device, x.dtype)
        steps = [layer.forward_cached(x[:, :40], state)]
        steps += [layer.forward_cached(x[:, t : t + 1], state) for t in (40, 41)]
        outputs.append(torch.cat(steps, dim=1))
    want, have = outputs
    err = ((have - want).abs().max() / want.abs().max()).item()
    assert err < TOLERANCE, f"max |fla - chunk| / max |chunk| = {err:.2e}"
