"""linear_cross_entropy (k3train/models/common/loss.py) against F.cross_entropy on the whole logits: the loss and its
gradients, in fp32 and under bf16 autocast, with ignored targets, at chunk sizes that do and do not divide N; and
KimiK3's fused path against its old lm_head + F.cross_entropy path, tied and untied."""

import functools

import pytest
import torch
import torch.nn.functional as F

from k3train.models.common.loss import (
    IGNORE_INDEX,
    TargetLosses,
    default_chunk_size,
    linear_cross_entropy,
)
from k3train.models.k3 import KimiK3

from helpers.loss_problems import loss_and_grads, problem, reference
from helpers.tiny_k3 import TINY as TINY_K3


def assert_matches_reference(hidden, weight, targets, rtol=1e-5, atol=1e-7, **kwargs):
    want = loss_and_grads(reference, hidden, weight, targets, grad_scale=0.7)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, targets, grad_scale=0.7, **kwargs)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    "n, d, v, chunk_size",
    [
        (64, 16, 50, 16),  # chunks divide N
        (100, 32, 257, 24),  # a short last chunk
        (37, 8, 1000, 1),  # one row per chunk
        (50, 24, 300, 4096),  # one chunk larger than N
        (9000, 16, 2048, None),  # the default: 8192-row chunks at V=2048, so two
    ],
)
def test_loss_and_gradients_equal_the_whole_logits_reference(n, d, v, chunk_size):
    if chunk_size is None:
        assert default_chunk_size(v) < n
    assert_matches_reference(*problem(n, d, v), chunk_size=chunk_size)


def test_unscaled_backward_twice_through_a_retained_graph_with_grads_edited_in_place_between():
    """grad_loss == 1 hands back the saved gradients themselves: autograd must copy them, not adopt them, while the
    graph keeps them, or editing .grad in place (clipping does) would change what the second backward returns."""
    hidden, weight, targets = problem(64, 16, 50)
    want = torch.autograd.grad(reference(hidden, weight, targets), (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    loss.backward(retain_graph=True)
    for t in (hidden, weight):
        t.grad.mul_(0.5)
    loss.backward()
    for t, w in zip((hidden, weight), want):
        torch.testing.assert_close(t.grad, 1.5 * w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk_size", [7, 64])
def test_ignored_targets_count_neither_in_the_sum_nor_in_the_mean(chunk_size):
    hidden, weight, targets = problem(64, 16, 50, ignored=0.4)
    assert 0 < (targets == IGNORE_INDEX).sum() < 64
    assert_matches_reference(hidden, weight, targets, chunk_size=chunk_size)
    # the gradient rows of ignored targets are exactly zero
    _, grad_hidden, _ = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk_size=chunk_size)
    assert grad_hidden[targets == IGNORE_INDEX].abs().max() == 0


@pytest.mark.parametrize("with_grad", [True, False])
def test_target_losses_get_each_targets_loss_and_leave_the_mean_and_gradients_bitwise(with_grad):
    """target_losses (a mixture's loss per source): per target F.cross_entropy's reduction="none" within 1e-6, 0
    where ignored; the mean and its gradients the same bits as without them; each call adds to the one it is handed."""
    hidden, weight, targets = problem(100, 16, 257, ignored=0.2)
    want = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none").detach()
    plain = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk_size=24)
    recorded, other = TargetLosses(), TargetLosses()
    with torch.set_grad_enabled(with_grad):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=24, target_losses=recorded)
        linear_cross_entropy(hidden, weight, targets, chunk_size=24)  # handed none: adds to none
        linear_cross_entropy(hidden, weight, targets, chunk_size=24, target_losses=other)
    assert len(recorded.parts) == 1 and len(other.parts) == 1
    losses, kept = recorded.parts[0]
    assert torch.equal(kept, targets != IGNORE_INDEX) and not losses.requires_grad
    torch.testing.assert_close(losses, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(loss.detach(), plain[0].detach())
    if with_grad:
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(loss, (hidden, weight)), plain[1:]))


def test_handed_target_losses_the_fused_kernel_still_computes_the_mean_and_gradients(monkeypatch):
    """Where FLA's fused kernel runs (CUDA tensors, flash-linear-attention installed), a mixture's target_losses do
    not turn it off: the mean and its gradients are the kernel's, the per-target losses a chunked pass's without
    gradients. Here, on a CPU, the kernel is stood in for by the whole-logits reference, counted."""
    import k3train.models.common.loss as loss_module

    calls = []

    def fused(hidden, weight, targets):
        calls.append(hidden.shape[0])
        return reference(hidden, weight, targets)

    monkeypatch.setattr(loss_module, "_fla_fits", lambda hidden: True)
    monkeypatch.setattr(loss_module, "_fla_linear_cross_entropy", fused)
    hidden, weight, targets = problem(100, 16, 257, ignored=0.2)
    collected = TargetLosses()
    got = loss_and_grads(linear_cross_entropy, hidden, weight, targets, target_losses=collected)
    assert calls == [100]  # the fused kernel took the loss and its gradients
    for a, b in zip(got, loss_and_grads(reference, hidden, weight, targets)):
        assert torch.equal(a, b)
    want = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none").detach()
    (losses, kept), *more = collected.parts
    assert not more and not losses.requires_grad and torch.equal(kept, targets != IGNORE_INDEX)
    torch.testing.assert_close(losses, want, rtol=1e-6, atol=1e-6)


def test_every_target_ignored_gives_nan_loss_and_zero_gradients_as_f_cross_entropy():
    hidden, weight, targets = problem(20, 8, 30)
    targets[:] = IGNORE_INDEX
    want = loss_and_grads(reference, hidden, weight, targets)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk_size=8)
    assert want[0].isnan() and got[0].isnan()
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, b) and not a.any()
    with torch.no_grad():
        assert linear_cross_entropy(hidden, weight, targets).isnan()


