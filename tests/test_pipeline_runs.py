"""parallel.pp end to end (python -m k3train under torchrun, gloo on CPU): a pipelined run takes one process's steps
(2 ranks, and 4 ranks: 2 stages x 2 data-parallel), writes the whole model's checkpoint, which resumes without the
pipeline and with another schedule, resumes exactly after a rank is killed, and bad pipeline settings are refused in
one line before anything is written."""

from pathlib import Path

import pytest
from test_fsdp import assert_same_steps, assert_same_weights

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.consolidate import consolidate
from k3train.observe.metrics import read_metrics

from helpers.distributed_runs import FP64_BOUND, K3, kill_a_rank_then_resume, launch, steps
from helpers.heavy import heavy

ARGS = [*K3, "train.max_steps=4", "train.gradient_accumulation_steps=2", "train.checkpoint_interval=2"]
ARGS.append("train.keep_last_k=3")


@pytest.fixture(scope="module")
def one_process(k3_cache, tmp_path_factory) -> Path:
    """The reference: one process, 4 rows a micro-batch (the global batch of every pipelined run below)."""
    run = tmp_path_factory.mktemp("one") / "run"
    assert launch(k3_cache, *ARGS, "train.batch_size=4", f"hydra.run.dir={run}", ranks=None).returncode == 0
    return run


