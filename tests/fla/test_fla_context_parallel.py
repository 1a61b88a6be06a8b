"""k3train's context-parallel KDA (k3train/models/kda/context_parallel.py: each rank's slice summarised from a zero
state and from the identity, the summaries all-gathered and composed) against FLA's own (fla.ops.cp: chunk_kda with a
cp_context), on 2 gloo ranks in Triton's interpreter, fp32: the same slices in, the same outputs and gradients out.

Two things in fla.ops.cp are made to run on CPU tensors over gloo, neither part of the maths: its device check
(NVIDIA or Ascend only) and its all-gather, which hands gloo an output shaped [world, n, ...] where gloo wants
[world * n, ...] (NCCL takes either)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from k3train.models.context_parallel import ContextParallel
from k3train.models.kda.context_parallel import context_parallel_chunk_kda

from helpers.fla_interpreter import NEEDS_INTERPRETER  # under TRITON_INTERPRET=1: patches the interpreter
from helpers.kda_problems import document_ids_of, make_inputs
from helpers.spawn import spawn_ranks

pytestmark = NEEDS_INTERPRETER

LENGTHS = [40, 110, 42]  # 192 positions; the second document crosses the split at 96
TOLERANCE = 1e-4


def fla_over_gloo_on_cpu() -> None:
    import fla.ops.cp.chunk_bwd
    import fla.ops.cp.chunk_delta_h
    import fla.ops.cp.chunk_fwd
    import fla.ops.cp.chunk_merge
    import fla.ops.cp.comm

    for module in (fla.ops.cp.chunk_bwd, fla.ops.cp.chunk_delta_h, fla.ops.cp.chunk_fwd, fla.ops.cp.chunk_merge):
        module._check_cp_device = lambda device: None

    def all_gather_into_tensor(inp, out=None, group=None, async_op=False):
        if out is None:
            out = torch.empty(dist.get_world_size(group), *inp.shape, device=inp.device, dtype=inp.dtype)
        work = dist.all_gather_into_tensor(
            out.view(-1, *inp.shape[1:]), inp.contiguous(), group=group, async_op=async_op
        )
        return out, work

    fla.ops.cp.comm.all_gather_into_tensor = all_gather_into_tensor
    fla.ops.cp.chunk_delta_h.all_gather_into_tensor = all_gather_into_tensor


def both_on_this_rank(documents: bool, rank: int, world_size: int) -> dict:
    """This rank's slice through FLA's cp chunk_kda and through k3train's: outputs and input gradients of each."""
    fla_over_gloo_on_cpu()
    from fla.ops.cp import build_cp_context
    from fla.ops.kda import chunk_kda

    T = sum(LENGTHS)
    inputs = make_inputs(1, T, 2, 2, 32, 32, dtype=torch.float32, with_state=False)[:5]
    upstream = torch.randn(1, T, 2, 32, generator=torch.Generator().manual_seed(4))
    ids = document_ids_of([LENGTHS] if documents else [[T]])
    n = T // world_size
    mine = slice(rank * n, (rank + 1) * n)
    results = {}
    for name in ("fla", "k3train"):
        q, k, v, g, beta = (x.detach()[:, mine].clone().requires_grad_() for x in inputs)
        if name == "fla":
            context = build_cp_context(torch.tensor([0, *ids[0].bincount().tolist()]).cumsum(0), group=dist.group.WORLD)
            o, _ = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, cp_context=context)
        else:
            cp = ContextParallel(dist.group.WORLD)
            o = context_parallel_chunk_kda(q, k, v, g, beta, cp, chunk_size=64, document_ids=ids[:, mine])
        (o * upstream[:, mine]).sum().backward()
        results[name] = [o.detach(), *(x.grad for x in (q, k, v, g, beta))]
    return {
        name: ((a - b).abs().max() / b.abs().max()).item()
        for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), results["fla"], results["k3train"])
    }


@pytest.mark.parametrize("documents", [True, False], ids=["a_document_across_the_split", "one_document"])
def test_k3trains_context_parallel_kda_equals_flas_on_two_ranks(documents, tmp_path):
    """Measured: 0.8-4.4e-6 of each tensor's largest value; k3train's cp told to ignore the documents that FLA's
    cu_seqlens hold is 0.10-0.46 off, so the comparison sees a wrong document boundary."""
    for rank, errors in enumerate(spawn_ranks(functools.partial(both_on_this_rank, documents), tmp_path)):
        too_far = {name: f"{err:.2e}" for name, err in errors.items() if not err < TOLERANCE}
        assert not too_far, f"rank {rank}: max |fla - k3train| / max |k3train| over {TOLERANCE}: {too_far}"
