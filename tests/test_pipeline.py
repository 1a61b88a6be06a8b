"""Pipeline parallelism's engine (k3train/train/pipeline.py, k3train/models/k3/pipeline.py): k3_tiny cut by block over
2 gloo ranks runs each schedule to the losses, gradients and weights of one process accumulating the same
micro-batches (attention residuals crossing the cuts, Quantile Balancing, document masking, block checkpointing),
over several Muon + AdamW updates; and the settings a pipeline cannot run are refused in one line."""

from __future__ import annotations

import functools

import pytest
import torch
from hydra.utils import instantiate

from k3train.models.common.init import InitialWeights, materialise
from k3train.models.common.parallelize import FullyShard
from k3train.optim.build import muon_adamw
from k3train.runtime.parallel_dims import ParallelDims
from k3train.runtime.parallel_layout import PipelineSettings, stage_bounds, stages_of
from k3train.train.pipeline import Pipeline

from helpers.config import composed
from helpers.spawn import spawn_ranks

SMALL = [
    "model=k3_tiny",
    "model.d_model=64",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.kda_chunk_size=16",
    "model.vocab_size=257",
]
ROWS, T, MICROBATCHES, UPDATES = 4, 32, 4, 3
OPTIM = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, momentum=0.95, nesterov=True, ns_steps=5,
             rms_match=0.2, head_wise=True, orthogonality_check_interval=50, ns_dtype="fp64")  # fmt: skip
CASES = {  # name -> (schedule, stages a rank, activation checkpointing)
    "gpipe": ("gpipe", 1, "none"),
    "1f1b": ("1f1b", 1, "none"),
    "1f1b, block checkpointing": ("1f1b", 1, "block"),
    "interleaved_1f1b": ("interleaved_1f1b", 2, "none"),
    "interleaved_zero_bubble": ("interleaved_zero_bubble", 2, "none"),
    "zbv_zero_bubble": ("zbv_zero_bubble", 2, "selective"),
    "dualpipev": ("dualpipev", 2, "none"),  # DualPipe's V: a micro-batch's forward overlapped with another's backward
}


def _model(checkpointing: str, device: str = "cpu"):
    """SMALL drawn from seed 0; on the meta device, as a run builds it before cutting it (nothing allocated). In
    fp64 (as tests/helpers/distributed_runs.py's K3), so that "equals one process" judges the schedules, not how
    fp32's last bits, which differ with how a sum is split, grow through AdamW's normalised update of a nearly
    cancelling gradient (up to 4e-6 in 3 updates here)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = instantiate(composed(*SMALL).model).train()
    model.set_activation_checkpointing(checkpointing)
    return model.to(torch.float64)


def _batch(update: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(update)
    tokens = torch.randint(0, 257, (ROWS, T + 1), generator=g)
    starts = torch.zeros(ROWS, T, dtype=torch.long)
    starts[:, [9, 20]] = 1  # three documents a row
    return tokens[:, :-1], tokens[:, 1:], starts.cumsum(1)


def _one_process(checkpointing: str, microbatches: int = MICROBATCHES) -> dict:
    model = _model(checkpointing)
    optimizer = muon_adamw(model, **OPTIM)
    losses = []
    for update in range(UPDATES):
        x, y, docs = _batch(update)
        total = 0.0
        for xs, ys, ds in zip(x.chunk(microbatches), y.chunk(microbatches), docs.chunk(microbatches)):
            _, loss = model(xs, targets=ys, document_ids=ds)
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _allocate(stage, weights):
    """A stage built on the meta device allocated on the CPU and filled with one process's initial weights."""
    return materialise(stage, torch.device("cpu"), weights)


