"""Asynchronous sharded checkpoints under faults (tests/fault_sharded.py): FSDP2 on 2 gloo ranks, a SIGKILL of a
rank, of torchrun or of a rank's checkpoint writer process while a checkpoint is being written, and a disk that
fills during a background write; resume=auto must end bitwise where the uninterrupted run does, leaving nothing
behind. CI runs the 6 kills that always land during a write (3 targets x checkpoint_interval 1 and 3, seed 0);
benchmarks/fault_trials.py --sharded-seeds runs 12 a seed, at random moments too."""

import os

import fault_harness as fh
import fault_sharded as fs
import pytest

pytestmark = [pytest.mark.fault, pytest.mark.slow]

TRIALS = {t.name: t for t in fs.kill_trials(range(1)) if t.moment == "writing"}
TRIALS[fs.ShardedDiskTrial().name] = fs.ShardedDiskTrial()


@pytest.fixture(scope="module")
def trial_results(tmp_path_factory, k3_cache):
    jobs = int(os.environ.get("K3TRAIN_FAULT_JOBS", "2"))
    return fh.run_trials(list(TRIALS.values()), tmp_path_factory.mktemp("fault_sharded"), k3_cache, jobs=jobs)


@pytest.mark.parametrize("trial", TRIALS)
def test_a_fault_during_an_asynchronous_sharded_write_then_resume_auto_is_bitwise(trial, trial_results):
    result = trial_results[trial]
    if result.skipped:
        pytest.skip(result.skipped)
    assert not result.problems, "\n".join([result.name, *result.notes, *result.problems])
    assert result.bitwise and result.damaged == 0
    assert result.kills_landed == result.kills_tried  # during a write, each kill (or the full disk) lands
