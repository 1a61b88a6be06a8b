"""What k3train/runtime/slurm.py decides from a SLURM job's environment, without a cluster: the run directory's name,
resuming a requeued job, and what a job does after a signal stopped its run (`scontrol` is a stand-in script that
answers like SLURM's and records the calls)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from k3train.runtime import slurm
from k3train.runtime.signals import StopSignals

JOB = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]"}
ARRAY_TASK = {"SLURM_JOB_ID": "45", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "2"}


@pytest.fixture
def job_env(monkeypatch):
    for name in (
        "SLURM_JOB_ID",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_RESTART_COUNT",
        "SLURM_JOB_NODELIST",
        "SUBMITIT_FOLDER",
        "SUBMITIT_PREEMPT_SIGNAL",
    ):
        monkeypatch.delenv(name, raising=False)

    def set_env(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_env


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """A `scontrol` on PATH: `show job` prints the given fields, `requeue` is recorded in calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    calls = tmp_path / "calls.log"

    def install(fields: str) -> None:
        script.write_text(
            f'#!/bin/sh\necho "$@" >> {calls}\n'
            f"[ \"$1\" = show ] && echo 'JobId=42 JobName=k3train {fields} Partition=debug'\nexit 0\n"
        )
        script.chmod(0o755)

    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    install.calls = lambda: calls.read_text().splitlines() if calls.exists() else []
    return install


def test_current_job_and_run_name(job_env):
    assert slurm.current_job() is None
    assert slurm.run_name("%Y") == time.strftime("%Y")  # outside SLURM: the start time
    job_env(**ARRAY_TASK)
    job = slurm.current_job()
    assert (job.name, job.restart_count, job.submitit) == ("40_3", 2, False)
    assert slurm.run_name("%Y") == "slurm-40_3"  # the array task's own directory, the same after a requeue


def test_only_a_requeued_job_resumes_by_itself(job_env):
    assert slurm.resume_setting(None) is None
    job_env(**JOB)
    assert slurm.resume_setting(None) is None  # a first start never resumes someone else's run
    job_env(SLURM_RESTART_COUNT="1")
    assert slurm.resume_setting(None) == "auto"
    assert slurm.resume_setting("/some/last.pt") == "/some/last.pt"  # what the user said wins


def test_sbatch_job_requeues_itself_after_its_time_limit_warning(job_env, fake_scontrol):
    job_env(**JOB)
    fake_scontrol("JobState=RUNNING Requeue=1 EndTime=2099-01-01T00:00:00")
    message = slurm.requeue(slurm.current_job(), signal.SIGUSR1)
    assert fake_scontrol.calls()[-1] == "requeue 42" and "requeued job 42" in message


def test_sbatch_job_requeues_itself_at_its_time_limit_but_not_when_cancelled(job_env, fake_scontrol):
    """SLURM shows JobState=COMPLETING and an EndTime of now both for scancel and at the time limit (measured):
    only the run time tells them apart."""
    job_env(**JOB)
    for run_time in ("00:00:59", "59:59"):  # scancel or scontrol requeue within the hour: no requeue by k3train
        fake_scontrol(f"JobState=COMPLETING Requeue=1 RunTime={run_time} TimeLimit=01:00:00")
        assert "not requeued" in slurm.requeue(slurm.current_job(), signal.SIGTERM)
        assert not any(c.startswith("requeue") for c in fake_scontrol.calls())
    fake_scontrol("JobState=COMPLETING Requeue=1 RunTime=00:00:10 TimeLimit=UNLIMITED")
    assert "not requeued" in slurm.requeue(slurm.current_job(), signal.SIGTERM)
    for run_time, limit in (("00:01:21", "00:01:00"), ("1-00:00:05", "1-00:00:00")):  # the time limit
        fake_scontrol(f"JobState=COMPLETING Requeue=1 RunTime={run_time} TimeLimit={limit}")
        assert "requeued job 42" in slurm.requeue(slurm.current_job(), signal.SIGTERM)
        assert fake_scontrol.calls()[-1] == "requeue 42"