def _pipelined(rank: int, world_size: int) -> dict:
    out = {}
    for name, (schedule, virtual, checkpointing) in CASES.items():
        model = _model(checkpointing, device="meta")
        settings = PipelineSettings(world_size, schedule, virtual)
        allocate = functools.partial(_allocate, weights=InitialWeights(model.init_rules(), 0))  # seed 0's draws
        micro = (ROWS // MICROBATCHES, T)
        pipe = Pipeline(model, settings, rank, None, torch.device("cpu"), MICROBATCHES, micro, parallelize=allocate)
        held = {n for module in pipe.modules for n, _ in module.named_parameters()}
        unallocated = {n for n, p in model.named_parameters() if p.is_meta}  # the other stages': no memory
        assert unallocated == {n for n, _ in model.named_parameters()} - held, name
        optimizer = muon_adamw(torch.nn.ModuleList(pipe.modules), **OPTIM)
        losses = []
        for update in range(UPDATES):
            x, y, docs = _batch(update)
            losses.append(pipe.step(x, y, docs))
            optimizer.step()
            optimizer.zero_grad()
        weights = {}
        for module in pipe.modules:
            weights |= {n: p.detach().clone() for n, p in module.named_parameters()}
        out[name] = {"losses": losses, "weights": weights, "stages": pipe.stage_ids}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ranks(_pipelined, tmp_path_factory.mktemp("pipeline"))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_each_schedule_equals_one_process(two_ranks: list[dict], case: str) -> None:
    want = _one_process(CASES[case][2])
    ranks = [r[case] for r in two_ranks]
    last = [r for r in ranks if r["losses"][0] is not None]
    assert len(last) == 1 and all(r["losses"] == [None] * UPDATES for r in ranks if r is not last[0])
    assert last[0]["losses"] == pytest.approx(want["losses"], rel=1e-6)
    got = ranks[0]["weights"] | ranks[1]["weights"]
    assert sorted(got) == sorted(want["weights"])  # every parameter on some stage, under the model's name
    assert not set(ranks[0]["weights"]) & set(ranks[1]["weights"])
    for name, value in want["weights"].items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


FSDP_CASES = {"1f1b": ("1f1b", 1), "interleaved_1f1b": ("interleaved_1f1b", 2)}  # name -> (schedule, stages a rank)
FSDP_MICROBATCHES = 2  # of 2 rows: one a rank of the stage


def _pipelined_fsdp(rank: int, world_size: int) -> dict:
    """2 stages, each FSDP2 over 2 ranks: the stage's ranks take their half of every micro-batch's rows, so each
    micro-batch's forward over the stage's ranks (Quantile Balancing reduces over them) sees one process's rows."""
    dims = ParallelDims(dp_shard=2, pp=2, rank=rank)
    out = {}
    for name, (schedule, virtual) in FSDP_CASES.items():
        model = _model("none", device="meta")
        settings = PipelineSettings(dims.pp, schedule, virtual)
        rows = ROWS // dims.dp_size

        weights = InitialWeights(model.init_rules(), 0)

        def shard(stage, dims=dims, weights=weights):
            stage.parallelize(dims, FullyShard())
            _allocate(stage, weights)

        pipe = Pipeline(
            model, settings, dims.pp_rank, dims.pp_group, torch.device("cpu"), FSDP_MICROBATCHES,
            (rows // FSDP_MICROBATCHES, T), parallelize=shard,
        )  # fmt: skip
        optimizer = muon_adamw(torch.nn.ModuleList(pipe.modules), **OPTIM, process_group=dims.dp_group)
        losses = []
        for update in range(UPDATES):
            mine = [
                t.view(FSDP_MICROBATCHES, dims.dp_size, -1, T)[:, dims.dp_rank].flatten(0, 1) for t in _batch(update)
            ]
            losses.append(pipe.step(*mine))
            pipe.reduce_gradients(dims.dp_group)
            optimizer.step()
            optimizer.zero_grad()
        weights = {}
        for module in pipe.modules:
            weights |= {n: p.detach().full_tensor().clone() for n, p in module.named_parameters()}
        out[name] = {"losses": losses, "weights": weights}
    return out


@pytest.mark.slow
def test_2_stages_x_fsdp2_over_2_ranks_equal_one_process(tmp_path) -> None:
    """pp 2 x FSDP2 2 on 4 gloo ranks (each stage its own FSDP2 root over its 2 ranks; Muon's owners, Quantile
    Balancing and the gradient average within a stage): one process's losses and weights within 1e-5."""
    want = _one_process("none", FSDP_MICROBATCHES)
    ranks = spawn_ranks(_pipelined_fsdp, tmp_path, nprocs=4)
    for case in FSDP_CASES:
        last = [r[case]["losses"] for r in ranks if r[case]["losses"][0] is not None]
        assert len(last) == 2  # the last stage's 2 ranks: each its half of the rows
        mean = [sum(losses) / 2 for losses in zip(*last)]
        assert mean == pytest.approx(want["losses"], rel=1e-5), case
        got = ranks[0][case]["weights"] | ranks[2][case]["weights"]
        assert ranks[0][case]["weights"].keys() == ranks[1][case]["weights"].keys()  # a stage's ranks: one stage
        assert sorted(got) == sorted(want["weights"])
        for name, value in want["weights"].items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=f"{case}: {name}")


def test_stages_split_the_layers_evenly_and_ranks_hold_them_loop_or_v_style() -> None:
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)] and stage_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert stages_of(1, PipelineSettings(4, "interleaved_1f1b", 2)) == [1, 5]
    assert stages_of(1, PipelineSettings(4, "zbv_zero_bubble", 2)) == [1, 6]
    assert stages_of(1, PipelineSettings(4, "dualpipev", 2)) == [1, 6]
    assert stages_of(3, PipelineSettings(4, "1f1b")) == [3]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: stage_bounds(4, 8), "8 pipeline stages .* for 4 layers: every stage needs a layer"),
        (lambda: PipelineSettings(2, "1f1f"), "parallel.pp_schedule='1f1f' is not a schedule; choose one of gpipe"),
        (lambda: PipelineSettings(2, "zbv_zero_bubble", 3), "zbv_zero_bubble holds 2 stages a rank"),
        (lambda: PipelineSettings(2, "1f1b", 2), "1f1b holds one stage a rank"),
        (lambda: PipelineSettings(2, "interleaved_1f1b", 1), "set parallel.pp_virtual_stages to 2 or more"),
        (lambda: PipelineSettings(0), "parallel.pp=0 must be a positive integer"),
        (lambda: PipelineSettings(2, microbatches=3).n_microbatches(8, 2), "pp_microbatches=3 must divide the"),
        (lambda: PipelineSettings(4).n_microbatches(8, 2), "needs at least pp=4 micro-batches an update, got 2"),
    ],
)
def test_settings_a_pipeline_cannot_run_are_refused_in_one_line(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_tied_embeddings_cannot_be_cut() -> None:
    model = instantiate(composed(*SMALL, "model.tie_embeddings=true").model)
    with pytest.raises(ValueError, match="untie them \\(model.tie_embeddings=false\\) or set parallel.pp=1"):
        model.pipeline_stage(0, 2)
    assert model.pipeline_stage(0, 4).is_last  # one stage holds both: nothing to cut
