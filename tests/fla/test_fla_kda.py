"""FLA's chunk_kda and fused_recurrent_kda (through k3train/models/kda/fla.py, as the layer calls them) against
k3train's chunk_kda, run by Triton's interpreter on CPU tensors in fp32 (tests/helpers/fla_interpreter.py). The
interpreter's dots are exact fp32, so both sides differ by fp32 rounding alone: 1e-4 of each tensor's largest
value."""

from __future__ import annotations

import torch

from k3train.models.kda import chunk_kda, fla_chunk_kda
from k3train.models.kda.fla import fla_fused_recurrent_kda

from helpers.fla_interpreter import NEEDS_INTERPRETER  # under TRITON_INTERPRET=1: patches the interpreter
from helpers.kda_problems import assert_close, document_ids_of, make_inputs, run

pytestmark = NEEDS_INTERPRETER

TOLERANCE = 1e-4


def test_fla_chunk_kda_equals_chunk_kda_with_a_padded_tail():
    """T = 100: one whole chunk of 64 and a padded one; an initial state in, the final state out, every gradient."""
    inputs = make_inputs(1, 100, 2, 2, 32, 32, dtype=torch.float32)
    reference = run(chunk_kda, inputs)
    assert_close(run(fla_chunk_kda, inputs), reference, TOLERANCE)


def test_fla_documents_through_cu_seqlens_equal_chunk_kda_with_document_ids():
    """Two rows of 96 packing documents of 20 / 50 / 26 and 64 / 32 (one ends at a chunk edge): FLA's varlen form
    (cu_seqlens over the flattened rows, fla.py's conversion and its choice of each row's last final state) against
    chunk_kda restarting its state at each document. Without the documents FLA's output is far off, so the
    comparison sees them."""
    ids = document_ids_of([[20, 50, 26], [64, 32]])
    q, k, v, g, beta, _ = make_inputs(2, 96, 2, 2, 32, 32, dtype=torch.float32, with_state=False)
    results = []
    for fn in (chunk_kda, fla_chunk_kda):
        for x in (q, k, v, g, beta):
            x.grad = None
        o, state = fn(q, k, v, g, beta, output_final_state=True, document_ids=ids)
        gen = torch.Generator().manual_seed(1)
        (
            (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
        ).backward()
        results.append([o.detach(), state.detach(), *(x.grad.clone() for x in (q, k, v, g, beta))])
    for name, have, want in zip(("o", "final_state", "dq", "dk", "dv", "dg", "dbeta"), results[1], results[0]):
        err = ((have - want).abs().max() / want.abs().max()).item()
        assert err < TOLERANCE, f"{name}: {err:.2e}"
    across, _ = fla_chunk_kda(q, k, v, g, beta)
    assert (across - results[0][0]).abs().max() > 1e-2


def test_fla_documents_with_an_initial_state_equal_chunk_kda():
    """Two rows of 96 packing documents of 20 / 50 / 26 and 64 / 32, each row starting from its own initial state:
    fla.py hands it to the row's first document and a zero state to every other (FLA's varlen form wants one per
    sequence), as chunk_kda applies it to each row's first document only. Outputs, final states and every gradient,
    the initial state's included."""
    ids = document_ids_of([[20, 50, 26], [64, 32]])
    inputs = make_inputs(2, 96, 2, 2, 32, 32, dtype=torch.float32)
    reference = run(chunk_kda, inputs, document_ids=ids)
    assert_close(run(fla_chunk_kda, inputs, document_ids=ids), reference, TOLERANCE)


def test_fla_fused_recurrent_kda_equals_chunk_kda_forward():
    """The decoding kernel (forward only) from an initial state over 80 steps: output and final state."""
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(1, 80, 2, 2, 32, 32, dtype=torch.float32))
    want = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    have = fla_fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for name, a, b in zip(("o", "final_state"), have, want):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < TOLERANCE, f"{name}: {err:.2e}"
