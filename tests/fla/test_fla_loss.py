"""linear_cross_entropy's implementation="fla" (flash-linear-attention's fused linear cross-entropy, what `auto`
takes on CUDA) against the whole-logits reference and the chunked path, run by Triton's interpreter on CPU tensors
(tests/helpers/fla_interpreter.py)."""

from __future__ import annotations

import torch

from k3train.models.common.loss import IGNORE_INDEX, linear_cross_entropy

from helpers.fla_interpreter import NEEDS_INTERPRETER  # under TRITON_INTERPRET=1: patches the interpreter
from helpers.loss_problems import loss_and_grads, problem, reference

pytestmark = NEEDS_INTERPRETER


def test_fla_equals_the_whole_logits_with_ignored_targets_and_a_scaled_backward():
    hidden, weight, targets = problem(96, 64, 1000, ignored=0.1)
    want = loss_and_grads(reference, hidden, weight, targets, grad_scale=0.7)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, targets, grad_scale=0.7, implementation="fla")
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_fla_with_every_target_ignored_is_nan_with_zero_gradients_as_the_chunked_path():
    """FLA's own kernel divides by at least one target (a loss of 0); k3train's wrapper gives F.cross_entropy's NaN."""
    hidden, weight, targets = problem(32, 64, 300)
    targets[:] = IGNORE_INDEX
    for implementation in ("fla", "chunked"):
        loss, grad_hidden, grad_weight = loss_and_grads(
            linear_cross_entropy, hidden, weight, targets, implementation=implementation
        )
        assert loss.isnan(), implementation
        assert grad_hidden.abs().sum() == 0 and grad_weight.abs().sum() == 0, implementation


def test_auto_keeps_the_chunked_path_for_cpu_tensors():
    """`auto` takes FLA's kernel only for CUDA tensors: on a CPU, even with FLA importable, the result is the
    chunked path's to the bit."""
    hidden, weight, targets = problem(64, 32, 200, ignored=0.1)
    auto = loss_and_grads(linear_cross_entropy, hidden, weight, targets)
    chunked = loss_and_grads(linear_cross_entropy, hidden, weight, targets, implementation="chunked")
    assert all(torch.equal(a, b) for a, b in zip(auto, chunked))
