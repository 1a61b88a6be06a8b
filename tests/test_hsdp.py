"""HSDP (parallel=hsdp: FSDP2 over a 2-D (dp_replicate, dp_shard) mesh) on CPU (gloo): 2 replica groups of 2
sharded ranks train as 1 process does with the same global batch (Muon's owners within each group, Quantile
Balancing and QK-Clip over all four), and its sharded checkpoint resumes on another mesh (plain FSDP2 on 2 ranks)
and consolidates into one file."""

import pytest
from test_fsdp import assert_same_steps, assert_same_weights

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.consolidate import consolidate
from k3train.runtime.parallel_dims import ParallelDims

from helpers.distributed_runs import FP64_BOUND, K3, launch, steps


@pytest.mark.slow
def test_hsdp_2x2_k3_tiny_equals_one_process_and_resumes_on_another_mesh(k3_cache, tmp_path):
    args = [
        *K3,
        "train.max_steps=4",
        "train.gradient_accumulation_steps=2",
        "train.checkpoint_interval=2",
        "train.keep_last_k=2",
    ]
    one, four, two = tmp_path / "one", tmp_path / "four", tmp_path / "two"
    proc = launch(k3_cache, *args, "train.batch_size=4", f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *args, "parallel=hsdp", "train.batch_size=1", f"hydra.run.dir={four}", ranks=4)
    assert proc.returncode == 0, proc.stderr
    assert "HSDP: 2 replica groups, each FSDP2 over 2 process(es)" in proc.stdout
    for event in ("train", "eval"):
        assert_same_steps(steps(four, event), steps(one, event), rel=FP64_BOUND)
    want, got = load_checkpoint(one / "last.pt")["model"], load_checkpoint(four / "last.dcp")["model"]
    assert_same_weights(got, want, atol=FP64_BOUND)

    # the step-2 checkpoint of 2 x 2 ranks resumed by plain FSDP2 on 2 ranks (2 rows each: the same global batch)
    step2 = four / "step_0000002.dcp"
    proc = launch(
        k3_cache, *args, "parallel=fsdp", "train.batch_size=2", f"hydra.run.dir={two}", f"resume={step2}", ranks=2
    )
    assert proc.returncode == 0, proc.stderr
    assert_same_steps(steps(two), {s: loss for s, loss in steps(one).items() if s > 2}, rel=FP64_BOUND)
    assert_same_weights(load_checkpoint(two / "last.dcp")["model"], got, atol=FP64_BOUND)
    assert load_checkpoint(consolidate(step2))["trainer"]["step"] == 2


@pytest.mark.slow
def test_hsdp_with_expert_parallelism_equals_one_process_and_resumes_under_fsdp(k3_cache, tmp_path):
    """HSDP 2 x 2 with parallel.ep=2: each replica group splits the routed experts over its 2 ranks, whole on each
    (expert_shard 1: averaged over the replicas by hand); its step-2 checkpoint (the experts on the (ep,
    expert_replicate, expert_shard) mesh) resumes under FSDP2 + EP on 2 ranks. 8 ranks (2 x 4, the experts
    FSDP-sharded within a group as well) were measured by hand: docs/distributed.md."""
    args = [*K3, "train.max_steps=4", "train.gradient_accumulation_steps=2", "train.checkpoint_interval=2"]
    args.append("train.keep_last_k=2")  # step 2 is kept
    one, four, two = tmp_path / "one", tmp_path / "four", tmp_path / "two"
    assert launch(k3_cache, *args, "train.batch_size=4", f"hydra.run.dir={one}", ranks=None).returncode == 0
    hsdp = ["parallel=hsdp", "parallel.ep=2", "train.batch_size=1", f"hydra.run.dir={four}"]
    proc = launch(k3_cache, *args, *hsdp, ranks=4)
    assert proc.returncode == 0, proc.stderr
    assert "HSDP: 2 replica groups, each FSDP2 over 2 process(es), routed experts split over 2 ranks" in proc.stdout
    assert_same_steps(steps(four), steps(one), rel=FP64_BOUND)
    want, got = load_checkpoint(one / "last.pt")["model"], load_checkpoint(four / "last.dcp")["model"]
    assert_same_weights(got, want, atol=FP64_BOUND)
    step2 = four / "step_0000002.dcp"
    fsdp = ["parallel=fsdp", "parallel.ep=2", "train.batch_size=2", f"hydra.run.dir={two}", f"resume={step2}"]
    proc = launch(k3_cache, *args, *fsdp, ranks=2)
    assert proc.returncode == 0, proc.stderr
    assert_same_steps(steps(two), {s: loss for s, loss in steps(one).items() if s > 2}, rel=FP64_BOUND)
    assert_same_weights(load_checkpoint(two / "last.dcp")["model"], got, atol=FP64_BOUND)


def test_an_hsdp_layout_that_cannot_be_built_is_refused_in_one_line(k3_cache, tmp_path):
    run = tmp_path / "run"
    proc = launch(k3_cache, *K3, "parallel=hsdp", f"hydra.run.dir={run}", ranks=None)  # 2 groups of 1 process?
    assert proc.returncode == 2, proc.stderr
    assert "parallel.dp_replicate=2 must be a positive integer dividing the 1 process(es)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (run / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="parallel.ep=4 must divide dp_shard=2"):  # ep within a replica group
        ParallelDims.for_strategy("fsdp", 4, 0, "cpu", ep=4, dp_replicate=2)
    with pytest.raises(ValueError, match="under parallel=ddp every process is a replica"):
        ParallelDims.for_strategy("ddp", 4, 0, "cpu", dp_replicate=2)
