"""Run a function on 2 (or n) gloo ranks in spawned processes and collect what each saved (test_muon_distributed.py,
test_expert_parallel.py)."""

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import nan_guard

SPAWN_TIMEOUT_S = 120  # a hung collective fails the test instead of the suite


def spawn_ranks(rank_main, tmp_path: Path, nprocs: int = 2) -> list[dict]:
    """rank_main(rank, world_size) -> dict on `nprocs` gloo ranks (one thread each, as a 1-process reference runs)
    in spawned processes; returns each rank's dict."""
    args = (nprocs, str(tmp_path / "init"), str(tmp_path), rank_main)
    ctx = mp.spawn(_in_a_gloo_group, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{nprocs} ranks did not finish in {SPAWN_TIMEOUT_S} s (a hung collective?)")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(nprocs)]


def _in_a_gloo_group(rank: int, world_size: int, init_file: str, out_dir: str, rank_main) -> None:
    nan_guard.install()  # a spawned rank does not import conftest, which installs it in the test process
    torch.set_num_threads(1)  # the same matmul kernels as the 1-process reference, so the same bits
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        torch.save(rank_main(rank, world_size), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    leave_without_finalizing()


def leave_without_finalizing() -> None:
    """End a rank whose work is saved without Python's finalization: a gloo worker thread still releasing a
    finished collective's tensors needs the GIL, and meeting the interpreter's shutdown there aborts the process
    ("terminate called without an active exception"; pytorch/pytorch#190489), about 1 run in 15 here."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
