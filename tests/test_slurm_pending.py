"""A SLURM sweep whose jobs cannot start says why (k3train/run/slurm_pending.py): the message for each pending
reason and request, without a cluster; and on a real SLURM (launchers/local_slurm/start.sh), a sweep asking for more
CPUs a job than the node has is refused before submitting, naming hydra.launcher.cpus_per_task, and a sweep held
back says why it waits."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from k3train.run.slurm_pending import PendingWatch, _minutes, pending_message

REPO = Path(__file__).resolve().parents[1]
REQUEST = {"cpus_per_task": 8, "tasks_per_node": 1, "mem_gb": 16, "gpus_per_node": 2, "nodes": 1, "timeout_min": 240}
NODE = {
    "partition": "debug",
    "state": "UP",
    "cpus": 16,
    "mem_mb": 64 * 1024,
    "gpus": 4,
    "nodes": 2,
    "max_time_min": 600,
}


@pytest.mark.parametrize(
    ("field", "request_change", "limit_change"),
    [
        ("cpus_per_task", {"cpus_per_task": 8}, {"cpus": 2}),
        ("cpus_per_task", {"cpus_per_task": 4, "tasks_per_node": 8}, {}),  # 32 CPUs a node
        ("mem_gb", {"mem_gb": 128}, {}),
        ("gpus_per_node", {"gpus_per_node": 8}, {}),
        ("nodes", {"nodes": 4}, {}),
        ("timeout_min", {"timeout_min": 1440}, {}),
        ("partition", {}, {"exists": False}),
        ("partition", {}, {"state": "DOWN"}),
    ],
)
def test_a_request_over_the_partitions_limit_names_that_field(field, request_change, limit_change):
    line = pending_message("12_[0-1]", "PartitionConfig", {**REQUEST, **request_change}, {**NODE, **limit_change})
    assert line.startswith("k3train: SLURM job 12_[0-1] pending: PartitionConfig (")
    assert f"Change hydra.launcher.{field}, then `scancel 12`" in line
    assert line.count("hydra.launcher.") == 1 and "\n" not in line


def test_the_message_for_the_cpus_case_gives_both_numbers():
    line = pending_message("7", "PartitionConfig", {**REQUEST, "cpus_per_task": 8}, {**NODE, "cpus": 2})
    assert "cpus_per_task 8 > the 2 CPUs of the largest node of debug" in line


def test_without_the_limits_a_blocking_reason_names_the_candidates():
    line = pending_message("12_[0-1]", "PartitionConfig", REQUEST, {})
    for field in ("cpus_per_task", "mem_gb", "gpus_per_node", "timeout_min", "partition"):
        assert f"hydra.launcher.{field}" in line
    line = pending_message("12", "ReqNodeNotAvail, UnavailableNodes:node[1-2]", REQUEST, {"partition": "gpu"})
    assert "pending: ReqNodeNotAvail, UnavailableNodes:node[1-2] (no node" in line and "cpus_per_task" in line
    line = pending_message("12", "PartitionTimeLimit", REQUEST, {})
    assert "Check hydra.launcher.timeout_min against" in line and "cpus_per_task" not in line


@pytest.mark.parametrize("reason", ["Priority", "Resources", "BeginTime", "Dependency", "None", "JobArrayTaskLimit"])
def test_transient_reasons_say_waiting_without_advice(reason):
    line = pending_message("12_[0-1]", reason, REQUEST, NODE)
    assert line.startswith(f"k3train: SLURM job 12_[0-1] waiting: {reason} (") and "hydra.launcher" not in line


def test_resources_beyond_any_node_is_not_transient():
    line = pending_message("12", "Resources", {**REQUEST, "gpus_per_node": 8}, NODE)
    assert (
        "pending: Resources (it asks for more than any node" in line and "Change hydra.launcher.gpus_per_node" in line
    )


def test_an_unknown_reason_is_reported_as_waiting():
    line = pending_message("12", "QOSGrpCpuLimit", REQUEST, NODE)
    assert line.startswith("k3train: SLURM job 12 waiting: QOSGrpCpuLimit (") and "hydra.launcher" not in line


def test_slurm_time_limits_read_as_minutes():
    assert [_minutes(t) for t in ("UNLIMITED", "1-00:00:00", "04:00:00", "2-12:30:00", "30", "")] == [
        None,
        1440,
        240,
        3630,
        30,
        None,
    ]


def test_the_module_imports_without_the_slurm_extra_and_the_callback_pickles_without_its_thread_state():
    code = (
        "import sys\n"
        "sys.modules['submitit'] = sys.modules['hydra_plugins.hydra_submitit_launcher'] = None\n"
        "import k3train.run.slurm_pending as m\n"
        "assert 'submitit' not in [k for k, v in sys.modules.items() if v is not None]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    watch = PendingWatch(warning_s=5, poll_s=1)
    watch._undo = lambda: None  # what on_multirun_start leaves while the sweep runs
    copy = pickle.loads(pickle.dumps(watch))
    assert (copy.warning_s, copy.poll_s, copy._undo) == (5.0, 1.0, None)


def test_the_slurm_preset_keeps_submitits_schema_and_adds_the_watch():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the preset needs pip install '.[slurm]'")
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from k3train.config import register_configs

    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        hydra = compose("config", ["hydra/launcher=slurm"], return_hydra_config=True).hydra
        with pytest.raises(ConfigCompositionException, match="gress"):  # submitit's schema still checks the keys
            compose("config", ["hydra/launcher=slurm", "hydra.launcher.gress=gpu:1"], return_hydra_config=True)
    assert OmegaConf.get_type(hydra.launcher).__name__ == "SlurmQueueConf"
    assert (hydra.launcher.cpus_per_task, hydra.launcher.max_num_timeout) == (8, 20)
    assert hydra.callbacks.slurm_pending._target_ == "k3train.run.slurm_pending.PendingWatch"
    assert hydra.callbacks.slurm_pending.warning_s == 60


def _slurm_answers() -> bool:
    if shutil.which("scontrol") is None:
        return False
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20).returncode == 0
    except subprocess.SubprocessError:
        return False


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.skipif(
    not _slurm_answers(),
    reason="no SLURM controller answers `scontrol ping`: start one with `launchers/local_slurm/start.sh` "
    "(CI's .ci/run does)",
)
def test_a_sweep_asking_for_more_cpus_than_a_node_has_is_refused_before_submitting(tmp_path):
    """cpus_per_task above the node's CPUs could never start (it would pend as PartitionConfig): one line naming
    hydra.launcher.cpus_per_task and the node's CPUs, exit status 2, and no job in the queue."""
    pytest.importorskip("submitit", reason="the slurm preset needs pip install '.[slurm]'")
    node_cpus = max(int(c) for c in subprocess.check_output(["sinfo", "-h", "-N", "-o", "%c"], text=True).split())
    name = f"k3train-refused-{os.getpid()}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3train",
            "-m",
            "hydra/launcher=slurm",
            f"hydra.launcher.cpus_per_task={max(8, node_cpus + 1)}",
            f"hydra.launcher.name={name}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "model=smoke_test_lm",
            "optim.lr=1e-3,3e-3",
        ],
        cwd=REPO,
        env={**os.environ, "K3TRAIN_OUTPUTS": str(tmp_path / "outputs")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    queued = subprocess.run(["squeue", "-h", f"--name={name}"], capture_output=True, text=True, timeout=30).stdout
    subprocess.run(["scancel", f"--name={name}"], timeout=30)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3train: error: this SLURM sweep could never start: "), proc.stderr
    assert f"the {node_cpus} CPUs of the largest node" in lines[0] and "hydra.launcher.cpus_per_task" in lines[0]
    assert "nothing was submitted" in lines[0] and queued.strip() == ""


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.skipif(
    not _slurm_answers(),
    reason="no SLURM controller answers `scontrol ping`: start one with `launchers/local_slurm/start.sh` "
    "(CI's .ci/run does)",
)
def test_a_sweep_that_waits_says_why(tmp_path):
    """A job array held back (sbatch --begin in ten minutes) stays PENDING (BeginTime); past warning_s the watch
    prints one line for the array saying why, and nothing more for it."""
    pytest.importorskip("submitit", reason="the slurm preset needs pip install '.[slurm]'")
    name = f"k3train-pending-{os.getpid()}"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "k3train",
            "-m",
            "hydra/launcher=slurm",
            "hydra.launcher.cpus_per_task=1",
            "+hydra.launcher.additional_parameters.begin=now+600",
            f"hydra.launcher.name={name}",
            "hydra.callbacks.slurm_pending.warning_s=2",
            "hydra.callbacks.slurm_pending.poll_s=1",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "model=smoke_test_lm",
            "optim.lr=1e-3,3e-3",
        ],
        cwd=REPO,
        env={**os.environ, "K3TRAIN_OUTPUTS": str(tmp_path / "outputs"), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and launcher.poll() is None:
            if any(" waiting: BeginTime" in line for line in lines):
                break
            time.sleep(0.2)
        time.sleep(3)  # three more polls: the same array and reason are not reported again
    finally:
        subprocess.run(["scancel", f"--name={name}"], timeout=30)
        launcher.kill()
        launcher.wait(timeout=30)
        reader.join(timeout=10)
    reported = [line for line in lines if line.startswith("k3train: SLURM job")]
    # once per reason: BeginTime, after "None" where the scheduler had not looked at the array by warning_s (a
    # loaded machine: seen with two pytest workers on 2 cores)
    if len(reported) == 2:
        assert " waiting: None (the scheduler has not looked at it yet)" in reported[0], "".join(lines)
    assert 1 <= len(reported) <= 2, "".join(lines)
    assert " waiting: BeginTime (its start time has not come yet)" in reported[-1], "".join(lines)
