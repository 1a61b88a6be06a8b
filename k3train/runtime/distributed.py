"""Processes of one run: who they are (World), the process group, and the few collectives the loop needs.

A run is one process unless a launcher says otherwise:
- torchrun (torch.distributed.run) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
- srun with several tasks sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE... and the
  rendezvous address is the first host of the step's node list (MASTER_ADDR/MASTER_PORT win when set).
`python -m k3train` starts the process group (gloo for CPU tensors, NCCL for CUDA ones) before Hydra composes the
config, so that every rank resolves the same run directory: rank 0's start time is broadcast and the
`${run_start:FORMAT}` resolver formats it (conf/config.yaml's hydra.run.dir uses it instead of `${now:...}`).
Only rank 0 writes the run directory; the other ranks run with hydra.output_subdir=null.

A rank torchrun started ends when torchrun dies (killed, say): without a parent that would end the job it would
train on alone to the end, holding the run directory's lock. The kernel sends it SIGTERM (prctl's parent-death
signal, `end_with_launcher`), which stops it at the next update with a checkpoint like any preemption.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


class LaunchError(ValueError):
    """An environment that describes several processes incompletely (a launcher's variables set by hand, say)."""


def world_from_env(env: Mapping[str, str] = os.environ) -> World:
    """The World a launcher described in the environment (a single process when none did)."""
    if int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" not in env:
        raise LaunchError(
            f"WORLD_SIZE={env['WORLD_SIZE']} is set but RANK is not: start the processes with torchrun "
            "(which sets both), or unset WORLD_SIZE to run one process"
        )
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or a launcher that sets the same variables
        world = World(
            rank=int(env["RANK"]),
            size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int_or_none(env.get("MASTER_PORT")),
        )
        if not 0 <= world.rank < world.size:
            raise LaunchError(f"RANK={world.rank} is not one of the WORLD_SIZE={world.size} ranks 0..{world.size - 1}")
        if world.distributed and world.master_port is None:
            raise LaunchError(
                f"RANK={world.rank} and WORLD_SIZE={world.size} are set but MASTER_PORT is not: start the "
                "processes with torchrun (which sets it), or set MASTER_ADDR and MASTER_PORT"
            )
        return world
    if (
        int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1"))) > 1
        and "SLURM_PROCID" in env
        and "SLURM_STEP_ID" in env
    ):  # tasks of one srun step (an sbatch script's own shell is not one)
        size = int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS")))
        local_size = int(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or size)
        job = int(env.get("SLURM_JOB_ID", "0"))
        return World(
            rank=int(env["SLURM_PROCID"]),
            size=size,
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_size=local_size,
            master_addr=env.get("MASTER_ADDR")
            or _first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")),
            master_port=_int_or_none(env.get("MASTER_PORT")) or 20000 + job % 20000,
        )
    return World()


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (`node[01-04]` style), as `scontrol show hostnames` expands it."""
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        return out[0]
    except (OSError, subprocess.SubprocessError, IndexError):  # no scontrol here: expand the first entry by hand
        first = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist)
        return first.group(1) + (first.group(2) or "")


_WORLD = World()
_START_TIME = time.time()
_PARENT_PID = os.getppid()  # read at import, early: a parent that dies later shows as a different getppid()
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """Under torchrun on Linux: have the kernel send this rank SIGTERM when torchrun dies; whether it will.

    The parent-death signal fires when the thread that started the process ends, not the process: torchrun starts
    its workers from its main thread, which ends only with it. A torchrun that died before prctl ran is not
    signalled, so getppid() is checked once after it (the rank was then handed to init or a subreaper)."""
    if "TORCHELASTIC_RUN_ID" not in env or not sys.platform.startswith("linux"):
        return False  # srun, a hand-set environment: their launcher ends the tasks itself
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no C library to call here: the rank runs on as it always did
        return False
    # Not `_PARENT_PID == 1`: torchrun itself is pid 1 where it is a container's entry point.
    if os.getppid() != _PARENT_PID:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def init_from_env(env: Mapping[str, str] = os.environ) -> World:
    """Start the process group the launcher described, and agree on rank 0's start time. Idempotent."""
    global _WORLD, _START_TIME
    world = world_from_env(env)
    if world.distributed and not dist.is_initialized():
        end_with_launcher(env)  # before the rendezvous, which waits for ranks a dead torchrun will never start
        os.environ.setdefault("MASTER_ADDR", world.master_addr or "127.0.0.1")
        if world.master_port is not None:
            os.environ.setdefault("MASTER_PORT", str(world.master_port))
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=world.rank,
            world_size=world.size,
            timeout=datetime.timedelta(minutes=int(os.environ.get("K3TRAIN_DIST_TIMEOUT_MIN", "30"))),
        )
        start = [_START_TIME]
        dist.broadcast_object_list(start, src=0)
        _START_TIME = start[0]
    _WORLD = world
    return world


