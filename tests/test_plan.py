"""`python -m k3train.plan` (k3train/plan/): its figures against what k3train really allocates and sends.

- the saved-activation formula against the tensors autograd saves, layer by layer (every checkpointing mode, fp32
  and a bf16 autocast, K3's form and Kimi Linear's), and with each row split over ranks (context parallelism): in
  one process through a 1-rank group, and on both ranks of a real 2-rank split (slow);
- parameter, gradient and optimizer-state bytes against a real k3_tiny after one step (MuonAdamW and AdamW);
- FSDP's all-gathers and reduce-scatters, DDP's all-reduce, Newton-Schulz's and Quantile Balancing's gathers
  against a real 2-rank gloo run (slow: spawned ranks), the EP all-to-all by hand and against a real exchange, and
  context parallelism's all-gathers and reduce-scatters against a real cp = 2 split;
- the CLI: model=k3 on 1,024 H200s in seconds, a table; exit 2 when nothing fits; the hardware table's FLOP/s are
  k3train/observe/mfu.py's.
The measured peak memory of k3_small against the prediction is benchmarks/bench_plan.py's (seconds per step).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch.utils.flop_counter import FlopCounterMode

from k3train.models.common.context_parallel import ContextParallel, set_context_parallel
from k3train.models.k3 import mla
from k3train.models.k3.flops import chunk_state_macs
from k3train.observe.mfu import gpu_peak
from k3train.optim.muon_distributed import newton_schulz_cost
from k3train.optim.qk_clip import set_max_logit_tracking
from k3train.plan.__main__ import main
from k3train.plan.activations import F32, I64, ContextSlice, layer_activations, root_activations
from k3train.plan.comm import plan_comm
from k3train.plan.command import launch, run_overrides, short_rows
from k3train.plan.estimate import estimate, propose
from k3train.plan.extra_flops import context_flops_per_token, qk_clip_flops
from k3train.plan.hardware import GPUS, lookup
from k3train.plan.memory import plan_memory
from k3train.plan.mesh import Mesh, candidates
from k3train.plan.muon import muon_groups, muon_shares
from k3train.plan.spec import build_spec

from helpers.config import composed
from helpers.spawn import spawn_ranks

TINY = ["model=k3_tiny", "model.vocab_size=257"]
# The 2-rank runs' model: k3_tiny shrunk as helpers/distributed_runs.py's K3, one sequence per rank.
SMALL = [
    *TINY,
    "optim.ns_dtype=fp32",
    "model.d_model=64",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.kda_chunk_size=16",
    "train.seq_len=32",
    "train.batch_size=1",
]
# (checkpointing, micro-batches, precision): under bf16 FSDP2 gathers bf16 and reduce-scatters fp32 (fsdp_policy)
FSDP_CASES = {
    "none, 1 micro-batch": ("none", 1, "fp32"),
    "block, 2 micro-batches": ("block", 2, "fp32"),
    "bf16, block, 2 micro-batches": ("block", 2, "bf16"),
}


def spec_of(*overrides: str, device: str = "cpu"):
    return build_spec(composed(*overrides), device)


# ---- activations -------------------------------------------------------------------------------------------------
def saved_bytes_by_layer(model, x, y, autocast: bool, document_ids=None) -> dict[str, int]:
    """Bytes of every storage autograd saves in a forward (each once, parameters left out), by the layer that saved
    it ("layers.<i>", or "root" for the embedding, final norm and loss)."""
    stack = ["root"]
    for name, module in model.named_modules():
        if name.startswith("layers.") and name.count(".") == 1:
            module.register_forward_pre_hook(lambda m, a, n=name: stack.append(n))
            module.register_forward_hook(lambda m, a, o: stack.pop() and None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in params:
            seen[storage.data_ptr()] = (stack[-1], storage.nbytes())
        return t

    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, targets=y, document_ids=document_ids)
    by_layer: dict[str, int] = collections.defaultdict(int)
    for where, nbytes in seen.values():
        by_layer[where] += nbytes
    return by_layer


@pytest.mark.parametrize("mode", ["none", "block", "selective"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model_name", ["k3_tiny", "kimi_linear_tiny"])
def test_the_activation_formula_is_what_autograd_saves(model_name: str, precision: str, mode: str) -> None:
    """Layer by layer within 1%, at a seq_len that pads KDA's last chunk. Under block checkpointing a MoE layer also
    keeps its routing for the recompute, outside autograd (in the MoE's `routes`): the formula counts it."""
    cfg = composed(f"model={model_name}", "model.vocab_size=257")
    torch.manual_seed(0)
    model = instantiate(cfg.model).train()
    model.set_activation_checkpointing(mode)
    c, B, T = model.config, 2, 40
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 257, (B, T), generator=g) for _ in range(2))
    act = 2 if precision == "bf16" else 4
    got = saved_bytes_by_layer(model, x, y, autocast=precision == "bf16")
    for i in range(c.n_layers):
        la = layer_activations(c, i, B * T, T, mode, act, "cpu", c.n_routed_experts)
        routes = B * T * c.experts_per_token * I64 if mode == "block" and c.is_moe_layer(i) else 0
        assert la.saved + la.copies_saved - routes == pytest.approx(got[f"layers.{i}"], rel=0.01), f"layer {i}"
    assert root_activations(c, B * T, act) == pytest.approx(got["root"], rel=0.01)


def formula_ratios(
    c, got: dict, B: int, T: int, mode: str, act: int, context: ContextSlice | None, documents: bool
) -> list[float]:
    """Each layer's formula over what autograd saved (T: this rank's positions of each of the B rows)."""
    ratios = []
    for i in range(c.n_layers):
        la = layer_activations(c, i, B * T, T, mode, act, "cpu", c.n_routed_experts, context, documents)
        routes = B * T * c.experts_per_token * I64 if mode == "block" and c.is_moe_layer(i) else 0
        ratios.append((la.saved + la.copies_saved - routes) / got[f"layers.{i}"])
    return ratios


def split_documents(B: int, T: int) -> torch.Tensor:
    """Document ids of B rows of T: a boundary in the first third and one in the second half."""
    ids = torch.zeros(B, T, dtype=torch.long)
    ids[:, T // 3 :], ids[:, T // 2 + 3 :] = 1, 2
    return ids


@dataclass(frozen=True)
class PretendSplit(ContextParallel):
    """Rank `at` of `of` ranks splitting a row, in one process: every rank's share of an exchange is a copy of this
    rank's, gathered into one tensor as the real all-gather gathers (so the same tensors are saved); no backward
    exchange. The real exchange, on 2 ranks: test_context_parallel_bytes_equal_a_two_rank_split."""

    at: int = 0
    of: int = 1

    @property
    def rank(self) -> int:
        return self.at

    @property
    def size(self) -> int:
        return self.of

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.cat([t.contiguous()] * self.of).chunk(self.of))