def test_sbatch_job_without_requeue_permission_is_not_requeued(job_env, fake_scontrol):
    job_env(**JOB)
    fake_scontrol("JobState=RUNNING Requeue=0 EndTime=2099-01-01T00:00:00")
    assert "does not allow requeue" in slurm.requeue(slurm.current_job(), signal.SIGUSR1)
    assert not any(c.startswith("requeue") for c in fake_scontrol.calls())


def test_submitit_job_stopped_by_sigterm_ends_without_a_result(job_env):
    """submitit only logs SIGTERM: returning would hand the launcher a 'success' for a half-done run."""
    job_env(**JOB, SUBMITIT_FOLDER="/tmp/x")
    stop = StopSignals()
    stop.received, stop.received_all = signal.SIGTERM, [signal.SIGTERM]
    with pytest.raises(SystemExit) as exit_info:
        slurm.end_after_signal(stop)
    assert exit_info.value.code == -1


def test_submitit_job_hands_its_preemption_signal_to_submitit(job_env):
    """SIGTERM then SIGUSR2 (a preemption as submitit simulates it): the stop is SIGTERM's, and submitit's own
    handler of SIGUSR2 (requeue, exit) still gets its signal."""
    job_env(**JOB, SUBMITIT_FOLDER="/tmp/x")
    handled = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: handled.append(signum))
    try:
        with StopSignals() as stop:
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGUSR2)
        assert stop.received == signal.SIGTERM and stop.received_all == [signal.SIGTERM, signal.SIGUSR2]
        with pytest.raises(SystemExit):
            slurm.end_after_signal(stop)
        assert handled == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_finished_run_ignores_a_late_warning_only_in_a_slurm_job(job_env):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        slurm.ignore_late_warnings()
        assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]
        job_env(**JOB)
        slurm.ignore_late_warnings()
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN == signal.getsignal(signal.SIGUSR2)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("launcher", ["slurm", "local", "gpu_node", "cpu_node"])
def test_launcher_presets_and_profiles_requeue_and_leave_time_to_checkpoint(launcher):
    """conf/hydra/launcher/ and launchers/profiles/: submitit's own defaults never requeue after a timeout
    (max_num_timeout 0) and count every warning of a job of 10 minutes or less as a timeout."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the presets need pip install '.[slurm]'")
    from helpers.config import composed

    profiles = Path(__file__).resolve().parents[1] / "launchers" / "profiles"
    cfg = composed(f"hydra.searchpath=[file://{profiles}]", f"hydra/launcher={launcher}", return_hydra_config=True)
    settings = cfg.hydra.launcher
    assert settings.timeout_min > 10
    if launcher != "local":
        assert settings._target_.endswith("SlurmLauncher")
        assert settings.max_num_timeout > 0 and settings.signal_delay_s >= 60
        assert settings.additional_parameters.requeue is True
        for key in ("partition", "account", "qos", "gpus_per_node", "cpus_per_task", "mem_gb"):
            assert key in settings
    else:
        assert settings._target_.endswith("LocalLauncher")


def test_a_warning_during_start_up_stops_the_run_after_its_first_update(k3_cache, tmp_path):
    """SLURM may send the time-limit warning up to a minute early: while `python -m k3train` is still starting, it
    must not kill the process (a job that dies of it is FAILED, not requeued) but stop the run with a checkpoint."""
    import subprocess
    import sys

    from k3train.observe.metrics import read_metrics

    pytest.importorskip("torch")
    code = (
        "import os, signal, sys; sys.argv = ['k3train'] + sys.argv[1:]\n"
        "import k3train.__main__ as entry\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"  # after the imports, before Hydra, the data and the model
        "entry.main()\n"
    )
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            f"hydra.run.dir={run_dir}",
            "model=smoke_test_lm",
            "train.batch_size=2",
            "train.seq_len=32",
            "train.max_steps=5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "K3TRAIN_CACHE": str(k3_cache)},
    )
    assert proc.returncode == -signal.SIGUSR1, proc.stderr  # then it ends by the signal, as the sender expects
    end = [e for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] == "end"]
    assert [(e["reason"], e["step"]) for e in end] == [("signal:SIGUSR1", 1)]
    assert (run_dir / "last.pt").exists()
