"""Data-parallel runs on CPU (gloo) through torchrun: 2 ranks train as 1 process does with the same global batch,
only rank 0 writes, a dead rank ends the job, and the job resumes exactly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SMOKE = [
    "model=smoke_test_lm",
    "train.seq_len=32",
    "train.log_interval=1",
    "train.eval_interval=3",
    "train.eval_batches=2",
    "train.checkpoint_interval=2",
    "train.progress=lines",
    "schedule.warmup_steps=0",
    "train.cpu_threads=1",
]


def launch(k3_cache, *args, ranks=2, entry=("-m", "k3train"), env=None, timeout=240):
    """torchrun --standalone (a free port per launch), or one plain process when ranks is None."""
    command = (
        [sys.executable, *entry]
        if ranks is None
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *entry]
    )
    env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([*command, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def steps(run_dir, event="train"):
    return {
        e["step"]: e["loss"] for e in read_metrics(run_dir / "metrics.jsonl", final_only=True) if e["event"] == event
    }


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


# k3_tiny shrunk: Muon + AdamW, the Quantile-Balanced MoE (its bias from the global batch) and QK-Clip at a threshold
# under the initial max logits, so the clipping decision must be the same on both ranks. Newton-Schulz in fp32: in
# bf16 its rounding turns the last-bit differences of a sum over 2 ranks into weight differences up to 4e-4 after 4
# steps (measured; 4e-6 in fp32), which would hide a real mismatch.
K3 = [
    "model=k3_tiny",
    "optim.ns_dtype=fp32",
    "model.d_model=64",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.kda_chunk_size=16",
    "callbacks.qk_clip.tau=0.05",
    "train.seq_len=32",
    "train.log_interval=1",
    "train.eval_interval=2",
    "train.eval_batches=2",
    "train.progress=lines",
    "schedule.warmup_steps=0",
    "train.cpu_threads=1",
]


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
            assert b[step] == pytest.approx(a[step], rel=1e-5), (event, step)
    clipped = [e["qk_clip"]["n_clipped"] for e in read_metrics(two / "metrics.jsonl") if e["event"] == "train"]
    assert sum(clipped) > 0, "tau=0.05 must clip, or this case does not test QK-Clip across ranks"
    a, b = load_checkpoint(one / "last.pt"), load_checkpoint(two / "last.pt")
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=1e-5)


def test_a_dead_rank_ends_the_job_and_resume_continues_exactly(k3_cache, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    args = [*SMOKE, "train.max_steps=8", "train.batch_size=2"]
    assert launch(k3_cache, *args, f"hydra.run.dir={straight}").returncode == 0
    kill_a_rank_then_resume(k3_cache, args, straight, killed, "last.pt")


def kill_a_rank_then_resume(k3_cache, args, straight, killed, last):
    """In `killed`, SIGKILL rank 1 after step 5: the job ends, leaving a complete checkpoint `last`; resume=auto
    then takes the steps of the uninterrupted run in `straight` and ends with its weights, bit for bit."""
    fault = {"K3TRAIN_FAULT": "die_step:5", "K3TRAIN_FAULT_RANK": "1"}
    proc = launch(
        k3_cache, *args, f"hydra.run.dir={killed}", entry=("tests/fault_entry.py",), env=fault, timeout=180
    )  # a hang would fail here, not block CI
    assert proc.returncode != 0
    # CI once found no checkpoint at all here (the job ended before its first one): say what the job printed
    assert (killed / last).exists(), f"no {last} after the killed run; its stderr ends:\n{proc.stderr[-3000:]}"
    assert load_checkpoint(killed / last)["trainer"]["step"] in (2, 4)  # a complete checkpoint, never torn
    proc = launch(k3_cache, *args, f"hydra.run.dir={killed}", "resume=auto")
    assert proc.returncode == 0, proc.stderr
    assert steps(killed) == steps(straight) and steps(killed, "eval") == steps(straight, "eval")
    a, b = load_checkpoint(straight / last), load_checkpoint(killed / last)
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name


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
    assert "global_batch_size was 4, now 2" in proc.stderr and "x the number of processes" in proc.stderr
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