@pytest.mark.parametrize(
    "model_name, precision, mode, documents, rank, size",
    [
        ("k3_tiny", "fp32", "none", False, 0, 1),
        ("k3_tiny", "fp32", "none", True, 1, 2),
        ("k3_tiny", "bf16", "none", True, 3, 4),
        ("k3_tiny", "fp32", "selective", True, 2, 3),
        ("kimi_linear_tiny", "fp32", "none", False, 2, 3),
        ("kimi_linear_tiny", "bf16", "none", False, 1, 2),
    ],
)
def test_the_context_parallel_formula_is_what_autograd_saves(
    model_name: str, precision: str, mode: str, documents: bool, rank: int, size: int
) -> None:
    """Layer by layer within 1% on slice `rank` of `size` (in one process; 2 real ranks: the slow test): KDA's
    identity pass, the conv window and the composition of the slices before, MLA's keys up to the slice's last and
    its dense mask, at a slice length that pads KDA's last chunk."""
    cfg = composed(f"model={model_name}", "model.vocab_size=257")
    torch.manual_seed(0)
    model = instantiate(cfg.model).train()
    model.set_activation_checkpointing(mode)
    assert set_context_parallel(model, PretendSplit(None, rank, size))
    c, B, T = model.config, 2, 40
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 257, (B, T), generator=g) for _ in range(2))
    ids = split_documents(B, T) if documents else None
    act = 2 if precision == "bf16" else 4
    got = saved_bytes_by_layer(model, x, y, precision == "bf16", ids)
    ratios = formula_ratios(c, got, B, T, mode, act, ContextSlice(size, rank), documents)
    assert ratios == pytest.approx([1.0] * c.n_layers, abs=0.01)
    assert root_activations(c, B * T, act) == pytest.approx(got["root"], rel=0.01)


def test_checkpointing_keeps_less_and_the_formula_scales_with_tokens() -> None:
    c = spec_of(*TINY).model
    one, two = (layer_activations(c, 1, n, 64, "none", F32, "cpu", 8) for n in (64, 128))
    assert two.saved == 2 * one.saved
    kept = {m: layer_activations(c, 1, 64, 64, m, F32, "cpu", 8).saved for m in ("none", "selective", "block")}
    assert kept["none"] > kept["selective"] > kept["block"] == 64 * (c.d_model * F32 + c.experts_per_token * I64)


# ---- stored bytes -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", ["muon_adamw", "adamw"])
def test_parameter_gradient_and_optimizer_bytes_equal_the_real_model_after_one_step(optim: str) -> None:
    """k3_tiny built for real and stepped once with the configured optimizer: its parameters, gradients and state
    tensors (Muon's momentum, AdamW's moments; each parameter's scalar step counter left out) are the plan's."""
    overrides = [*TINY, f"optim={optim}", "train.seq_len=32", "train.batch_size=2"]
    cfg = composed(*overrides)
    torch.manual_seed(0)
    model = instantiate(cfg.model).train()
    optimizer = instantiate(cfg.optim)(model)
    x = torch.randint(0, 257, (2, 32))
    _, loss = model(x, targets=x)
    loss.backward()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    optimizer.step()
    params = sum(p.nbytes for p in model.parameters())
    state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim)
    memory = plan_memory(build_spec(cfg, "cpu"), Mesh(), "cpu")
    assert (memory.params, memory.grads, sum(memory.optimizer.values())) == (params, grads, state)
    assert set(memory.optimizer) == ({"Muon momentum", "AdamW moments"} if optim == "muon_adamw" else {"AdamW moments"})


def test_sharding_divides_what_each_rank_stores() -> None:
    spec = spec_of(*TINY)
    whole = plan_memory(spec, Mesh(), "cpu")
    fsdp = plan_memory(spec, Mesh(1, 4, 1), "cpu")
    assert whole.params / 4 <= fsdp.params < whole.params / 4 * 1.01  # a few short tensors padded to a row each
    assert fsdp.ddp_buckets == 0 and plan_memory(spec, Mesh(4, 1, 1), "cpu").ddp_buckets == whole.grads
    ep = plan_memory(spec, Mesh(4, 1, 2), "cpu")  # DDP with ep 2: each rank keeps half the routed experts
    routed = sum(p.numel * F32 for p in spec.params if p.routed)
    assert ep.params == pytest.approx(whole.params - routed / 2)
    assert ep.ddp_buckets == pytest.approx(whole.grads - routed)  # DDP leaves the expert shards out


# ---- communication --------------------------------------------------------------------------------------------------
def test_expert_parallel_all_to_all_bytes_by_hand() -> None:
    """tokens x top-k x routed width x bytes: dispatch and combine, forward and backward, per MoE layer and
    micro-batch, beside the gate weights (fp32) and the per-expert counts (int64); again in a recompute."""
    for mode, accumulation, exchanges in (("none", 1, 1), ("block", 2, 2)):
        spec = spec_of(
            *TINY, "precision=bf16", "train.batch_size=2", "train.seq_len=64",
            f"train.activation_checkpointing={mode}", f"train.gradient_accumulation_steps={accumulation}",
        )  # fmt: skip
        c = spec.model
        slots, moe_layers = 2 * 64 * c.experts_per_token, c.n_layers - c.first_k_dense
        per_layer = (2 * exchanges + 2) * slots * c.expert_latent_dim * 2 + (exchanges + 1) * slots * 4
        per_layer += exchanges * c.n_routed_experts * 8
        (a2a,) = [x for x in plan_comm(spec, Mesh(4, 1, 2)) if x.kind == "EP all-to-all"]
        assert a2a.payload == accumulation * moe_layers * per_layer
        assert a2a.wire == a2a.payload / 2  # half of each rank's slots leave it, on average


def test_muon_shares_by_hand() -> None:
    """How Muon's Newton-Schulz is shared out (k3train/plan/muon.py), on SMALL's 9 expert stacks [8, 32, 64] and
    [8, 64, 32] (fp32 Newton-Schulz): sliced experts go to owners over the ranks holding them, whole ones stay put,
    DDP gathers, and the busiest rank's bytes are its shards plus what it owns."""
    spec = spec_of(*SMALL)
    stack = 4 * 32 * 64 * F32  # an ep rank's 4 experts of one weight, whole
    cost = newton_schulz_cost((4, 32, 64))
    # ep 2 on 32 ranks: 4 experts an ep rank over 16 ranks, sliced on dim 1 (32 or 64 rows: 2 or 4 each)
    [sliced] = muon_shares(spec, Mesh(1, 32, 2), "muon_experts")
    assert (sliced.how, sliced.ranks, sliced.routed, sliced.calls) == ("owners", 16, True, 2)  # 9 stacks, 1 round
    assert sorted(map(sliced.sent_by, range(16))) == [9 * stack / 16] * 7 + [9 * stack / 16 + stack] * 9
    assert sliced.payload == 9 * stack / 16 + stack and sliced.flops_per_rank == 5 * cost
    assert sliced.transient == 2 * stack + 2 * 9 * stack / 16
    # ep 2 on 4 ranks: 4 experts an ep rank over 2 ranks, 2 each, whole: orthogonalised where they are
    [whole] = muon_shares(spec, Mesh(1, 4, 2), "muon_experts")
    assert (whole.how, whole.payload, whole.calls) == ("own", 0.0, 0)
    assert whole.flops_per_rank == 9 * 5 * newton_schulz_cost((2, 32, 64))
    # no ep, FSDP2 on 2 ranks: whole stacks to owners on dim 0; DDP: one all-gather of the largest share
    [dense] = muon_shares(spec, Mesh(1, 2, 1), "muon_experts")
    assert (dense.how, dense.ranks, dense.routed, dense.calls) == ("owners", 2, False, 2 * 5)  # 9 stacks: 5 rounds
    assert sorted(map(dense.sent_by, range(2))) == [9 * stack + 4 * 2 * stack, 9 * stack + 5 * 2 * stack]
    [ddp] = muon_shares(spec, Mesh(2, 1, 1), "muon_experts")
    assert (ddp.how, ddp.ranks, ddp.payload) == ("all-gather", 2, 2 * 5 * 2 * stack)