def current_world() -> World:
    return _WORLD


def run_start(fmt: str) -> str:
    """The `${run_start:FORMAT}` resolver: the run's start time (rank 0's), strftime-formatted."""
    return time.strftime(fmt, time.localtime(_START_TIME))


def several_ranks() -> bool:
    """Whether this process is one of several in a process group (collectives would do something)."""
    return dist.is_initialized() and dist.get_world_size() > 1


def mean_across_ranks(value: float, device: torch.device, group: dist.ProcessGroup | None) -> float:
    """The mean of a per-rank figure over the ranks of `group` (the figure itself when group is None)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def any_across_ranks(flag: bool, device: torch.device, group: dist.ProcessGroup | None) -> bool:
    """Whether any rank of `group` has its flag set (the flag itself when group is None)."""
    if group is None:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


T = TypeVar("T")


def rank_zero_decides(decide: Callable[[], T]) -> T:
    """decide() on rank 0; its result, or the exception it raised, on every rank.

    For decisions read from files that rank 0 is about to write: a rank that looked at the run directory itself could
    find run.json already there (rank 0, with no collective in between, may have started the run) and refuse a fresh
    run that rank 0 accepted. The exception is pickled to the other ranks, so it must be one that pickles (ValueError
    and CheckpointError do)."""
    if not several_ranks():
        return decide()
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = (True, decide())
        except Exception as exc:
            outcome[0] = (False, exc)
            dist.broadcast_object_list(outcome, src=0)
            raise
    dist.broadcast_object_list(outcome, src=0)
    succeeded, value = outcome[0]
    if succeeded:
        return value
    raise value


def close(wait_for_others: bool) -> None:
    """End the process group. After a clean run every rank waits for the others first (rank 0 may still be writing
    its final checkpoint): tearing gloo down while a peer is still connected can abort the process at exit."""
    if not dist.is_initialized():
        return
    if wait_for_others:
        dist.barrier()
    dist.destroy_process_group()


# What gloo and NCCL say when the peer of a collective is gone (killed, or failed and exited).
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def lost_peer(exc: BaseException) -> bool:
    """Whether exc is gloo's or NCCL's word that the peer of a collective is gone."""
    return any(marker in str(exc) for marker in _LOST_PEER)


def failure_line(exc: BaseException, world: World) -> str | None:
    """The line a failing rank prints about itself (None in one process, where the error says it all): its rank, and
    whether it only lost a peer that ended first (the launcher's summary names that one)."""
    if not world.distributed:
        return None
    first = (str(exc).strip().splitlines() or [""])[0]
    who = f"k3train: rank {world.rank} of {world.size}"
    if lost_peer(exc):
        return (
            f"{who} lost contact with another rank in a collective ({type(exc).__name__}): that rank ended "
            "first; its own error, or the launcher's summary (torchrun's Root Cause, srun's task N), names it"
        )
    return f"{who} failed: {type(exc).__name__}: {first}"


def chunk_sizes(size: int, parts: int) -> list[int]:
    """How torch.chunk (and DTensor's Shard) splits `size` rows over `parts` ranks: ceil(size / parts) each, in rank
    order, the last ranks fewer or none."""
    step = -(-size // parts)
    return [max(0, min(step, size - r * step)) for r in range(parts)]
