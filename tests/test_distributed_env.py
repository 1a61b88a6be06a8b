"""Which process of which run this is, from a launcher's environment (k3train/runtime/distributed.py)."""

import functools
from pathlib import Path

import pytest

from k3train.runtime import distributed
from k3train.runtime.distributed import LaunchError, World, failure_line, world_from_env


def test_no_launcher_is_one_process():
    assert world_from_env({}) == World() and not World().distributed and World().is_main


def test_torchrun_variables():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
    }
    assert world_from_env(env) == World(rank=3, size=4, local_rank=1, local_size=2, master_addr="n1", master_port=29500)


def test_srun_tasks_take_the_first_node_and_a_port_from_the_job(monkeypatch):
    monkeypatch.setattr(distributed.subprocess, "run", _no_scontrol)
    env = {
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
    }
    world = world_from_env(env)
    assert (world.rank, world.size, world.local_rank, world.local_size) == (5, 8, 1, 4)
    assert world.master_addr == "gpu07" and world.master_port == 20000 + 1234


def test_an_sbatch_script_itself_is_one_process():
    assert world_from_env({"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_ID": "1"}) == World()


@pytest.mark.parametrize(
    "env,message",
    [
        ({"WORLD_SIZE": "2"}, "RANK is not"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_PORT is not"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_PORT": "1"}, "RANK=2 is not one of"),
    ],
)
def test_a_half_set_environment_says_what_is_missing(env, message):
    with pytest.raises(LaunchError, match=message):
        world_from_env(env)


def _no_scontrol(*args, **kwargs):
    raise FileNotFoundError("scontrol")


def test_a_failing_rank_names_itself_and_one_that_lost_its_peer_says_so():
    gloo = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:21731: Connection reset by peer. This is typically ...")
    assert failure_line(gloo, World(rank=0, size=2)).startswith("k3train: rank 0 of 2 lost contact with another rank")
    line = failure_line(ValueError("bad value\nmore"), World(rank=1, size=2))
    assert line == "k3train: rank 1 of 2 failed: ValueError: bad value"
    assert failure_line(ValueError("bad"), World()) is None  # one process: its error says it all


def _resume_decided_while_rank_zero_starts(run_dir: str, rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from k3train.run.resume import resolve_resume

    fresh, taken = Path(run_dir) / "fresh", Path(run_dir) / "taken"
    (taken / "metrics.jsonl").parent.mkdir(parents=True, exist_ok=True)
    (taken / "metrics.jsonl").touch()

    def check_then_start():  # rank 0 writes run.json as soon as it has decided (a run with no collective in between)
        path = resolve_resume(None, fresh)
        (fresh / "run.json").parent.mkdir(parents=True, exist_ok=True)
        (fresh / "run.json").write_text("{}")
        return path

    answer = distributed.rank_zero_decides(check_then_start)
    dist.barrier()
    try:
        resolve_resume(None, fresh)
        own = "fresh"
    except ValueError:
        own = "refused"
    try:
        distributed.rank_zero_decides(lambda: resolve_resume(None, taken))
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {"answer": str(answer), "own": own, "error": error}


def test_every_rank_takes_rank_zeros_decision_about_the_run_directory(tmp_path):
    """A rank that checked the run directory itself could find run.json that rank 0 had just written and refuse a
    fresh run rank 0 began (CI saw it on a 2-rank FSDP run): every rank takes rank 0's answer, its error included."""
    from helpers.spawn import spawn_ranks

    ranks = spawn_ranks(functools.partial(_resume_decided_while_rank_zero_starts, str(tmp_path / "runs")), tmp_path)
    for rank in ranks:
        assert rank["answer"] == "None"  # a fresh run on both ranks...
        assert rank["own"] == "refused"  # ...which each would have refused, checking after rank 0 began
        assert "already holds a run (metrics.jsonl)" in rank["error"]
    assert ranks[0]["error"] == ranks[1]["error"]


def test_one_process_decides_for_itself():
    assert distributed.rank_zero_decides(lambda: 7) == 7
    with pytest.raises(KeyError):
        distributed.rank_zero_decides(lambda: {}["x"])
