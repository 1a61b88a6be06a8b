"""`python -m k3train.plan` (k3train/plan/): its figures against what k3train really allocates and sends.

- the saved-activation formula against the tensors autograd saves, layer by layer (every checkpointing mode, fp32
  and a bf16 autocast, K3's form and Kimi Linear's);
- parameter, gradient and optimizer-state bytes against a real k3_tiny after one step (MuonAdamW and AdamW);
- FSDP's all-gathers and reduce-scatters, DDP's all-reduce, Newton-Schulz's and Quantile Balancing's gathers
  against a real 2-rank gloo run (slow: spawned ranks), and the EP all-to-all by hand and against a real exchange;
- the CLI: model=k3 on 1,024 H200s in seconds, a table; exit 2 when nothing fits; the hardware table's FLOP/s are
  k3train/observe/mfu.py's.
The measured peak memory of k3_small against the prediction is benchmarks/bench_plan.py's (seconds per step).
"""

from __future__ import annotations

import collections
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra.utils import instantiate

from k3train.observe.mfu import gpu_peak
from k3train.plan.__main__ import main
from k3train.plan.activations import F32, I64, layer_activations, root_activations
from k3train.plan.comm import plan_comm
from k3train.plan.hardware import GPUS
from k3train.plan.memory import plan_memory
from k3train.plan.mesh import Mesh, candidates
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
FSDP_CASES = {"none, 1 micro-batch": ("none", 1), "block, 2 micro-batches": ("block", 2)}


def spec_of(*overrides: str, device: str = "cpu"):
    return build_spec(composed(*overrides), device)


# ---- activations -------------------------------------------------------------------------------------------------
def saved_bytes_by_layer(model, x, y, autocast: bool) -> dict[str, int]:
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
        model(x, targets=y)
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


def _count_collectives(monkeypatch_targets: dict) -> tuple[dict, dict]:
    """Wrap the collectives k3train's parts call, adding each call's bytes (as the plan defines them) to `counts`
    under the current phase's key."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from k3train.models.k3 import moe
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

    def newton_schulz_gather(output, input, group=None, **kw):
        counts["Newton-Schulz update"] += output.nbytes
        return ns_gather(output, input, group=group, **kw)

    def dtensor_gather(tensor, gather_dim=0, group=None, **kw):  # DTensor.full_tensor: Muon's whole momentum
        mesh, dim = group
        counts["Newton-Schulz momentum"] += tensor.nbytes * mesh.size(dim)
        return funcol_gather(tensor, gather_dim=gather_dim, group=group, **kw)

    monkeypatch_targets.update(
        {
            (_fsdp_collectives.DefaultAllGather, "__call__"): fsdp_all_gather,
            (_fsdp_collectives.DefaultReduceScatter, "__call__"): fsdp_reduce_scatter,
            (moe, "_all_gather_single"): balancing_gather,
            (muon_distributed, "_all_gather_single"): newton_schulz_gather,
            (funcol, "all_gather_single"): dtensor_gather,
        }
    )
    return counts, state


def _train_step(overrides: list[str], mode: str, accumulation: int, rank: int, strategy: str) -> dict:
    """One optimizer step of the SMALL model on this rank under k3train's FSDP or DDP; the bytes per kind."""
    from k3train.runtime.parallel_dims import ParallelDims
    from k3train.train.parallel import DDP, FSDP

    targets: dict = {}
    counts, _ = _count_collectives(targets)
    originals = {key: getattr(*key) for key in targets}
    for (owner, name), wrapper in targets.items():
        setattr(owner, name, wrapper)
    try:
        cfg = composed(*overrides, f"train.activation_checkpointing={mode}")
        torch.manual_seed(0)
        model = instantiate(cfg.model).train()
        model.set_activation_checkpointing(mode)
        dims = ParallelDims.for_strategy(strategy, 2, rank, "cpu")
        parallel = FSDP() if strategy == "fsdp" else DDP()
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
                _, loss = wrapped(x, targets=x)
                (loss / accumulation).backward()
        optimizer.step()
        return dict(counts)
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


def _collectives_rank_main(rank: int, world_size: int) -> dict:
    out = {name: _train_step(SMALL, mode, acc, rank, "fsdp") for name, (mode, acc) in FSDP_CASES.items()}
    out["ddp"] = _train_step(SMALL, "none", 1, rank, "ddp")
    return out


@pytest.fixture(scope="module")
def two_rank_counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ranks(_collectives_rank_main, tmp_path_factory.mktemp("plan-2-ranks"))


