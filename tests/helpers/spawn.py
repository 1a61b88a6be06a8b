"""Run a function on 2 (or n) gloo ranks in spawned processes and collect what each saved (test_muon_distributed.py,
test_expert_parallel.py)."""

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

SPAWN_TIMEOUT_S = 120  # a hung collective fails the test instead of the suite


def spawn_ranks(rank_main, tmp_path: Path, nprocs: int = 2) -> list[dict]:
    """mp.spawn rank_main(rank, nprocs, init_file, out_dir) and load each rank's out_dir/rank{r}.pt."""
    ctx = mp.spawn(rank_main, args=(nprocs, str(tmp_path / "init"), str(tmp_path)), nprocs=nprocs, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{nprocs} ranks did not finish in {SPAWN_TIMEOUT_S} s (a hung collective?)")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(nprocs)]
