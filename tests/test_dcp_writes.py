"""Writing sharded checkpoints when things go wrong: a full disk during a 2-rank save ends in the one OSError a
single-file save raises (the runner's one line, each rank's only line in a torchrun FSDP2 run), keeping the
previous checkpoint and no temporary directory; a temporary link a killed point_to left is removed once the run
directory's lock is held. The full-disk cases mount a real tmpfs (root only: skipped, saying why, where mounting is
not permitted)."""

import errno
import functools
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from k3train.checkpoint.checkpointer import ShardedCheckpointer, load_checkpoint
from k3train.checkpoint.dcp import point_to
from k3train.run import runner

from helpers.distributed_runs import SMOKE, launch, steps
from helpers.spawn import spawn_ranks

ROWS = 150_000  # 600 kB of float32 over the ranks: one checkpoint fits the 1 MiB tmpfs, two do not


class _Weights:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def state_dict(self) -> dict:
        return {"w": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.weight = state["w"]


def _save_twice(run_dir: str, rank: int, world_size: int) -> dict:
    """Two checkpoints of one FSDP-sharded tensor into run_dir: the second meets the full disk."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    weight = distribute_tensor(torch.arange(ROWS, dtype=torch.float32), mesh, [Shard(0)])
    checkpointer = ShardedCheckpointer(
        Path(run_dir), {}, keep_last_k=0, layouts={("dp_shard",): (mesh, [Shard(0)])}, writer=rank == 0
    )
    checkpointer.add("model", _Weights(weight))
    checkpointer.save(1)
    try:
        checkpointer.save(2)
    except OSError as exc:
        return {"errno": exc.errno, "strerror": exc.strerror, "filename": exc.filename}
    return {"errno": 0}


def test_a_full_disk_during_a_sharded_save_is_one_oserror_keeping_the_last_checkpoint(tmpfs, tmp_path):
    run_dir = tmpfs("1m") / "run"
    run_dir.mkdir()
    results = spawn_ranks(functools.partial(_save_twice, str(run_dir)), tmp_path)
    for result in results:  # every rank: DCP gathers the failing rank's error to all of them
        assert result["errno"] == errno.ENOSPC, result
        assert result["strerror"] == os.strerror(errno.ENOSPC)
        assert Path(result["filename"]).parent == run_dir / "dcp"
    assert results[0]["filename"] == results[1]["filename"]  # rank 0's name, which rank 1 never chose
    assert load_checkpoint(run_dir / "last.dcp")["meta"]["step"] == 1
    assert torch.equal(load_checkpoint(run_dir / "last.dcp")["model"]["w"], torch.arange(ROWS, dtype=torch.float32))
    assert [p.name for p in (run_dir / "dcp").iterdir()] == [os.readlink(run_dir / "last.dcp").split("/")[-1]]
    assert not list(run_dir.rglob(".*tmp*"))  # no temporary directory or link

    # The runner says it in the single-file path's one line (tests/fault_harness.py's DiskTrial checks that one)
    trainer = SimpleNamespace(
        run_dir=run_dir,
        state=SimpleNamespace(step=2),
        checkpointer=SimpleNamespace(path=run_dir / "last.dcp", saved_step=1),
    )
    failure = OSError(results[0]["errno"], results[0]["strerror"], results[0]["filename"])
    line = runner._write_failed(failure, trainer)
    assert line == (
        f"writing {results[0]['filename']} failed at step 2 (No space left on device); last.dcp of step 1 is kept; "
        "free disk space, then continue with resume=auto"
    )


@pytest.mark.slow
def test_a_full_disk_in_a_2_rank_fsdp_run_is_one_line_per_rank_and_resume_auto_goes_on(tmpfs, tmp_path, k3_cache):
    """torchrun, 2 FSDP2 ranks, a tmpfs that holds one checkpoint (a smoke one is about 440 kB) and not two: each
    rank's stderr is the runner's one line (torchrun's --redirects keeps them apart); with space again resume=auto
    goes on from the checkpoint kept."""
    mount = tmpfs("520k")  # one smoke checkpoint and the run's files fit; the next one meets a short write
    run_dir = mount / "run"
    args = [*SMOKE, "parallel=fsdp", "train.batch_size=2", "train.eval_interval=0", "train.max_steps=6"]
    logs = tmp_path / "logs"
    torchrun = ("--log-dir", str(logs), "--redirects", "3", "-m", "k3train")  # before the module, torchrun's own
    proc = launch(k3_cache, *args, f"hydra.run.dir={run_dir}", entry=torchrun)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = (
        re.escape(f"k3train: error: writing {run_dir}/dcp/")
        + r"step_0000004-[0-9a-f]{8}"
        + re.escape(
            " failed at step 4 (No space left on device); last.dcp of step 2 is kept; free disk space, then "
            "continue with resume=auto"
        )
    )
    for rank in (0, 1):
        (stderr,) = [path.read_text() for path in logs.glob(f"*/attempt_0/{rank}/stderr.log")]
        assert re.fullmatch(line, stderr.strip()), stderr
    assert load_checkpoint(run_dir / "last.dcp")["meta"]["step"] == 2
    assert len(list((run_dir / "dcp").iterdir())) == 1 and not list(run_dir.rglob(".*tmp*"))
    subprocess.run(["mount", "-o", "remount,size=256m", str(mount)], check=True)
    proc = launch(k3_cache, *args, f"hydra.run.dir={run_dir}", "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(steps(run_dir)) == list(range(1, 7))


def test_a_killed_point_to_leaves_a_temporary_link_that_is_removed(tmp_path):
    """A kill between point_to's symlink and its replace leaves `.<name>.tmp-<pid>`: removed, and nothing else."""
    from k3train.checkpoint.dcp import remove_stale_temp_links

    (tmp_path / "dcp" / "step_0000002-ab").mkdir(parents=True)
    point_to(tmp_path / "last.dcp", Path("dcp/step_0000002-ab"))
    stale = tmp_path / ".last.dcp.tmp-4242"
    os.symlink("dcp/step_0000002-ab", stale)
    dangling = tmp_path / ".step_0000004.dcp.tmp-4243"
    os.symlink("dcp/gone", dangling)
    users = [tmp_path / ".notes.tmp-draft", tmp_path / "latest"]  # links k3train never names so
    for link in users:
        os.symlink("dcp/step_0000002-ab", link)
    assert runner._remove_stale_temp_files(tmp_path) == [stale, dangling]
    assert not stale.is_symlink() and not dangling.is_symlink()
    assert all(link.is_symlink() for link in users) and (tmp_path / "last.dcp").is_symlink()
    assert remove_stale_temp_links(tmp_path) == []