def test_without_grad_only_the_loss_is_computed_and_it_is_the_same():
    hidden, weight, targets = problem(100, 32, 257, ignored=0.1)
    with torch.no_grad():
        want = reference(hidden, weight, targets)
        got = linear_cross_entropy(hidden, weight, targets, chunk_size=24)
    assert got.grad_fn is None
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    detached = linear_cross_entropy(hidden.detach(), weight.detach(), targets, chunk_size=24)  # nothing to train
    assert detached.grad_fn is None and torch.equal(detached, got)


def test_bf16_autocast_matmuls_in_bf16_and_matches_the_reference_under_the_same_autocast():
    hidden, weight, targets = problem(200, 64, 500, ignored=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(reference, hidden, weight, targets)
        got = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk_size=48)
    exact = loss_and_grads(reference, hidden, weight, targets)
    assert got[0].dtype == torch.float32  # the softmax and the loss stay fp32
    assert got[1].dtype == got[2].dtype == torch.float32  # gradients in the inputs' dtypes
    for name, a, b, c in zip(("loss", "grad_hidden", "grad_weight"), got, want, exact):
        # bf16 rounds the logits and the gradient's matmul inputs (8 bits of mantissa), as the reference does
        torch.testing.assert_close(
            a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=lambda m, name=name: f"{name}: {m}"
        )
        # the bf16 run is measurably not the fp32 one: the matmuls really ran in bf16
        assert (a - c).abs().max() > 1e-6 * c.abs().max(), name


def test_bf16_inputs_get_bf16_gradients():
    hidden, weight, targets = problem(40, 16, 64, dtype=torch.bfloat16)
    loss, grad_hidden, grad_weight = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk_size=16)
    want = loss_and_grads(reference, hidden, weight, targets)
    assert loss.dtype == torch.float32 and grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    for a, b in zip((loss, grad_hidden, grad_weight), want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_bad_shapes_and_chunk_sizes_are_refused():
    hidden, weight, targets = problem(10, 8, 20)
    with pytest.raises(ValueError, match="hidden \\[N, d\\], weight \\[V, d\\]"):
        linear_cross_entropy(hidden, weight[:, :4], targets)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, targets, chunk_size=0)


TINY = {**TINY_K3, "n_layers": 2, "kda_mla_ratio": "1:1"}  # one KDA and one MLA layer


def old_head_and_loss(model: KimiK3, x, y):
    """KimiK3's loss before linear_cross_entropy: lm_head on the final norm's output, F.cross_entropy on the whole
    logits in fp32."""
    h = model.embed_tokens(x)
    for layer in model.layers:
        h = layer(h)
    logits = model.lm_head(model.norm(h))
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@pytest.mark.parametrize("tie", [False, True])
def test_k3_fused_loss_and_gradients_equal_the_old_logits_path(tie):
    torch.manual_seed(0)
    model = KimiK3.from_fields(**TINY, tie_embeddings=tie).eval()  # eval: no MoE bias update between the passes
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 61, (3, 40), generator=g), torch.randint(0, 61, (3, 40), generator=g)
    params = dict(model.named_parameters())

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in params.items()}

    want_loss = old_head_and_loss(model, x, y)
    want = grads(want_loss)
    logits, loss = model(x, y)
    assert logits is None
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    got = grads(loss)
    for name in params:  # a tied weight's gradient sums the head's and the embedding's
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(model(x, y)[1], want_loss, rtol=1e-6, atol=0)


@pytest.mark.slow  # ~25 s of inductor compilation on 2 cores
def test_torch_compile_traces_it_whole_and_gives_the_same_loss_and_gradients():
    """train.compile=true compiles the model: the loss must not break the graph (a host sync, a data-dependent
    branch) and must compute the same."""
    import torch._dynamo

    hidden, weight, targets = problem(100, 32, 257, ignored=0.1)

    def loss_fn(h, w, t):
        return linear_cross_entropy(torch.tanh(h), w, t, chunk_size=24)

    want = loss_and_grads(loss_fn, hidden, weight, targets, grad_scale=0.7)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = loss_and_grads(torch.compile(loss_fn), hidden, weight, targets, grad_scale=0.7)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    # and handed target_losses (a mixture's loss per source under train.compile): the per-target losses come out too
    def loss_fn_with(h, w, t, into):
        return linear_cross_entropy(torch.tanh(h), w, t, chunk_size=24, target_losses=into)

    eager, compiled = TargetLosses(), TargetLosses()
    loss_fn_with(hidden, weight, targets, eager)
    got = loss_and_grads(
        functools.partial(torch.compile(loss_fn_with), into=compiled), hidden, weight, targets, grad_scale=0.7
    )
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert len(eager.parts) == len(compiled.parts) == 1
    torch.testing.assert_close(compiled.parts[0][0], eager.parts[0][0], rtol=1e-5, atol=1e-6)
    assert torch.equal(compiled.parts[0][1], eager.parts[0][1])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_default_chunk_holds_a_larger_block_on_a_gpu():
    """On CPU a 64 MiB fp32 logits block is fastest; on a GPU launches dominate small chunks (H200: 2048 rows of
    V=163840 took 340 ms fwd+bwd against 365 ms at 512), so there a block holds 2048 x 163840 values."""
    assert default_chunk_size(32768) == 512 and default_chunk_size(32768, "cpu") == 512
    assert default_chunk_size(163840, "cuda") == 2048
    assert default_chunk_size(32768, "cuda") == 10240  # k3_small's whole 2 x 1024 batch in one block
    assert default_chunk_size(10**9, "cuda") == 1  # never zero rows
