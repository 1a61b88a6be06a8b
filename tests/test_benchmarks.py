"""The benchmark suite runs end to end (--quick) and the GPU check fits its 8 minutes and runs its CPU dry run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

pytestmark = pytest.mark.slow


def test_run_all_quick_writes_every_section_and_the_targets(tmp_path, k3_cache):
    proc = subprocess.run(
        [sys.executable, "benchmarks/run_all.py", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "K3TRAIN_CACHE": str(k3_cache)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "suite.json").read_text())
    import run_all

    assert list(report["sections"]) == list(run_all.SECTIONS)
    for name, section in report["sections"].items():
        assert "error" not in section, (name, section)
        assert len(section["load_avg_before"]) == 3  # every figure carries the machine's load
    train = report["sections"]["train_step"]["result"]["k3_tiny"]
    assert 0 < train["mfu"] < train["mfu_fwd_bwd_only"] < 1
    overhead = report["sections"]["overhead"]["result"]
    assert overhead["trainer_step_s_median"] > 0 and overhead["bare_step_s_median"] > 0
    # the Trainer's own time is a positive part of its step: what the shared work leaves
    accounting = overhead["accounting"]
    assert 0 < accounting["trainer_own_s_per_step"] < accounting["step_s"]
    assert 0 < accounting["shared_work_s_per_step"] < accounting["step_s"]
    # --quick has no k3_small: three of the five targets
    assert set(report["targets"]) == {
        "framework_overhead_k3_tiny",
        "framework_overhead_k3_tiny_accounting",
        "checkpoint_share_k3_tiny",
    }
    summary = (tmp_path / "suite.md").read_text()
    assert "| framework_overhead_k3_tiny |" in summary and "| checkpoint |" in summary


def test_gpu_check_fits_eight_minutes_and_its_dry_run_passes(tmp_path):
    import gpu_all

    assert sum(limit for _, _, limit in gpu_all.plan(dry_run_cpu=False)) <= gpu_all.TOTAL_LIMIT_S <= 8 * 60
    assert [name for name, _, _ in gpu_all.plan(dry_run_cpu=False)] == ["parity_tests", "kda_speed", "train_step"]
    assert gpu_all.main(["--dry-run-cpu", "--out", str(tmp_path / "gpu_all.json")]) == 0
    report = json.loads((tmp_path / "gpu_all.json").read_text())
    assert set(report) == {"kda_speed", "train_step"}
    assert "MFU" in report["train_step"]["output_tail"]  # the train step reports MFU against a peak