def test_fsdp_and_ddp_payloads_by_hand() -> None:
    spec = spec_of(*TINY, "train.gradient_accumulation_steps=3")
    params = sum(p.numel for p in spec.params) * F32
    trainable = sum(p.numel for p in spec.params if p.kind != "frozen") * F32
    ddp = {x.kind: x for x in plan_comm(spec, Mesh(4, 1, 1))}
    assert ddp["DDP all-reduce"].payload == trainable and ddp["DDP all-reduce"].wire == 2 * trainable * 3 / 4
    fsdp = planned(spec, Mesh(1, 4, 1))
    # forward and backward, 3 micro-batches; padding makes it a little more than the parameters
    assert 6 * params <= fsdp["FSDP all-gather"] < 6 * params * 1.01
    assert trainable <= fsdp["FSDP reduce-scatter"] < trainable * 1.01


def count_collectives(monkeypatch_targets: dict) -> tuple[dict, dict]:
    """Wrap the collectives k3train's parts call, adding each call's bytes (as the plan defines them) to `counts`
    under the current phase's key."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from k3train.models.k3.moe import balancing as moe
    from k3train.optim import muon_distributed

    counts: dict[str, float] = collections.defaultdict(float)
    state = {"phase": "step"}
    all_gather = _fsdp_collectives.DefaultAllGather.__call__
    reduce_scatter = _fsdp_collectives.DefaultReduceScatter.__call__
    moe_gather, ns_gather, funcol_gather = moe._all_gather_single, muon_distributed._all_gather_single, None
    funcol_gather = funcol.all_gather_single

    def fsdp_all_gather(self, output_tensor, input_tensor, group, async_op=False):
        counts["FSDP all-gather"] += output_tensor.nbytes
        return all_gather(self, output_tensor, input_tensor, group, async_op)

    def fsdp_reduce_scatter(self, output_tensor, input_tensor, group, op, async_op=False):
        counts["FSDP reduce-scatter"] += input_tensor.nbytes
        return reduce_scatter(self, output_tensor, input_tensor, group, op, async_op)

    def balancing_gather(output, input, group=None, **kw):
        counts["balancing"] += output.nbytes
        return moe_gather(output, input, group=group, **kw)

    balancing_a2a = moe._all_to_all_single

    def balancing_all_to_all(output, input, output_split_sizes, input_split_sizes, group=None):
        counts["balancing all-to-all"] += input.nbytes
        return balancing_a2a(output, input, output_split_sizes, input_split_sizes, group=group)

    def newton_schulz_gather(output, input, group=None, **kw):
        counts["Newton-Schulz update"] += output.nbytes
        return ns_gather(output, input, group=group, **kw)

    ns_all_to_all = muon_distributed._all_to_all_single

    def newton_schulz_all_to_all(output, input, output_split_sizes, input_split_sizes, group=None):
        counts["Newton-Schulz all-to-all"] += input.nbytes
        return ns_all_to_all(output, input, output_split_sizes, input_split_sizes, group=group)

    class CountingAllReduce:  # FSDP2's module-level `dist`, its all_reduce (HSDP's, across replicas) counted
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def all_reduce(tensor, group=None, op=dist.ReduceOp.SUM, async_op=False):
            counts["HSDP all-reduce"] += tensor.nbytes
            return dist.all_reduce(tensor, group=group, op=op, async_op=async_op)

    def dtensor_gather(tensor, gather_dim=0, group=None, **kw):  # DTensor.full_tensor: none may come from Muon
        mesh, dim = group
        counts["Newton-Schulz momentum"] += tensor.nbytes * mesh.size(dim)
        return funcol_gather(tensor, gather_dim=gather_dim, group=group, **kw)

    monkeypatch_targets.update(
        {
            (_fsdp_collectives.DefaultAllGather, "__call__"): fsdp_all_gather,
            (_fsdp_collectives.DefaultReduceScatter, "__call__"): fsdp_reduce_scatter,
            (_fsdp_collectives, "dist"): CountingAllReduce(),
            (moe, "_all_gather_single"): balancing_gather,
            (moe, "_all_to_all_single"): balancing_all_to_all,
            (muon_distributed, "_all_gather_single"): newton_schulz_gather,
            (muon_distributed, "_all_to_all_single"): newton_schulz_all_to_all,
            (funcol, "all_gather_single"): dtensor_gather,
        }
    )
    return counts, state


def _train_step(
    overrides: list[str],
    mode: str,
    accumulation: int,
    rank: int,
    strategy: str,
    world: int = 2,
    replicas: int = 1,
    precision: str = "fp32",
) -> dict:
    """One optimizer step of the SMALL model on this rank under k3train's FSDP (HSDP: `replicas` > 1) or DDP, in
    `precision` (autocast, and FSDP2's MixedPrecisionPolicy under bf16); the bytes per kind."""
    from k3train.runtime.parallel_dims import ParallelDims
    from k3train.train.parallel import DDP, FSDP

    targets: dict = {}
    counts, _ = count_collectives(targets)
    originals = {key: getattr(*key) for key in targets}
    for (owner, name), wrapper in targets.items():
        setattr(owner, name, wrapper)
    try:
        cfg = composed(*overrides, f"train.activation_checkpointing={mode}", f"precision={precision}")
        torch.manual_seed(0)
        model = instantiate(cfg.model).train()
        model.set_activation_checkpointing(mode)
        dims = ParallelDims.for_strategy(strategy, world, rank, "cpu", dp_replicate=replicas)
        parallel = FSDP(dp_replicate=replicas, mixed_precision=precision) if strategy == "fsdp" else DDP()
        model = parallel.shard(model, torch.device("cpu"), dims)
        optimizer = instantiate(cfg.optim)(model, process_group=dims.dp_group)
        wrapped = parallel.wrap(model, torch.device("cpu"), dims)
        if strategy == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):
                counts["DDP all-reduce"] += bucket.buffer().nbytes
                return allreduce_hook(state, bucket)

            wrapped.register_comm_hook(None, counting_hook)
        g = torch.Generator().manual_seed(rank)
        for i in range(accumulation):
            x = torch.randint(0, 257, (1, 32), generator=g)
            with parallel.no_sync(wrapped) if i < accumulation - 1 else nullcontext():
                with instantiate(cfg.precision).autocast(torch.device("cpu")):
                    _, loss = wrapped(x, targets=x)
                (loss / accumulation).backward()
        optimizer.step()
        return dict(counts)
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


