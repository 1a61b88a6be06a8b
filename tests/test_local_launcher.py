"""hydra/launcher=local (conf/hydra/launcher/local.yaml): a sweep's jobs run N at a time on this machine, each with
its share of the CPUs as torch threads, and leave no stray folder (submitit's `%j`, which its local executor never
expands)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from k3train.config import register_configs
from k3train.runtime import cpu

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the launcher presets need pip install '.[slurm]'")

REPO = Path(__file__).resolve().parents[1]


def hydra_config(*overrides: str):
    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True).hydra


def test_the_local_preset_runs_its_jobs_in_batches_of_its_job_count_and_other_sweeps_all_at_once():
    local = hydra_config("hydra/launcher=local")
    assert local.job.env_set[cpu.LOCAL_JOBS_VARIABLE] == "2" and local.sweeper.max_batch_size == 2
    assert local.launcher.cpus_per_task is None  # the share is the CPUs divided by the jobs, not a fixed count
    assert "%j" not in local.launcher.submitit_folder
    four = hydra_config("hydra/launcher=local", f"hydra.job.env_set.{cpu.LOCAL_JOBS_VARIABLE}=4")
    assert four.sweeper.max_batch_size == 4
    assert hydra_config().sweeper.max_batch_size is None
    assert hydra_config("hydra/launcher=slurm").sweeper.max_batch_size is None  # a SLURM array goes in whole


def test_auto_threads_divide_the_cpus_among_the_local_sweeps_jobs(no_thread_environment):
    monkeypatch = no_thread_environment
    for name in ("LOCAL_WORLD_SIZE", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu, "usable_cpus", lambda: (8, "8 CPUs in this process's affinity"))
    monkeypatch.setenv(cpu.LOCAL_JOBS_VARIABLE, "2")
    choice = cpu.choose_threads("auto", {"cpus_per_task": None})
    assert choice.threads == 4 and f"{cpu.LOCAL_JOBS_VARIABLE}=2" in choice.reason
    assert cpu.choose_threads("auto", {"cpus_per_task": 3}).threads == 3  # an explicit request still wins
    monkeypatch.setenv(cpu.LOCAL_JOBS_VARIABLE, "1")
    assert cpu.choose_threads("auto", {"cpus_per_task": None}).threads == 8


@pytest.mark.slow
def test_a_two_job_local_sweep_gives_each_job_half_the_cpus_and_leaves_no_percent_j_folder(k3_cache, tmp_path):
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache), "K3TRAIN_OUTPUTS": str(tmp_path / "outputs")}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # auto's share, not a count from this environment
        env.pop(name, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3train",
            "-m",
            "hydra/launcher=local",
            f"hydra.sweep.dir={sweep_dir}",
            "model=smoke_test_lm",
            "train.batch_size=2",
            "train.seq_len=32",
            "train.max_steps=2",
            "train.eval_batches=1",
            "train.progress=lines",
            "optim.lr=1e-3,3e-3",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cpus, _ = cpu.usable_cpus()
    for job in ("0", "1"):
        recorded = json.loads((sweep_dir / job / "run.json").read_text())["environment"]["cpu"]
        assert recorded["threads"] == max(1, cpus // 2), recorded
        assert f"{cpu.LOCAL_JOBS_VARIABLE}=2" in recorded["reason"], recorded
    assert not list(sweep_dir.rglob("%j")), sorted(p.name for p in (sweep_dir / ".submitit").iterdir())
    assert list((sweep_dir / ".submitit").glob("*_0_log.out"))  # the jobs' logs are still kept
