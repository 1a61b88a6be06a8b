"""Context parallelism (parallel.cp): each row's sequence split over ranks.

KDA's state passing (k3train/models/kda/context_parallel.py) is checked first in one process: the sequence cut into
slices, each summarised alone and the summaries composed, gives chunk_kda's outputs and gradients on the whole
sequence in fp64, with and without documents, a boundary at a slice's first position, inside a chunk and at a chunk
edge. Then on 2 gloo ranks: KDA-only, MLA-only and K3-shaped tiny models, half a row each, equal one process with
the whole row (outputs and every gradient), and a training run with parallel.cp=2 logs one process's losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3train.models.kda.chunk import chunk_kda
from k3train.models.kda.context_parallel import entering_states, slice_summary

B, T, H, K, C = 2, 96, 2, 16, 16


def kda_inputs(dtype=torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    decay = -0.3 * torch.rand(B, T, H, K, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def documents(case: str) -> torch.Tensor | None:
    """None, or ids with boundaries at a slice start (48 of 2 slices), inside a chunk and at a chunk edge (64)."""
    if case == "none":
        return None
    ids = torch.zeros(B, T, dtype=torch.long)
    ids[0, 40:], ids[0, 48:] = 1, 2  # 40: inside a chunk; 48: where the second of 2 slices starts
    ids[1, 21:], ids[1, 64:] = 1, 2  # 64: a chunk edge
    return ids


def sliced(inputs: list[torch.Tensor], ids: torch.Tensor | None, n: int) -> torch.Tensor:
    """chunk_kda's output from n slices summarised alone and composed, as n ranks do."""
    L = T // n
    parts = [slice(r * L, (r + 1) * L) for r in range(n)]
    summaries = [slice_summary(*(x[:, s] for x in inputs), C, None if ids is None else ids[:, s]) for s in parts]
    transitions, finals = [m for _, _, m, _ in summaries], [f for _, _, _, f in summaries]
    continues = [torch.zeros(B)] + [
        torch.ones(B) if ids is None else (ids[:, s.start] == ids[:, s.start - 1]).double() for s in parts[1:]
    ]
    outputs = []
    for r, (o0, Q, _, _) in enumerate(summaries):
        S_in = entering_states(transitions, finals, continues, r)
        outputs.append(o0 + torch.einsum("bthk,bhkv->bthv", Q, S_in))
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("case", ["none", "documents"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_kda_slices_composed_equal_the_whole_sequence(case: str, n: int) -> None:
    ids = documents(case)
    inputs = kda_inputs()
    want = chunk_kda(*inputs, chunk_size=C, document_ids=ids)[0]
    cotangent = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, inputs, cotangent)
    got = sliced(inputs, ids, n)
    got_grads = torch.autograd.grad(got, inputs, cotangent)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name, g, w in zip(("q", "k", "v", "g", "beta"), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def test_bad_context_parallel_settings_are_refused_saying_what_to_do() -> None:
    from k3train.data.context_slices import ContextSlices
    from k3train.models.common.context_parallel import ContextParallel
    from k3train.models.kda.layer import KimiDeltaAttention
    from k3train.runtime.parallel_dims import ParallelDims

    dims = ParallelDims.for_strategy("ddp", world_size=4, rank=3, device_type="cpu", cp=2)
    assert (dims.dp_size, dims.dp_rank, dims.cp_rank) == (2, 1, 1)
    assert dims.describe() == "DDP over 4 process(es), each sequence split over 2 ranks (context parallel)"
    assert ParallelDims().cp_group is None
    with pytest.raises(ValueError, match="parallel.cp=3 must divide the 4 process"):
        ParallelDims(dp_replicate=4, cp=3)

    class Loader:
        seq_len = 30

    with pytest.raises(ValueError, match="train.seq_len=30 does not split over parallel.cp=4"):
        ContextSlices(Loader(), 0, 4)
    layer = KimiDeltaAttention(32, 2, 16, implementation="recurrent")
    with pytest.raises(ValueError, match="set model.kda_implementation=chunk"):
        layer.context_parallel = ContextParallel(group=None)


# ---- 2 gloo ranks, half a row each --------------------------------------------------------------------------------

ROW = 64  # tiny_k3's max_seq_len: 32 positions a rank, 2 KDA chunks of 16
# Row 0: a document from 20 to 50 runs across the split at 32; row 1: a document starts exactly at 32.
ACROSS_THE_SPLIT = [[20, 30, 14], [1, 31, 32]]
K3_PARTS = dict(
    attn_res_block_size=2, ffn_activation="situ", expert_latent_dim=16, mla_output_gate=True,
    kda_output_gate="full_rank", kda_gate="sigmoid", mla_rope=True,
)  # fmt: skip
MODELS = {"kda_only": dict(kda_mla_ratio="1:0"), "mla_only": dict(kda_mla_ratio="0:1"), "k3": K3_PARTS}
LAYOUTS = {"one_sequence": None, "documents": ACROSS_THE_SPLIT}


def _ids(lengths: list[list[int]] | None) -> torch.Tensor | None:
    if lengths is None:
        return None
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def _losses_and_grads(model, x, y, ids, scale: float) -> dict:
    """Training mode: per-token losses and the gradient of their sum x scale (the batch mean's share)."""
    logits, _ = model(x, document_ids=ids)
    losses = F.cross_entropy(logits.transpose(1, 2).double(), y, reduction="none")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(losses.sum() * scale, [p for _, p in named], allow_unused=True)
    return {
        "losses": losses.detach(),
        "grads": {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)},
    }


def _case(name: str, layout: str, rank: int | None = None) -> dict:
    """One process on the whole rows (rank None), or rank r of 2 on its half of them."""
    import torch.distributed as dist

    from k3train.models.common.context_parallel import ContextParallel, set_context_parallel
    from k3train.models.k3.moe import MoE

    from helpers.tiny_k3 import V, tiny_model

    model = tiny_model(0, **MODELS[name]).double()
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, V, (2, ROW), generator=gen) for _ in range(2))
    ids, scale = _ids(LAYOUTS[layout]), 1 / x.numel()
    if rank is not None:
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            moe.process_group = dist.group.WORLD  # Quantile Balancing over both halves' tokens
        assert set_context_parallel(model, ContextParallel(dist.group.WORLD))
        half = slice(rank * ROW // 2, (rank + 1) * ROW // 2)
        x, y, ids = x[:, half], y[:, half], None if ids is None else ids[:, half]
    return _losses_and_grads(model, x, y, ids, scale)


def _rank_main(rank: int, world_size: int) -> dict:
    return {f"{name}/{layout}": _case(name, layout, rank) for name in MODELS for layout in LAYOUTS}


@pytest.fixture(scope="module")
def two_halves(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from helpers.spawn import spawn_ranks

    return spawn_ranks(_rank_main, tmp_path_factory.mktemp("cp-2-ranks"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_with_half_a_row_each_equal_one_process(two_halves: list[dict], name: str, layout: str) -> None:
    """fp64: each rank's per-token losses are one process's on its half, and the two ranks' gradients (each the
    gradient of its own losses, reaching the other rank's activations through the exchanges) sum to one process's
    gradient of every parameter: what DDP's average over the ranks then gives."""
    torch.set_num_threads(1)
    want = _case(name, layout)
    got = [r[f"{name}/{layout}"] for r in two_halves]
    torch.testing.assert_close(torch.cat([g["losses"] for g in got], dim=1), want["losses"], rtol=0, atol=1e-10)
    for param, g in want["grads"].items():
        total = got[0]["grads"][param] + got[1]["grads"][param]
        torch.testing.assert_close(total, g, rtol=1e-10, atol=1e-12, msg=param)


# ---- parallel.cp in a run (torchrun, 2 gloo ranks) ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("masking", ["true", "false"])
def test_a_run_with_cp_2_trains_as_one_process_and_resumes_in_one(k3_cache, tmp_path, masking: str) -> None:
    """k3_tiny shrunk (KDA + MLA, Muon, Quantile Balancing, QK-Clip), rows of 32 positions, 16 a rank, 4 updates of
    2 micro-batches, with the built-in corpus's documents masked or not: 2 ranks holding half of every row log the
    train and eval losses of one process and end with its weights (fp64: within FP64_BOUND). The same run stopped at
    step 2 resumes in one process (the global batch is the same: both ranks read the same rows) to the same losses."""
    from k3train.checkpoint.checkpointer import load_checkpoint

    from helpers.distributed_runs import FP64_BOUND, K3, launch, steps

    args = [
        *K3,
        "train.max_steps=4",
        "train.gradient_accumulation_steps=2",
        "train.checkpoint_interval=2",
        "train.batch_size=4",
        f"data.document_masking={masking}",
    ]
    one, two, switched = tmp_path / "one", tmp_path / "two", tmp_path / "switched"
    proc = launch(k3_cache, *args, f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *args, "parallel.cp=2", f"hydra.run.dir={two}")
    assert proc.returncode == 0, proc.stderr
    assert "each sequence split over 2 ranks (context parallel)" in proc.stdout
    for event in ("train", "eval"):
        a, b = steps(one, event), steps(two, event)
        assert sorted(a) == sorted(b) and len(a) >= 2
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=FP64_BOUND), (event, step)
    want, got = load_checkpoint(one / "last.pt")["model"], load_checkpoint(two / "last.pt")["model"]
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=FP64_BOUND, msg=name)

    proc = launch(k3_cache, *args, "parallel.cp=2", "train.stop_after=2", f"hydra.run.dir={switched}")
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *args, f"hydra.run.dir={switched}", "resume=auto", ranks=None)
    assert proc.returncode == 0, proc.stderr
    for step, loss in steps(one).items():
        assert steps(switched)[step] == pytest.approx(loss, rel=FP64_BOUND), step


@pytest.mark.slow
def test_cp_composes_with_fsdp_and_expert_parallelism(k3_cache, tmp_path) -> None:
    """parallel=fsdp parallel.ep=2 parallel.cp=2 on 2 ranks: the dense weights sharded, the routed experts split and
    each row's sequence split over the same two ranks; the losses of one process with the same global batch. The
    data a mixture of two sources at 1:3, so the train loss per source is summed over slices of rows too."""
    from helpers.distributed_runs import FP64_BOUND, K3, launch, steps

    mixture = ["data=mixture", "data.sources=[{name:a,path:null},{name:b,path:null}]", "data.weights=[0.25,0.75]"]
    args = [*K3, *mixture, "train.max_steps=3", "train.batch_size=4"]
    one, all_three = tmp_path / "one", tmp_path / "all_three"
    proc = launch(k3_cache, *args, f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    both = ["parallel=fsdp", "parallel.ep=2", "parallel.cp=2"]
    proc = launch(k3_cache, *args, *both, f"hydra.run.dir={all_three}")
    assert proc.returncode == 0, proc.stderr
    for key in ("loss", "train/a/loss", "train/b/loss"):
        want = steps(one, key=key)
        assert sorted(want) == [1, 2, 3], key
        assert steps(all_three, key=key) == pytest.approx(want, rel=FP64_BOUND), key


@pytest.mark.slow
@pytest.mark.parametrize("mixers", ["1:0", "0:1"], ids=["kda_only", "mla_only"])
def test_kda_only_and_mla_only_runs_with_cp_2_train_as_one_process(k3_cache, tmp_path, mixers: str) -> None:
    """The k3_tiny run above with every mixer KDA, or every mixer MLA: 4 updates, the losses of one process."""
    from helpers.distributed_runs import FP64_BOUND, K3, launch, steps

    args = [*K3, f"model.kda_mla_ratio={mixers}", "train.max_steps=4", "train.batch_size=4"]
    one, two = tmp_path / "one", tmp_path / "two"
    proc = launch(k3_cache, *args, f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *args, "parallel.cp=2", f"hydra.run.dir={two}")
    assert proc.returncode == 0, proc.stderr
    a, b = steps(one), steps(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=FP64_BOUND), step