def _collectives_rank_main(rank: int, world_size: int) -> dict:
    out = {
        name: _train_step(SMALL, mode, acc, rank, "fsdp", precision=dtype)
        for name, (mode, acc, dtype) in FSDP_CASES.items()
    }
    out["ddp"] = _train_step(SMALL, "none", 1, rank, "ddp")
    return out


@pytest.fixture(scope="module")
def two_rank_counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ranks(_collectives_rank_main, tmp_path_factory.mktemp("plan-2-ranks"))


def planned(spec, mesh: Mesh, comm: list | None = None) -> dict[str, float]:
    """The plan's payload per kind (of plan_comm(spec, mesh), or `comm`), the routed experts' with the rest's,
    Newton-Schulz's per-group gathers summed, the loads and candidates together."""
    out: dict[str, float] = collections.defaultdict(float)
    for x in plan_comm(spec, mesh) if comm is None else comm:
        kind = x.kind.removesuffix(" (routed experts)")
        if kind.startswith("Newton-Schulz update"):
            kind = "Newton-Schulz update"
        elif kind.startswith("Newton-Schulz all-to-all"):
            kind = "Newton-Schulz all-to-all"
        elif kind.endswith("all-gather") and ("Balancing" in kind or "load" in kind):
            kind = "balancing"
        elif kind == "Quantile Balancing all-to-all":
            kind = "balancing all-to-all"
        out[kind] += x.payload
    return dict(out)


def _hsdp_rank_main(rank: int, world_size: int) -> dict:
    return _train_step(SMALL, "block", 2, rank, "fsdp", world=4, replicas=2)


@pytest.mark.slow
def test_hsdp_collective_bytes_equal_a_four_rank_gloo_run(tmp_path: Path) -> None:
    """HSDP 2 x 2: FSDP2's all-gathers and reduce-scatters within each replica group, its all-reduce of every
    unit's shard across the groups, Muon's owners within a group, Quantile Balancing over all four: byte for byte."""
    spec = spec_of(*SMALL, "train.activation_checkpointing=block", "train.gradient_accumulation_steps=2")
    mesh = Mesh(2, 2, 1)
    want = planned(spec, mesh)
    assert want["HSDP all-reduce"] > 0 and "DDP all-reduce" not in want
    shares = [s for group in muon_groups(spec) for s in muon_shares(spec, mesh, group) if s.how == "owners"]
    assert want.pop("Newton-Schulz all-to-all") == sum(s.payload for s in shares)
    for rank, counts in enumerate(spawn_ranks(_hsdp_rank_main, tmp_path, nprocs=4)):
        got = dict(counts)
        assert got.pop("Newton-Schulz all-to-all") == sum(s.sent_by(rank % 2) for s in shares), f"rank {rank}"
        assert got == pytest.approx(want, rel=1e-9), f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("case", [*FSDP_CASES, "ddp"])
def test_collective_bytes_equal_a_two_rank_gloo_run(two_rank_counts: list[dict], case: str) -> None:
    """Every kind the plan lists is what both ranks passed to torch.distributed, byte for byte: FSDP2's padded
    all-gathers (forward and backward, every micro-batch) and reduce-scatter (once), DDP's buckets, Muon's gathers
    of the orthogonalised updates (DDP) and its owners' all-to-alls (FSDP2: the busiest rank's), Quantile
    Balancing's gathers."""
    mode, accumulation, precision = FSDP_CASES.get(case, ("none", 1, "fp32"))
    spec = spec_of(
        *SMALL,
        f"train.activation_checkpointing={mode}",
        f"train.gradient_accumulation_steps={accumulation}",
        f"precision={precision}",
    )
    mesh = Mesh(1, 2, 1) if case in FSDP_CASES else Mesh(2, 1, 1)
    want = planned(spec, mesh)
    if precision == "bf16":  # half the fp32 gathers' bytes, the same fp32 reduce-scatter
        fp32 = planned(spec_of(*SMALL, f"train.activation_checkpointing={mode}",
                               f"train.gradient_accumulation_steps={accumulation}"), mesh)  # fmt: skip
        assert want["FSDP all-gather"] == fp32["FSDP all-gather"] / 2
        assert want["FSDP reduce-scatter"] == fp32["FSDP reduce-scatter"]
    # Muon's owners send different bytes (each its own matrices' updates): the plan's payload is the busiest rank's
    # per group, and its shares say what each rank sends
    shares = [s for group in muon_groups(spec) for s in muon_shares(spec, mesh, group) if s.how == "owners"]
    assert want.pop("Newton-Schulz all-to-all", 0.0) == sum(s.payload for s in shares)
    assert (case == "ddp") != bool(shares)
    for rank, counts in enumerate(two_rank_counts):
        got = dict(counts[case])
        assert got.pop("Newton-Schulz all-to-all", 0.0) == sum(s.sent_by(rank) for s in shares), f"rank {rank}"
        assert got == pytest.approx(want, rel=1e-9), f"rank {rank}"


def _expert_parallel_rank_main(rank: int, world_size: int) -> dict:
    from k3train.models.k3.moe import MoE, shard_experts

    from helpers.all_to_all_bytes import AllToAllBytes

    cfg = composed(*SMALL, "precision=bf16")
    torch.manual_seed(0)
    model = instantiate(cfg.model).train()
    for module in model.modules():
        if isinstance(module, MoE):
            module.process_group = dist.group.WORLD
            shard_experts(module, dist.group.WORLD)
    x = torch.randint(0, 257, (1, 32), generator=torch.Generator().manual_seed(rank))
    counter = AllToAllBytes()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, targets=x)
        loss.backward()
    return {"all_to_all": counter.bytes}


@pytest.mark.slow
def test_expert_parallel_all_to_all_bytes_equal_a_real_run(tmp_path: Path) -> None:
    """Both ranks of an ep = 2 exchange (k3train/models/k3/moe/dispatch.py) together send what the plan says two
    ranks send: each rank sends all its slots out and its experts' results back, forward and backward (and, beside
    them, Quantile Balancing's candidates to the rank taking their experts' block)."""
    counts = spawn_ranks(_expert_parallel_rank_main, tmp_path)
    spec = spec_of(*SMALL, "precision=bf16")
    (a2a,) = [x for x in plan_comm(spec, Mesh(2, 1, 2)) if x.kind == "EP all-to-all"]
    (balancing,) = [x for x in plan_comm(spec, Mesh(2, 1, 2)) if x.kind == "Quantile Balancing all-to-all"]
    assert sum(c["all_to_all"] for c in counts) == 2 * (a2a.payload + balancing.payload)