def planned(spec, mesh: Mesh) -> dict[str, float]:
    """The plan's payload per kind, the routed experts' with the rest's, Newton-Schulz's per-group gathers summed,
    the loads and candidates together."""
    out: dict[str, float] = collections.defaultdict(float)
    for x in plan_comm(spec, mesh):
        kind = x.kind.removesuffix(" (routed experts)")
        if kind.startswith("Newton-Schulz update"):
            kind = "Newton-Schulz update"
        elif kind.startswith("Newton-Schulz momentum"):
            kind = "Newton-Schulz momentum"
        elif kind.endswith("all-gather") and ("Balancing" in kind or "load" in kind):
            kind = "balancing"
        out[kind] += x.payload
    return dict(out)


@pytest.mark.slow
@pytest.mark.parametrize("case", [*FSDP_CASES, "ddp"])
def test_collective_bytes_equal_a_two_rank_gloo_run(two_rank_counts: list[dict], case: str) -> None:
    """Every kind the plan lists is what both ranks passed to torch.distributed, byte for byte: FSDP2's padded
    all-gathers (forward and backward, every micro-batch) and reduce-scatter (once), DDP's buckets, Muon's gathers
    of whole momenta and of the orthogonalised updates, Quantile Balancing's gathers."""
    mode, accumulation = FSDP_CASES.get(case, ("none", 1))
    spec = spec_of(
        *SMALL, f"train.activation_checkpointing={mode}", f"train.gradient_accumulation_steps={accumulation}"
    )
    mesh = Mesh(1, 2, 1) if case in FSDP_CASES else Mesh(2, 1, 1)
    want = planned(spec, mesh)
    for rank, counts in enumerate(two_rank_counts):
        assert counts[case] == pytest.approx(want, rel=1e-9), f"rank {rank}"


def _expert_parallel_rank_main(rank: int, world_size: int) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from k3train.models.k3.expert_parallel import shard_experts
    from k3train.models.k3.moe import MoE

    class AllToAllBytes(TorchDispatchMode):
        """Each all-to-all's input bytes (what this rank sends), the backward's too."""

        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_to_all" in func.name() or "alltoall" in func.name():
                tensors = args[1] if "alltoall" in func.name() else args[0]  # c10d: (outputs, inputs, ...)
                self.bytes += tensors.nbytes
            return func(*args, **(kwargs or {}))

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
    """Both ranks of an ep = 2 exchange (k3train/models/k3/expert_parallel.py) together send what the plan says two
    ranks send: each rank sends all its slots out and its experts' results back, forward and backward."""
    counts = spawn_ranks(_expert_parallel_rank_main, tmp_path)
    spec = spec_of(*SMALL, "precision=bf16")
    (a2a,) = [x for x in plan_comm(spec, Mesh(2, 1, 2)) if x.kind == "EP all-to-all"]
    assert sum(c["all_to_all"] for c in counts) == 2 * a2a.payload


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


def test_nothing_fits_exits_2_and_names_the_largest_items(capsys: pytest.CaptureFixture) -> None:
    assert main(["model=k3", "--gpus", "8", "--gpu", "h100"]) == 2
    captured = capsys.readouterr()
    assert "nothing fits" in captured.out and "largest items" in captured.out
    assert "nothing fits on 8 x NVIDIA H100 SXM (exit 2)" in captured.err


def test_bad_input_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main([*TINY, "--gpus", "4", "--mesh", "1x2x1"]) == 2  # 2 ranks for 4 devices
    assert main(["model=smoke_test_lm", "--vocab-size", "257"]) == 2  # not a KimiK3
    assert "KimiK3" in capsys.readouterr().err


def test_a_given_mesh_is_planned_as_given(capsys: pytest.CaptureFixture) -> None:
    assert main([*TINY, "--gpus", "4", "--mesh", "1x4x2", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "mesh 1x4x2" in out and "EP all-to-all" in out and "FSDP all-gather (routed experts)" in out


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
    assert Mesh(1, 1024, 64).expert_shard == 16 and Mesh(8, 1, 4).expert_replicas == 2
    for bad in ("1x1024x3", "1x6x4", "abc", "0x4x1"):
        with pytest.raises(ValueError):
            Mesh.parse(bad)
    assert [str(m) for m in candidates(4, 8)] == ["4x1x1", "4x1x2", "4x1x4", "1x4x1", "1x4x2", "1x4x4"]
