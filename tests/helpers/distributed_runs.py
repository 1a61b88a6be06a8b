"""`python -m k3train` in subprocesses: under torchrun (a gloo group on CPU) or as one process, the losses a run
logged, and a job with a killed rank resumed (test_distributed.py, test_fsdp.py)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
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


def steps(run_dir, event="train", key="loss"):
    """{step: the event's `key`} for the steps whose event has it."""
    return {
        e["step"]: e[key]
        for e in read_metrics(run_dir / "metrics.jsonl", final_only=True)
        if e["event"] == event and key in e
    }


# k3_tiny shrunk: Muon + AdamW, the Quantile-Balanced MoE (its bias from the global batch) and QK-Clip at a threshold
# under the initial max logits, so the clipping decision must be the same on both ranks. In fp64 (weights, optimizer
# state, loss and Newton-Schulz), so that "N ranks equal one process" judges the math, not a CPU's rounding: in fp32
# AdamW's normalised update of a nearly cancelling gradient sum turns the last-bit difference of a sum over ranks into
# up to 4.5e-4 on the embedding after a few updates, and how much differs between CPUs (AMD EPYC against Intel Xeon);
# in fp64 every layout ends within 4e-13 of one process (measured: fsdp x ep 2, pp 2 x fsdp, cp 2 x ep 2, hsdp 2x2),
# while a deliberate change of 1e-6 to one constant stands out by orders of magnitude.
K3 = [
    "model=k3_tiny",
    "precision=fp64",
    "optim.ns_dtype=fp64",
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
# How close a K3 run on N ranks ends to one process: losses (relative) and weights (absolute), in fp64.
FP64_BOUND = 1e-10


def kill_a_rank_then_resume(k3_cache, args, straight, killed, last, ranks=2):
    """In `killed`, SIGKILL rank 1 after step 5: the job ends, leaving a complete checkpoint `last`; resume=auto
    then takes the steps of the uninterrupted run in `straight` and ends with its weights, bit for bit."""
    fault = {"K3TRAIN_FAULT": "die_step:5", "K3TRAIN_FAULT_RANK": "1"}
    proc = launch(
        k3_cache, *args, f"hydra.run.dir={killed}", entry=("tests/fault_entry.py",), env=fault, timeout=180, ranks=ranks
    )  # a hang would fail here, not block CI
    assert proc.returncode != 0
    # CI once found no checkpoint at all here (the job ended before its first one): say what the job printed
    assert (killed / last).exists(), f"no {last} after the killed run; its stderr ends:\n{proc.stderr[-3000:]}"
    assert load_checkpoint(killed / last)["trainer"]["step"] in (2, 4)  # a complete checkpoint, never torn
    proc = launch(k3_cache, *args, f"hydra.run.dir={killed}", "resume=auto", ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    assert steps(killed) == steps(straight) and steps(killed, "eval") == steps(straight, "eval")
    a, b = load_checkpoint(straight / last), load_checkpoint(killed / last)
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name