# The cp = 2 split's cases: precision, checkpointing, document masking, micro-batches; 2 rows of 40 positions (20 a
# rank: KDA's last chunk of 16 padded).
CP_CASES = {
    "fp32": ("fp32", "none", False, 1),
    "bf16, documents": ("bf16", "none", True, 1),
    "fp32, selective, documents": ("fp32", "selective", True, 1),
    "bf16, block, 2 micro-batches": ("bf16", "block", False, 2),
}
CP_SMALL = [*SMALL, "train.seq_len=40", "train.batch_size=2"]


def _cp_kind(t: torch.Tensor, n: int) -> str:
    """Which cp exchange a collective's tensor belongs to, from its shape: the document ids [B, T] (int64, once a
    forward), KDA's summaries [B, H, K, K + V], the conv tails [B, n, 3W], MLA's latent [B, T, r + dr]."""
    if t.dtype == torch.long:
        return "CP document ids"
    if t.ndim == 4:
        return "CP KDA state"
    return "CP conv tails" if t.shape[1] == n else "CP MLA latent"


def _context_parallel_rank_main(rank: int, world_size: int) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from k3train.models.k3.moe import balancing as moe

    class CollectiveBytes(TorchDispatchMode):
        """The functional collectives' payloads (an all-gather's output, a reduce-scatter's input), by cp kind."""

        def __init__(self, n: int):
            super().__init__()
            self.n, self.bytes = n, collections.defaultdict(float)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if name == "_c10d_functional::all_gather_into_tensor":
                self.bytes[f"{_cp_kind(args[0], self.n)} all-gather"] += args[0].nbytes * args[1]
            elif name == "_c10d_functional::reduce_scatter_tensor":
                t = args[0]
                self.bytes[f"{_cp_kind(t[: t.shape[0] // args[2]], self.n)} reduce-scatter"] += t.nbytes
            return func(*args, **(kwargs or {}))

    gather, all_to_all = moe._all_gather_single, moe._all_to_all_single
    out: dict = {}
    for case, (precision, mode, documents, accumulation) in CP_CASES.items():
        cfg = composed(*CP_SMALL, f"precision={precision}")
        torch.manual_seed(0)
        model = instantiate(cfg.model).train()
        model.set_activation_checkpointing(mode)
        set_context_parallel(model, ContextParallel(dist.group.WORLD))
        for module in model.modules():  # Quantile Balancing over both ranks, as hand_data_parallel_group does
            if hasattr(module, "process_group"):
                module.process_group = dist.group.WORLD
        counter = CollectiveBytes(model.config.kda_conv_size - 1)

        def balancing(output, input, group=None, counter=counter, **kw):
            counter.bytes["balancing"] += output.nbytes
            return gather(output, input, group=group, **kw)

        def balancing_all_to_all(output, input, out_splits, in_splits, group=None, counter=counter):
            counter.bytes["balancing all-to-all"] += input.nbytes
            return all_to_all(output, input, out_splits, in_splits, group=group)

        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
        g = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(accumulation):
            x = torch.randint(0, 257, (2, 40), generator=g)  # the same rows on both ranks: a cp group's
            ids = split_documents(2, 40) if documents else None
            mine = slice(20 * rank, 20 * (rank + 1))  # copies: a view would keep (and count) the whole row's ids
            batches.append((x[:, mine].clone(), None if ids is None else ids[:, mine].clone()))
        # what the first micro-batch saves, by layer (a forward of its own, before the counting)
        saved = saved_bytes_by_layer(model, batches[0][0], batches[0][0], precision == "bf16", batches[0][1])
        moe._all_gather_single, moe._all_to_all_single = balancing, balancing_all_to_all
        try:
            for x, ids in batches:
                with counter:
                    with autocast:
                        _, loss = model(x, targets=x, document_ids=ids)
                    loss.backward()
        finally:
            moe._all_gather_single, moe._all_to_all_single = gather, all_to_all
        out[case] = {"saved": dict(saved), "comm": dict(counter.bytes)}
    return out


@pytest.fixture(scope="module")
def context_parallel_counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ranks(_context_parallel_rank_main, tmp_path_factory.mktemp("plan-cp-2-ranks"))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CP_CASES))
def test_context_parallel_bytes_equal_a_two_rank_split(context_parallel_counts: list[dict], case: str) -> None:
    """Rows split over 2 gloo ranks (model.context_parallel, as parallel.cp=2 sets it): every cp all-gather and its
    backward's reduce-scatter, by kind, and Quantile Balancing's gathers of the rank's 2 x 20 tokens are the plan's
    to the byte on both ranks (the recompute's gathers, 2 micro-batches and the document ids included); each rank's
    saved tensors are the formula's for its slice within 1%, the last rank's keys the whole row."""
    precision, mode, documents, accumulation = CP_CASES[case]
    spec = spec_of(
        *CP_SMALL, f"precision={precision}", f"train.activation_checkpointing={mode}",
        f"train.gradient_accumulation_steps={accumulation}", f"data.document_masking={documents}",
    )  # fmt: skip
    want = {k: v for k, v in planned(spec, Mesh(2, 1, 1, 2)).items() if k.startswith(("CP", "balancing"))}
    kinds = ("KDA state", "conv tails", "MLA latent")
    cp = {f"CP {k} {op}" for k in kinds for op in ("all-gather", "reduce-scatter")}
    ids = {"CP document ids all-gather"} if documents else set()
    assert set(want) == cp | ids | {"balancing", "balancing all-to-all"}
    c, act = spec.model, spec.act_bytes
    for rank, counts in enumerate(context_parallel_counts):
        assert counts[case]["comm"] == pytest.approx(want, rel=1e-12), f"rank {rank}"
        ratios = formula_ratios(c, counts[case]["saved"], 2, 20, mode, act, ContextSlice(2, rank), documents)
        assert ratios == pytest.approx([1.0] * c.n_layers, abs=0.01), f"rank {rank}"


def test_context_parallel_comm_by_hand() -> None:
    """k3_tiny at seq 4096 over cp 4, bf16, document masking: each kind's all-gather moves the whole row's share of
    every rank, its reduce-scatter the same; a recompute gathers again; the document ids go once a forward, for
    every layer, and not again in a recompute."""
    for mode, forwards in (("none", 1), ("block", 2)):
        spec = spec_of(
            *TINY, "precision=bf16", "train.batch_size=2", "train.seq_len=4096", "data.document_masking=true",
            f"train.activation_checkpointing={mode}",
        )  # fmt: skip
        c = spec.model
        kda, mla = c.layer_pattern.count("kda"), c.layer_pattern.count("mla")
        W, K, n, T = c.kda_n_heads * c.kda_head_dim, c.kda_head_dim, c.kda_conv_size - 1, 1024
        got = {x.kind: x for x in plan_comm(spec, Mesh(1, 8, 1, 4))}
        want = {
            "CP KDA state": (kda, 4 * 2 * W * 2 * K * 4),
            "CP conv tails": (kda, 4 * 2 * n * 3 * W * 2),
            "CP MLA latent": (mla, 4 * 2 * T * (c.kv_lora_rank + c.qk_rope_head_dim) * 2),
        }
        ids = got["CP document ids all-gather"]
        assert (ids.payload, ids.calls, ids.wire) == (4 * 2 * T * 8, 1, 4 * 2 * T * 8 * 3 / 4)
        for kind, (layers, values) in want.items():
            assert got[f"{kind} all-gather"].payload == layers * forwards * values
            assert got[f"{kind} reduce-scatter"].payload == layers * values
            assert got[f"{kind} all-gather"].wire == got[f"{kind} all-gather"].payload * 3 / 4
            assert got[f"{kind} all-gather"].ranks == 4 and not got[f"{kind} all-gather"].overlapped


