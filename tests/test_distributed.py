"""Data-parallel runs on CPU (gloo) through torchrun: 2 ranks train as 1 process does with the same global batch,
only rank 0 writes, a dead rank ends the job, and the job resumes exactly."""

import pytest
import torch

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.observe.metrics import read_metrics

from helpers.distributed_runs import FP64_BOUND, K3, SMOKE, kill_a_rank_then_resume, launch, steps

pytestmark = pytest.mark.slow


def test_two_ranks_train_as_one_process_with_their_global_batch(k3_cache, tmp_path):
    one = tmp_path / "one"
    proc = launch(k3_cache, *SMOKE, "train.max_steps=6", "train.batch_size=4", f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    outputs = tmp_path / "outputs"  # the run directory comes from hydra.run.dir's timestamp, as for a user
    proc = launch(k3_cache, *SMOKE, "train.max_steps=6", "train.batch_size=2", env={"K3TRAIN_OUTPUTS": str(outputs)})
    assert proc.returncode == 0, proc.stderr
    (two,) = [p.parent for p in outputs.glob("runs/*/*/run.json")]  # every rank resolved the same directory
    assert sorted(p.name for p in outputs.glob("runs/*/*")) == [two.name]

    for event in ("train", "eval"):
        a, b = steps(one, event), steps(two, event)
        assert sorted(a) == sorted(b) and len(a) >= 2
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5), (event, step)
    events = read_metrics(two / "metrics.jsonl")
    assert [e["event"] for e in events].count("session") == 1  # rank 0 alone writes the log
    assert [e["tokens"] for e in events if e["event"] == "train"] == [128 * s for s in range(1, 7)]  # global tokens
    a, b = load_checkpoint(one / "last.pt"), load_checkpoint(two / "last.pt")
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=1e-5, atol=1e-7)
    assert b["train_loader"]["world_size"] == 2 and b["train_loader"]["cursor"] == a["train_loader"]["cursor"]
    assert "DDP over 2 process(es)" in proc.stdout and proc.stdout.count("run directory:") == 1


def test_two_ranks_train_k3_tiny_as_one_process_with_their_global_batch(k3_cache, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    proc = launch(k3_cache, *K3, "train.max_steps=4", "train.batch_size=4", f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *K3, "train.max_steps=4", "train.batch_size=2", f"hydra.run.dir={two}")
    assert proc.returncode == 0, proc.stderr
    for event in ("train", "eval"):
        a, b = steps(one, event), steps(two, event)
        assert sorted(a) == sorted(b) and len(a) >= 2
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=FP64_BOUND), (event, step)
    clipped = [e["qk_clip"]["n_clipped"] for e in read_metrics(two / "metrics.jsonl") if e["event"] == "train"]
    assert sum(clipped) > 0, "tau=0.05 must clip, or this case does not test QK-Clip across ranks"
    a, b = load_checkpoint(one / "last.pt"), load_checkpoint(two / "last.pt")
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=FP64_BOUND)


def test_a_dead_rank_ends_the_job_and_resume_continues_exactly(k3_cache, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    args = [*SMOKE, "train.max_steps=8", "train.batch_size=2"]
    assert launch(k3_cache, *args, f"hydra.run.dir={straight}").returncode == 0
    kill_a_rank_then_resume(k3_cache, args, straight, killed, "last.pt")


def test_a_resume_on_another_world_size_continues_the_same_global_batch_or_says_what_to_change(k3_cache, tmp_path):
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    assert (
        launch(
            k3_cache, *SMOKE, "train.max_steps=4", "train.batch_size=4", f"hydra.run.dir={straight}", ranks=None
        ).returncode
        == 0
    )
    assert (
        launch(
            k3_cache,
            *SMOKE,
            "train.max_steps=4",
            "train.stop_after=2",
            "train.batch_size=2",
            f"hydra.run.dir={run_dir}",
        ).returncode
        == 0
    )
    proc = launch(
        k3_cache,
        *SMOKE,
        "train.max_steps=4",
        "train.batch_size=2",
        f"hydra.run.dir={run_dir}",
        "resume=auto",
        ranks=None,
    )  # 1 x 2 rows: not the checkpoint's 2 x 2
    assert proc.returncode == 2
    assert "global_batch_size was 4, now 2" in proc.stderr
    assert "x the data-parallel ranks, the processes / (parallel.pp x parallel.cp)" in proc.stderr
    proc = launch(
        k3_cache,
        *SMOKE,
        "train.max_steps=4",
        "train.batch_size=4",
        f"hydra.run.dir={run_dir}",
        "resume=auto",
        ranks=None,
    )  # 1 x 4 rows: the same global batch
    assert proc.returncode == 0, proc.stderr
    a, b = steps(straight), steps(run_dir)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


def test_a_refusal_every_rank_makes_is_said_once(k3_cache, tmp_path):
    """Under torchrun each rank refuses a bad setting alike: one line on the node, not one per rank (a rank's own
    message, another text, would still get through: tests/test_console.py)."""
    run = tmp_path / "run"
    proc = launch(k3_cache, *SMOKE, "parallel=fsdp", "parallel.pp=2", f"hydra.run.dir={run}", ranks=2)
    assert proc.returncode != 0
    assert proc.stderr.count("k3train: error: parallel=fsdp shards over processes") == 1, proc.stderr
    proc = launch(k3_cache, *SMOKE, "optim.lrr=1", f"hydra.run.dir={run}", ranks=2)
    assert proc.stderr.count("k3train: error: unknown key optim.lrr") == 1, proc.stderr
