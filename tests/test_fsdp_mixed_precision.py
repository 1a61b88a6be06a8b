"""FSDP2's mixed precision under precision=bf16 (Precision.fsdp_policy, handed to every fully_shard by the FSDP
strategy): on 2 gloo ranks the all-gathers move bf16, the gradients are reduce-scattered in fp32, the parameters,
their gradients and the optimizer state stay fp32, and the losses follow one process's bf16 (autocast) run."""

import collections

import pytest
import torch
from hydra.utils import instantiate

from k3train.train.precision import Precision

from helpers.config import composed
from helpers.spawn import spawn_ranks

# k3_tiny shrunk as tests/test_plan.py's SMALL: Muon + AdamW, the Quantile-Balanced MoE, QK-Clip off.
SMALL = [
    "model=k3_tiny",
    "model.vocab_size=257",
    "optim.ns_dtype=fp32",
    "model.d_model=64",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.kda_chunk_size=16",
    "precision=bf16",
]
STEPS, SEQ = 3, 32
# bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-9 of itself. Under the policy the weights
# autocast leaves fp32 in one process (the embedding table, norm gains, the router) are rounded to bf16 too (every
# matmul already rounds its inputs to bf16 in both runs), and the reductions sum in another order; the loss, a mean
# over tokens of many such roundings, moves by far less than one: measured 1.2e-4 to 2.0e-4 relative over the 3
# steps (Xeon, 2 cores). The bound is half of bf16's unit roundoff, 2^-10 (9.8e-4): a gradient reduced in bf16
# rather than fp32 or a rank's gradient lost or not averaged moves the updates, and the loss after them, by more.
BF16_BOUND = 2.0**-10


def batches() -> list[torch.Tensor]:
    """The global batch of every step: 2 rows, rank r training row r."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 257, (2, SEQ), generator=g) for _ in range(STEPS)]


def train(model, optimizer, precision: Precision, rows: list[torch.Tensor]) -> list[float]:
    losses = []
    for x in rows:
        optimizer.zero_grad(set_to_none=True)  # the last step's gradients kept: their dtype is checked
        with precision.autocast(torch.device("cpu")):
            _, loss = model(x, targets=x)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _rank_main(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from k3train.runtime.parallel_dims import ParallelDims
    from k3train.train.parallel import FSDP

    seen: dict[str, collections.Counter] = {
        "all-gather": collections.Counter(),
        "reduce-scatter": collections.Counter(),
    }
    all_gather = _fsdp_collectives.DefaultAllGather.__call__
    reduce_scatter = _fsdp_collectives.DefaultReduceScatter.__call__

    def counting_gather(self, output_tensor, input_tensor, group, async_op=False):
        seen["all-gather"][str(output_tensor.dtype)] += output_tensor.nbytes
        return all_gather(self, output_tensor, input_tensor, group, async_op)

    def counting_scatter(self, output_tensor, input_tensor, group, op, async_op=False):
        seen["reduce-scatter"][str(input_tensor.dtype)] += input_tensor.nbytes
        return reduce_scatter(self, output_tensor, input_tensor, group, op, async_op)

    _fsdp_collectives.DefaultAllGather.__call__ = counting_gather
    _fsdp_collectives.DefaultReduceScatter.__call__ = counting_scatter
    cfg = composed(*SMALL)
    precision = instantiate(cfg.precision)
    torch.manual_seed(0)
    model = instantiate(cfg.model).train()
    dims = ParallelDims.for_strategy("fsdp", world_size, rank, "cpu")
    parallel = FSDP(mixed_precision=precision.dtype)
    model = parallel.shard(model, torch.device("cpu"), dims)
    # what forward computes with: the weights as FSDP2 hands them to the blocks (unsharded, inside the forward)
    from torch import nn

    block = next(m for m in model.modules() if isinstance(m, nn.ModuleList))[0]
    computed = []
    block.register_forward_pre_hook(lambda m, a: computed.append({p.dtype for p in m.parameters(recurse=True)}))
    optimizer = instantiate(cfg.optim)(model, process_group=dims.dp_group)
    losses = train(model, optimizer, precision, [x[rank : rank + 1] for x in batches()])
    state = [
        t.dtype for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.is_floating_point()
    ]
    return {
        "losses": losses,
        "gathered": dict(seen["all-gather"]),
        "reduced": dict(seen["reduce-scatter"]),
        "params": sorted({str(p.dtype) for p in model.parameters()}),
        "grads": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        "state": sorted({str(d) for d in state}),
        "computed": sorted({str(d) for ds in computed for d in ds}),
    }


def test_precision_asks_fsdp2_for_bf16_gathers_and_fp32_reductions() -> None:
    policy = Precision("bf16").fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        False,
    )
    assert Precision("fp16").fsdp_policy().param_dtype == torch.float16
    assert Precision("fp32").fsdp_policy() is None and Precision("fp64").fsdp_policy() is None


@pytest.mark.slow  # 2 spawned gloo ranks: a few seconds
def test_fsdp2_bf16_gathers_bf16_reduces_fp32_and_trains_as_one_process(tmp_path) -> None:
    ranks = spawn_ranks(_rank_main, tmp_path)
    for rank, got in enumerate(ranks):
        assert set(got["gathered"]) == {"torch.bfloat16"}, f"rank {rank}: {got['gathered']}"
        assert set(got["reduced"]) == {"torch.float32"}, f"rank {rank}: {got['reduced']}"
        assert got["params"] == got["grads"] == got["state"] == ["torch.float32"], f"rank {rank}"
        assert got["computed"] == ["torch.bfloat16"], f"rank {rank}: the forward's weights {got['computed']}"
    # the same bytes as an fp32 gather of the same units, halved
    assert ranks[0]["gathered"] == ranks[1]["gathered"]

    cfg = composed(*SMALL)
    precision = instantiate(cfg.precision)
    torch.manual_seed(0)
    model = instantiate(cfg.model).train()
    one = train(model, instantiate(cfg.optim)(model), precision, batches())
    both = [sum(r["losses"][i] for r in ranks) / 2 for i in range(STEPS)]  # a row each: the global batch's mean
    assert all(torch.isfinite(torch.tensor(both)))
    assert both == pytest.approx(one, rel=BF16_BOUND), (both, one)