def test_context_parallel_divides_the_tokens_and_adds_what_the_split_costs() -> None:
    """cp 4 on 8 ranks: a quarter of the tokens per rank, half the global batch of cp 1 on 8 ranks, the same
    parameter bytes; the step's FLOPs add KDA's identity pass (the main pass's chunked work at value width K) and
    MLA's keys before the slice; the last rank keeps MLA's keys and values for the whole row."""
    spec = spec_of(*TINY, "precision=bf16", "train.seq_len=4096", "train.batch_size=1")
    hw = lookup("h200")
    one, split = (estimate(spec, Mesh(1, 8, 1, cp), hw) for cp in (1, 4))
    assert split.tokens_per_step * 4 == one.tokens_per_step == 8 * 4096
    assert split.memory.params == one.memory.params and split.memory.activations < one.memory.activations
    c = spec.model
    H, K, C = c.kda_n_heads, c.kda_head_dim, c.kda_chunk_size
    kda = H * chunk_state_macs(K, K, C, 1024) / 1024 + H * K * K + 3 * H * K**3 / 1024
    mla = 3 * c.kv_lora_rank * c.mla_n_heads * (c.qk_nope_head_dim + c.v_head_dim)
    want = 2 * (c.layer_pattern.count("kda") * kda + c.layer_pattern.count("mla") * mla)
    assert context_flops_per_token(spec, 4) == pytest.approx(want)
    assert split.compute_s == pytest.approx(one.compute_s / 4 * (1 + 3 * want / spec.flops_per_token["training"]))
    # the last rank's MLA layer: whole-row keys, its quarter of the queries
    mla_layer = c.layer_pattern.index("mla")
    last, first = (
        layer_activations(c, mla_layer, 1024, 1024, "none", 2, "cuda", 8, ContextSlice(4, r)) for r in (3, 0)
    )
    whole = layer_activations(c, mla_layer, 4096, 4096, "none", 2, "cuda", 8)
    assert first.saved < last.saved and last.saved > whole.saved / 4


# ---- QK-Clip ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpointing", ["none", "block", "selective"])
def test_qk_clip_flops_are_what_its_matmuls_do(monkeypatch: pytest.MonkeyPatch, checkpointing: str) -> None:
    """k3_tiny run forward and backward with the max logit measured and not: the FLOPs the measurement adds
    (torch's FLOP counter) are the plan's, at a block small enough for 4 tiles a row (the causal pairs and the
    diagonal tiles, not the square), once under checkpointing too: the recompute leaves the measurement out."""
    monkeypatch.setattr(mla, "MAX_LOGIT_BLOCK_VALUES", 4 * 16 * 16)  # k3_tiny's 4 heads: tiles of 16 x 16
    cfg = composed(*TINY, "train.seq_len=64", "train.batch_size=2", f"train.activation_checkpointing={checkpointing}")
    spec = build_spec(cfg, "cpu")
    x = torch.randint(0, 257, (2, 64))
    added = {}
    for tracked in (False, True):
        torch.manual_seed(0)
        model = instantiate(cfg.model).train()
        model.set_activation_checkpointing(checkpointing)
        set_max_logit_tracking(model, tracked)
        with FlopCounterMode(display=False) as counter:
            _, loss = model(x, targets=x)
            loss.backward()
        added[tracked] = counter.get_total_flops()
    assert spec.qk_clip and mla.max_logit_tile(spec.model.mla_n_heads, "cpu") == 16
    assert added[True] - added[False] == qk_clip_flops(spec, 1, "cpu") > 0


def test_k3_at_131072_positions_fits_with_qk_clip_on() -> None:
    """docs/plan.md's long-context recipe with QK-Clip on (the default callbacks): at cp 32 its transient is one tile
    (836 x 836 at 96 heads on a GPU) instead of the dense [96, 4,096, 131,072] fp32 logits (206 GB, and as much
    again masked), so the plan fits on 1,024 H200s, its fp32 matmuls in the step time."""
    recipe = ["precision=bf16", "train.batch_size=1", "train.seq_len=131072", "train.activation_checkpointing=block"]
    spec = spec_of("model=k3", *recipe, "optim=adamw", "model.router=aux_free_bias", device="cuda")
    plan = estimate(spec, Mesh(1, 1024, 32, 32), lookup("h200"))
    assert spec.qk_clip and mla.max_logit_tile(96, "cuda") == 836
    assert 96 * 836 * 836 * F32 < plan.memory.transients["QK-Clip max-logit tile [heads, tile, tile]"] < 0.4e9
    assert plan.fits and plan.qk_clip_s > 0 and plan.step_s >= plan.compute_s + plan.recompute_s + plan.qk_clip_s


# ---- the CLI ------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # seconds: a subprocess, transformers' import or a whole run built
def test_the_cli_plans_k3_on_1024_h200s_in_seconds(capsys: pytest.CaptureFixture) -> None:
    t0 = time.perf_counter()
    status = main(["model=k3", "--gpus", "1024", "--gpu", "h200"])
    seconds = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert status in (0, 2) and seconds < 60
    for section in ("memory per device (GB)", "communication per step per device", "step time", "tokens/day"):
        assert section in out
    assert "FSDP all-gather" in out and "meshes tried" in out
    assert ("fits" if status == 0 else "DOES NOT FIT") in out


def test_a_k3_recipe_that_fits_is_proposed_with_its_mesh(capsys: pytest.CaptureFixture) -> None:
    recipe = ["model=k3", "precision=bf16", "train.batch_size=1", "train.seq_len=4096", "optim=adamw"]
    status = main([*recipe, "train.activation_checkpointing=block", "--gpus", "4096", "--gpu", "b200"])
    out = capsys.readouterr().out
    assert status == 0 and "proposed mesh" in out and "dp_shard 4096" in out


