"""Which process of which run this is, from a launcher's environment (k3train/runtime/distributed.py)."""

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
