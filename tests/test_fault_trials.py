"""SIGKILL, SIGTERM and SIGUSR1 at seeded moments, and a full disk; resume=auto must end bitwise where an
uninterrupted run ends.

The trials live in fault_harness.py (benchmarks/fault_trials.py runs many more of them). Each is a few
subprocesses, so the selected trials run together, K3TRAIN_FAULT_JOBS (default 2) at a time, the first time a
test asks for a result; each test then reports its own trial."""

import os

import fault_harness as fh
import pytest

pytestmark = [pytest.mark.fault, pytest.mark.slow]

# 4 models (one guarded: rewinds and skips; one saving asynchronously) x checkpoint_interval 1 and 5 x 3 kinds of
# kill = 24 trials of one or two kills each, one seed: a second seed cost CI ~70 s for more moments of the same kinds;
# benchmarks/fault_trials.py runs 10 seeds (240 trials)
KILL_TRIALS = {t.name: t for t in fh.kill_trials(range(1))}
# and data=mixture killed once or twice after a seeded step: its sources' cursors must resume bitwise too
MIXTURE_TRIAL = fh.KillTrial("smoke_mixture", 1, "after_step", 0)
KILL_TRIALS[MIXTURE_TRIAL.name] = MIXTURE_TRIAL
SIGNAL_TRIALS = {t.name: t for t in fh.SIGNAL_TRIALS}
DISK_TRIALS = {t.name: t for t in fh.DISK_TRIALS}
TRIALS = {**KILL_TRIALS, **SIGNAL_TRIALS, **DISK_TRIALS}


@pytest.fixture(scope="session")
def trial_results(request, tmp_path_factory, k3_cache):
    selected = [
        TRIALS[item.callspec.params["trial"]]
        for item in request.session.items
        if item.module.__name__ == __name__ and hasattr(item, "callspec") and "trial" in item.callspec.params
    ]
    jobs = int(os.environ.get("K3TRAIN_FAULT_JOBS", "2"))
    return fh.run_trials(selected, tmp_path_factory.mktemp("fault"), k3_cache, jobs=jobs)


def _check(result: fh.TrialResult) -> None:
    assert not result.problems, "\n".join([result.name, *result.notes, *result.problems])
    assert result.bitwise and result.damaged == 0


@pytest.mark.parametrize("trial", KILL_TRIALS)
def test_sigkill_then_resume_auto_is_bitwise(trial, trial_results):
    result = trial_results[trial]
    _check(result)
    if KILL_TRIALS[trial].kind != "random":  # a random moment may fall after the end; the others always land
        assert result.kills_landed >= 1, result.notes


@pytest.mark.parametrize("trial", SIGNAL_TRIALS)
def test_stop_signal_then_resume_auto_is_bitwise(trial, trial_results):
    result = trial_results[trial]
    _check(result)
    assert result.kills_landed == 1 + SIGNAL_TRIALS[trial].second


# Found by these trials: torch.save meets ENOSPC, then its zip writer's clean-up raises a RuntimeError ("unexpected
# pos") chained on the OSError; files.write_atomic now reports the OSError underneath as one line.
@pytest.mark.parametrize("trial", DISK_TRIALS)
def test_full_disk_keeps_the_checkpoint_and_resume_auto_is_bitwise(trial, trial_results):
    result = trial_results[trial]
    if result.skipped:
        pytest.skip(result.skipped)
    _check(result)
    assert result.kills_landed == 1


def test_ctrl_c_during_start_up_ends_at_once_and_leaves_nothing(tmp_path, k3_cache):
    """Before the first update a Ctrl-C does not wait for one: the start ends by SIGINT with one line, and the run
    directory it had created (and .hydra/ in it) is gone again."""
    import signal

    run_dir, handshake = tmp_path / "run", tmp_path / "handshake"
    handshake.mkdir()
    args = [*fh.command("smoke_test_lm", 1), f"hydra.run.dir={run_dir}"]
    proc = fh.Proc(args, tmp_path / "logs" / "start", k3_cache, fault="pause_build:1", handshake=handshake)
    assert fh.wait_until(lambda: (handshake / "paused-build-1").exists(), proc), proc.stderr()
    assert (run_dir / ".hydra").is_dir()  # claimed and written: there is something to undo
    proc.popen.send_signal(signal.SIGINT)
    assert proc.wait() == -signal.SIGINT, proc.stderr()
    stderr = proc.stderr()
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "k3train: interrupted by Ctrl-C; checkpoints already written are kept"
    assert not run_dir.exists()


def test_a_kill_while_the_model_is_allocated_leaves_nothing_and_resume_auto_starts_cleanly(tmp_path, k3_cache):
    """SIGKILL half-way through drawing the model's weights (run/build.py's materialise): nothing but the config
    Hydra wrote is left (no checkpoint, metrics or temporary file), and resume=auto then trains from step 0 to the
    end, as a fresh run does."""
    import signal

    run_dir, handshake = tmp_path / "run", tmp_path / "handshake"
    handshake.mkdir()
    args = [*fh.command("k3_tiny", 4), f"hydra.run.dir={run_dir}"]
    proc = fh.Proc(args, tmp_path / "logs" / "killed", k3_cache, fault="pause_materialise:1", handshake=handshake)
    assert fh.wait_until(lambda: (handshake / "paused-materialise-1").exists(), proc), proc.stderr()
    proc.popen.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert [p.name for p in run_dir.iterdir() if not p.name.startswith(".")] == []  # .hydra/ and the lock file
    assert not fh.temp_files(run_dir)
    resumed = fh.run([f"hydra.run.dir={run_dir}", "resume=auto"], tmp_path / "logs" / "resumed", k3_cache)
    assert resumed.wait() == 0, resumed.stderr()
    assert sorted(fh.final_losses(run_dir)) == list(range(1, fh.MAX_STEPS + 1))