def test_the_proposal_is_the_fastest_mesh_that_fits_or_with_prefer_memory_the_smallest_peak(
    capsys: pytest.CaptureFixture,
) -> None:
    """k3_tiny on 4 H100s: every candidate fits; the first tried (DDP, ep 1), the fastest (FSDP, ep 1) and the
    smallest peak (FSDP, ep 4) are three meshes, so each choice is told apart from the others."""
    spec = spec_of(*TINY, "train.seq_len=64", device="cuda")
    chosen, tried = propose(spec, 4, lookup("h100"))
    fits = [e for e in tried if e.fits]
    assert len(fits) == len(tried) == 6 and chosen is not tried[0]
    assert chosen.mesh == min(fits, key=lambda e: e.step_s).mesh == Mesh(1, 4, 1)
    small, _ = propose(spec, 4, lookup("h100"), prefer="memory")
    assert small.mesh == min(fits, key=lambda e: (e.memory.peak, e.step_s)).mesh != chosen.mesh
    argv = [*TINY, "train.seq_len=64", "--gpus", "4", "--gpu", "h100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh 1x4x1 = " in out and f"--prefer memory proposes it; --mesh {small.mesh} plans it" in out
    assert main([*argv, "--prefer", "memory"]) == 0
    out = capsys.readouterr().out
    assert f"mesh {small.mesh} = " in out and "fastest: dp_replicate 1 x dp_shard 4 (ep 1)" in out


def test_a_quickstart_row_is_named_near_the_top_with_the_override_to_plan_a_real_one(
    capsys: pytest.CaptureFixture,
) -> None:
    """Rows under min(4,096, max_seq_len / 8) are a quickstart's: said under the header, with train.seq_len=4096."""
    spec = spec_of(*TINY)  # 256 of max_seq_len 512: a tiny model's own length
    assert short_rows(spec) is None
    k3_like = dataclasses.replace(spec, model=dataclasses.replace(spec.model, max_seq_len=1048576))
    assert "train.seq_len=4096" in short_rows(k3_like) and "max_seq_len 1,048,576" in short_rows(k3_like)
    assert short_rows(dataclasses.replace(k3_like, seq_len=4096)) is None
    assert short_rows(dataclasses.replace(k3_like, seq_len=2048)) is not None
    argv = ["model=k3_small", "model.vocab_size=32768", "--gpus", "1", "--gpu", "h100"]  # 256 of 4,096
    assert main(argv) == 0
    head = capsys.readouterr().out.splitlines()[:6]
    assert any(line.startswith("  note: train.seq_len 256 is a quickstart row") for line in head), head
    assert main([*argv, "--json"]) == 0
    assert "train.seq_len=4096" in json.loads(capsys.readouterr().out)["notes"][0]
    assert main([*argv, "train.seq_len=1024"]) in (0, 2)  # 8 rows of 1,024 may not fit: the note is the same
    assert "quickstart" not in capsys.readouterr().out


def test_the_plan_leads_with_the_command_that_trains_it_and_gives_days_per_1e12_tokens(
    capsys: pytest.CaptureFixture,
) -> None:
    argv = [*TINY, "train.seq_len=64", "parallel.bucket_cap_mb=50", "--gpus", "4", "--gpu", "h100"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[4] == "" and lines[5].startswith("train it (the plan below, 1x4x1: ")
    assert lines[6] == (
        "  torchrun --standalone --nproc_per_node=4 -m k3train model=k3_tiny model.vocab_size=257 train.seq_len=64 "
        "precision=fp32 train.activation_checkpointing=none train.batch_size=8 train.gradient_accumulation_steps=1 "
        "parallel=fsdp parallel.ep=1 parallel.cp=1"
    )  # DDP's bucket_cap_mb dropped: the mesh is FSDP's
    throughput = next(line for line in lines if line.startswith("throughput: "))
    per_day = float(re.search(r"([0-9.e+]+) tokens/day", throughput).group(1))
    days = float(re.search(r"\(([0-9.,]+) days per 1e12 tokens\)", throughput).group(1))
    assert days == pytest.approx(1e12 / per_day, abs=0.05)  # printed to 0.1 day
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["run"]["launch"] == [lines[6].strip()] and "parallel=fsdp" in plan["run"]["overrides"]
    assert plan["chosen"]["days_per_1e12_tokens"] == pytest.approx(1e12 / plan["chosen"]["tokens_per_day"])


def test_launch_forms_and_the_overrides_that_realise_a_mesh() -> None:
    """docs/distributed.md's forms: one process, torchrun on a node, torchrun or srun over nodes of 8."""
    h200, cpu = lookup("h200"), lookup("cpu")
    assert launch(1, h200, ["model=k3"]) == ["python -m k3train model=k3"]
    assert launch(8, h200, ["a=1"]) == ["torchrun --standalone --nproc_per_node=8 -m k3train a=1"]
    assert launch(2, cpu, ["a=1"]) == ["torchrun --standalone --nproc_per_node=2 -m k3train a=1"]
    many = launch(1024, h200, ["a=1", "b=[1,2]"])
    assert many[0].startswith("torchrun --nnodes=128 --nproc_per_node=8 ") and many[0].endswith(
        " -m k3train a=1 'b=[1,2]'"
    )
    assert (
        many[1]
        == "srun --nodes=128 --ntasks-per-node=8 --gpus-per-node=8 --kill-on-bad-exit=1 python -m k3train a=1 'b=[1,2]'"
    )
    assert launch(12, h200, [])[0].startswith("torchrun --nnodes=3 --nproc_per_node=4 ")  # nodes of 4, not 8 + 4
    spec = spec_of(*TINY)
    given = ["model=k3_tiny", "precision=bf16", "parallel.bucket_cap_mb=50"]
    hsdp = run_overrides(spec, Mesh(2, 2, 2), given)
    assert hsdp[:2] == ["model=k3_tiny", "precision=fp32"]  # a key the plan sets keeps its place, with the plan's value
    assert hsdp[2:] == [
        "train.activation_checkpointing=none", "train.batch_size=8", "train.gradient_accumulation_steps=1",
        "parallel=hsdp", "parallel.dp_replicate=2", "parallel.ep=2", "parallel.cp=1",
    ]  # fmt: skip
    assert run_overrides(spec, Mesh(4, 1, 1), given)[-1] == "parallel.cp=1" and "parallel.bucket_cap_mb=50" in (
        run_overrides(spec, Mesh(4, 1, 1), given)
    )  # still DDP: its own keys stay
    assert "parallel" not in {o.split("=")[0] for o in run_overrides(spec, Mesh(), given)}  # one process


@pytest.mark.slow  # 10 s: K3 planned on the meta device
def test_k3_at_4096_token_rows_fits_first_on_1024_h200s_at_its_fastest_mesh(capsys: pytest.CaptureFixture) -> None:
    """The README's planner example: its first answer fits, at the fastest mesh (ep 128, 18.1 s a step with bf16
    gathers), where ep 16 steps in 40.0 s (the smallest ep that fits is 4 now: 120.0 s)."""
    recipe = ["precision=bf16", "train.seq_len=4096", "train.activation_checkpointing=block", "train.batch_size=1"]
    assert main(["model=k3", *recipe, "--gpus", "1024", "--gpu", "h200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[5].startswith("train it (the plan below, 1x1024x128: 18.1 s a step") and "quickstart" not in lines[4]
    assert lines[6].startswith("  torchrun --nnodes=128 --nproc_per_node=8 ") and lines[7].startswith("  srun ")
    assert lines[6].endswith(" parallel=fsdp parallel.ep=128 parallel.cp=1")
    tried = {line.split()[0]: float(line.split()[-4]) for line in lines if re.match(r"^  1x1024x\d+ ", line)}
    assert tried["1x1024x16"] > 2 * tried["1x1024x128"]  # what the smallest ep that fits would have proposed


def test_nothing_fits_exits_2_and_names_the_largest_items(capsys: pytest.CaptureFixture) -> None:
    assert main(["model=k3", "--gpus", "8", "--gpu", "h100"]) == 2
    captured = capsys.readouterr()
    assert "nothing fits" in captured.out and "largest items" in captured.out
    assert "nothing fits on 8 x NVIDIA H100 SXM (exit 2)" in captured.err


def test_bad_input_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main([*TINY, "--gpus", "4", "--mesh", "1x2x1"]) == 2  # 2 ranks for 4 devices
    assert main(["model=smoke_test_lm", "--vocab-size", "257"]) == 2  # not a KimiK3
    assert "KimiK3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, line",
    [
        (["parallel.pp=-2", "--gpus", "8"], "k3train plan: error: parallel.pp=-2 must be a positive integer"),
        (["parallel.ep=0", "--gpus", "8"], "k3train plan: error: parallel.ep=0 must be a positive integer"),
        (["--vocab-size", "-5"], "k3train plan: error: vocab_size=-5 must be a positive integer"),
    ],
)
def test_a_bad_count_is_refused_in_the_runs_words_in_one_line(capsys: pytest.CaptureFixture, args, line) -> None:
    """As python -m k3train refuses them: no traceback, no Hydra "Error in call to target" wrapper."""
    assert main(["model=k3_tiny", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == line and captured.out == ""


def test_a_given_mesh_is_planned_as_given(capsys: pytest.CaptureFixture) -> None:
    assert main([*TINY, "--gpus", "4", "--mesh", "1x4x2", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "mesh 1x4x2" in out and "EP all-to-all" in out and "FSDP all-gather (routed experts)" in out


def test_an_hsdp_mesh_says_how_to_run_it(capsys: pytest.CaptureFixture) -> None:
    assert main([*TINY, "--gpus", "4", "--mesh", "2x2x1", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "HSDP all-reduce" in out and "run it with parallel=fsdp parallel.dp_replicate=2 " in out
    assert main([*TINY, "parallel=hsdp", "--gpus", "4", "--mesh", "2x2x1", "--gpu", "h100"]) == 0
    assert "run it with" not in capsys.readouterr().out  # the config already says so
    assert main([*TINY, "--gpus", "4", "--mesh", "2x2x2", "--gpu", "h100"]) == 0
    assert "run it with parallel=fsdp parallel.dp_replicate=2 parallel.ep=2 " in capsys.readouterr().out


def test_context_parallel_is_planned_only_when_asked(capsys: pytest.CaptureFixture) -> None:
    """parallel.cp, --cp or a mesh's fourth field split the rows; without them no candidate does."""
    recipe = [*TINY, "train.seq_len=64", "--gpus", "4", "--gpu", "h100"]
    assert main(recipe) == 0
    out = capsys.readouterr().out
    assert "mesh 1x4x1 = dp_replicate 1 x dp_shard 4 (ep 1), 4 device(s)" in out  # the fastest that fits
    assert "context parallel" not in out and "CP " not in out
    for asked in (["parallel.cp=2"], ["--cp", "2"], ["--mesh", "4x1x1x2"], ["--mesh", "4x1x1", "parallel.cp=2"]):
        assert main([*asked, *recipe]) == 0, asked
        out = capsys.readouterr().out
        assert re.search(r"^mesh (1x4x1x2|4x1x1x2) = dp_replicate \d x dp_shard \d \(ep 1, cp 2\)", out, re.M), asked
        assert "each row's 64 positions split over 2 ranks, 32 a rank" in out and "a global batch of 16 rows" in out
        assert "CP KDA state all-gather" in out and "CP MLA latent reduce-scatter" in out
    assert main(["--cp", "2", "--json", *recipe]) == 0
    assert '"cp": 2' in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["--cp", "3", "--gpus", "4"],  # cp does not divide the devices
        ["--cp", "3", "--gpus", "3"],  # nor the sequence (64)
        ["--mesh", "1x4x1x2", "--cp", "4", "--gpus", "4"],  # two cps
        ["model.kda_implementation=recurrent", "--cp", "2", "--gpus", "2"],  # cp runs KDA's chunked kernel only
    ],
)
def test_a_split_that_cannot_run_exits_2(capsys: pytest.CaptureFixture, args: list[str]) -> None:
    assert main([*TINY, "train.seq_len=64", *args]) == 2
    assert "error" in capsys.readouterr().err


def test_the_fla_kernel_under_cp_is_refused_as_not_sized() -> None:
    """Training runs KDA's FLA kernel under cp; the plan does not model what it saves there, and says so (the CLI
    says the same where FLA is installed; without it building the model fails first, on the missing import)."""
    c = dataclasses.replace(spec_of(*TINY).model, kda_implementation="fla")
    with pytest.raises(ValueError, match="cannot size KDA under parallel.cp with model.kda_implementation=fla"):
        for layer in range(c.n_layers):
            layer_activations(c, layer, 64, 32, "none", F32, "cpu", 8, ContextSlice(2, 1))


# ---- the pieces ---------------------------------------------------------------------------------------------------
def test_the_hardware_table_is_mfu_py_s_peaks() -> None:
    for hw in GPUS.values():
        name = hw.name.removeprefix("NVIDIA ").split()[0]
        assert hw.bf16_flops == gpu_peak(name, "bf16").flops_per_s
        assert hw.fp32_flops == gpu_peak(name, "fp32").flops_per_s
    assert GPUS["h200"].memory_bytes == 141e9 and GPUS["h200"].hbm_bytes_per_s == 4.8e12
    assert GPUS["h200"].link_one_way == 450e9 and GPUS["h200"].network_one_way == 50e9


def test_meshes() -> None:
    assert Mesh.parse("1x1024x64") == Mesh(1, 1024, 64) and Mesh.parse("8x1") == Mesh(8, 1, 1)
    assert Mesh.parse("1x1024x64x8") == Mesh(1, 1024, 64, 8) == Mesh.parse("1x1024x64", cp=8)
    assert str(Mesh(1, 1024, 64, 8)) == "1x1024x64x8" and str(Mesh(1, 1024, 64)) == "1x1024x64"
    assert Mesh(1, 1024, 64, 8).dp_size == 128 and "cp 8" in Mesh(1, 1024, 64, 8).describe()
    assert Mesh(1, 1024, 64).expert_shard == 16 and Mesh(8, 1, 4).expert_replicas == 2
    for bad in ("1x1024x3", "1x6x4", "abc", "0x4x1", "1x4x1x3", "1x4x1x1x1x1", "1x4x3x1x2"):
        with pytest.raises(ValueError):
            Mesh.parse(bad)
    assert [str(m) for m in candidates(4, 8)] == ["4x1x1", "4x1x2", "4x1x4", "1x4x1", "1x4x2", "1x4x4"]
    assert [str(m) for m in candidates(4, 8, cp=2)][:2] == ["4x1x1x2", "4x1x2x2"]