@pytest.mark.slow
def test_a_pipelined_run_takes_one_process_steps_and_its_checkpoint_resumes_anywhere(k3_cache, tmp_path):
    one, two, four, back = (tmp_path / name for name in ("one", "two", "four", "back"))
    assert launch(k3_cache, *ARGS, "train.batch_size=2", f"hydra.run.dir={one}", ranks=None).returncode == 0
    proc = launch(k3_cache, *ARGS, "parallel.pp=2", "train.batch_size=2", f"hydra.run.dir={two}")
    assert proc.returncode == 0, proc.stderr
    assert "2 pipeline stages, each DDP over 1 process(es)" in proc.stdout
    for event in ("train", "eval"):
        assert_same_steps(steps(two, event), steps(one, event), rel=FP64_BOUND)
    want = load_checkpoint(one / "last.pt")
    got = load_checkpoint(two / "last.pt")  # the whole model, as one process writes it
    assert_same_weights(got["model"], want["model"], atol=FP64_BOUND)
    assert sorted(got["optimizer"]["state"]) == sorted(want["optimizer"]["state"])
    train = [e for e in read_metrics(two / "metrics.jsonl") if e["event"] == "train"]
    assert sum(e["qk_clip"]["n_clipped"] for e in train) > 0  # the MLA layer is on stage 1: its clipping is logged
    one_train = [e for e in read_metrics(one / "metrics.jsonl") if e["event"] == "train"]
    assert set(train[-1]["model"]) == set(one_train[-1]["model"])  # every stage's MoE layers reported

    # 2 stages x 2 data-parallel ranks, interleaved (2 stages a rank): the same global batch of 4 rows a micro-batch
    args = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"]
    proc = launch(k3_cache, *ARGS, *args, "train.batch_size=1", f"hydra.run.dir={four}", ranks=4)
    assert proc.returncode == 0, proc.stderr
    assert "2 pipeline stages, each DDP over 2 process(es)" in proc.stdout

    # the pipelined step-2 checkpoint in one process, which goes on as the pipeline did
    step2 = two / "step_0000002.pt"
    proc = launch(k3_cache, *ARGS, "train.batch_size=2", f"hydra.run.dir={back}", f"resume={step2}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    assert_same_steps(steps(back), {s: loss for s, loss in steps(one).items() if s > 2}, rel=FP64_BOUND)
    assert_same_weights(load_checkpoint(back / "last.pt")["model"], want["model"], atol=FP64_BOUND)


@pytest.mark.slow
def test_2_stages_x_2_data_parallel_ranks_equal_ddp_on_2(k3_cache, tmp_path, one_process):
    """gpipe over 2 stages, each DDP over 2 ranks: one process's losses and weights."""
    one, four = one_process, tmp_path / "four"
    args = ["parallel.pp=2", "parallel.pp_schedule=gpipe", "train.batch_size=2"]
    proc = launch(k3_cache, *ARGS, *args, f"hydra.run.dir={four}", ranks=4)
    assert proc.returncode == 0, proc.stderr
    assert_same_steps(steps(four), steps(one), rel=FP64_BOUND)
    assert_same_steps(steps(four, "eval"), steps(one, "eval"), rel=FP64_BOUND)
    want = load_checkpoint(one / "last.pt")["model"]
    assert_same_weights(load_checkpoint(four / "last.pt")["model"], want, atol=FP64_BOUND)


@pytest.mark.slow
def test_2_stages_x_fsdp2_equal_one_process_and_their_stage_sharded_checkpoint_resumes_on_another_mesh(
    k3_cache, tmp_path, one_process
):
    """2 stages, each FSDP2 over 2 ranks: one process's losses and weights (fp64: within FP64_BOUND); every rank
    writes its own shards of its stage (one .dcp directory whose skeleton the stages merged), which holds the whole
    model and its optimizer as one process numbers them, resumes under plain FSDP2 on 2 ranks and under an interleaved
    pipeline, and consolidates into one file."""
    one = one_process
    four, fsdp, interleaved = (tmp_path / name for name in ("four", "fsdp", "interleaved"))
    args = ["parallel=fsdp", "parallel.pp=2", "train.batch_size=2"]
    proc = launch(k3_cache, *ARGS, *args, f"hydra.run.dir={four}", ranks=4)
    assert proc.returncode == 0, proc.stderr
    assert "2 pipeline stages, each FSDP2 over 2 process(es)" in proc.stdout
    assert "returned a view tensor" not in proc.stderr  # the last stage's loss is FSDP2's root output
    for event in ("train", "eval"):
        assert_same_steps(steps(four, event), steps(one, event), rel=FP64_BOUND)
    want, got = load_checkpoint(one / "last.pt"), load_checkpoint(four / "last.dcp")
    assert_same_weights(got["model"], want["model"], atol=FP64_BOUND)
    assert sorted(got["optimizer"]["state"]) == sorted(want["optimizer"]["state"])
    assert [g["name"] for g in got["optimizer"]["param_groups"]] == [
        g["name"] for g in want["optimizer"]["param_groups"]
    ]

    step2 = four / "step_0000002.dcp"
    later = {s: loss for s, loss in steps(one).items() if s > 2}
    for run, recipe, ranks in (
        (fsdp, ["parallel=fsdp", "train.batch_size=2"], 2),
        (interleaved, [*args, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"], 4),
    ):
        proc = launch(k3_cache, *ARGS, *recipe, f"hydra.run.dir={run}", f"resume={step2}", ranks=ranks)
        assert proc.returncode == 0, proc.stderr
        assert_same_steps(steps(run), later, rel=FP64_BOUND)
        assert_same_weights(load_checkpoint(run / "last.dcp")["model"], got["model"], atol=FP64_BOUND)
    assert load_checkpoint(consolidate(step2))["trainer"]["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, ranks, layout",
    [
        (["parallel.cp=2", "train.batch_size=4"], 4, "DDP over 2 process(es), each sequence split over 2 ranks"),
        pytest.param(
            ["parallel=hsdp", "train.batch_size=1"],
            8,
            "HSDP: 2 replica groups, each FSDP2 over 2 process(es)",
            marks=heavy,
        ),
        pytest.param(
            ["parallel.ep=2", "train.batch_size=2"],
            4,
            "DDP over 2 process(es), routed experts split over 2 ranks",
            marks=heavy,  # "fsdp 2 ep 2"'s expert path (expert_shard 1: the experts averaged by hand) without FSDP2
        ),
        (
            ["parallel=fsdp", "parallel.ep=2", "train.batch_size=2"],
            4,
            "FSDP2 over 2 process(es), routed experts split over 2 ranks",
        ),
    ],
    ids=["cp 2", "hsdp 2x2", "ep 2", "fsdp 2 ep 2"],
)
def test_2_stages_of_context_hsdp_or_expert_parallel_ranks_equal_one_process(
    k3_cache, tmp_path, one_process, recipe, ranks, layout
):
    """2 stages, each splitting every row's sequence over 2 ranks (what crosses a cut is each rank's slice), each HSDP
    over 2 x 2 ranks, or each splitting its routed experts over 2 ranks (the all-to-all within a stage; under FSDP2
    each rank's experts whole, the rest sharded): one process's losses and weights (fp64: within FP64_BOUND); the
    checkpoint holds the whole model under its names (the experts whole over the stage's expert mesh)."""
    run = tmp_path / "run"
    proc = launch(k3_cache, *ARGS, "parallel.pp=2", *recipe, f"hydra.run.dir={run}", ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    assert f"2 pipeline stages, each {layout}" in proc.stdout
    for event in ("train", "eval"):
        assert_same_steps(steps(run, event), steps(one_process, event), rel=FP64_BOUND)
    want = load_checkpoint(one_process / "last.pt")["model"]
    (checkpoint,) = run.glob("last.*")
    assert_same_weights(load_checkpoint(checkpoint)["model"], want, atol=FP64_BOUND)


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize(
    "layout, ranks, last",
    [
        (["train.batch_size=2"], 2, "last.pt"),
        pytest.param(["parallel=fsdp", "train.batch_size=1"], 4, "last.dcp", marks=heavy),
    ],
    ids=["ddp, gathered", "fsdp 2, sharded by stage"],
)
def test_a_killed_pipeline_rank_resumes_exactly(k3_cache, tmp_path, layout, ranks, last):
    args = [*K3, "parallel.pp=2", *layout, "train.max_steps=8", "train.gradient_accumulation_steps=2"]
    args += ["train.checkpoint_interval=2", "train.keep_last_k=3"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert launch(k3_cache, *args, f"hydra.run.dir={straight}", ranks=ranks).returncode == 0
    kill_a_rank_then_resume(k3_cache, args, straight, killed, last, ranks=ranks)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_layers=1"], "2 pipeline stages (parallel.pp x pp_virtual_stages) for 1 layers"),
        (["parallel.pp_schedule=1f1f"], "parallel.pp_schedule='1f1f' is not a schedule"),
        (["parallel.pp_microbatches=3"], "parallel.pp_microbatches=3 must divide the update's 4 rows"),
        (["precision=fp16"], "precision=fp16 with parallel.pp > 1: its loss scaling is not threaded"),
    ],
)
def test_bad_pipeline_settings_are_refused_in_one_line_before_anything_is_written(
    k3_cache, tmp_path, overrides, message
):
    run = tmp_path / "run"
    recipe = ["parallel.pp=2", "train.batch_size=2", "train.gradient_accumulation_steps=2", f"hydra.run.dir={run}"]
    proc = launch(k3_cache, *K3, *overrides, *recipe)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "exitcode  : 2" in proc.stderr  # each rank's own status: bad input
    assert not (run / "metrics.jsonl").exists() and not list(run.glob("*.pt"))


@pytest.mark.slow
def test_a_pipelined_run_resumes_pipelined_with_resume_auto_alone_and_keeps_each_stages_figures(k3_cache, tmp_path):
    """parallel.pp=2 on 2 ranks, stopped at step 2, resumed by `resume=auto` alone on 2 ranks: the layout is the
    run's (not named again, not refused), the steps are the uninterrupted run's, and each stage's Muon figures
    (measured at step 1 only) come back as that stage's, under pp<rank>/, not one stage's for both."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    args = [*ARGS, "parallel.pp=2", "train.batch_size=2"]
    assert launch(k3_cache, *args, f"hydra.run.dir={straight}").returncode == 0
    proc = launch(k3_cache, *args, "train.stop_after=2", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, f"hydra.run.dir={run}", "resume=auto")
    assert proc.returncode == 0, proc.stderr
    assert "2 pipeline stages, each DDP over 1 process(es)" in proc.stdout
    assert_same_steps(steps(run), steps(straight), rel=FP64_BOUND)
    train = {e["step"]: e["optimizer"] for e in read_metrics(run / "metrics.jsonl", final_only=True)
             if e["event"] == "train"}  # fmt: skip
    ortho = {k: v for k, v in train[1].items() if k.endswith("ns_orthogonality_error")}
    # a group whose figure both stages share exactly (an expert's rank-1 gradient: both 1.0) is reported once
    assert {k.split("/")[0] for k in ortho} >= {"pp0", "pp1"}, sorted(ortho)
    assert {k: v for k, v in train[3].items() if k.endswith("ns_orthogonality_error")} == ortho  # after the resume
