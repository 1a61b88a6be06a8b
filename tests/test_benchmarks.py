"""The benchmark suite runs end to end (--quick) and the GPU check fits its 8 minutes and runs its CPU dry run."""

import json
import re
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
    names = [name for name, _, _ in gpu_all.plan(dry_run_cpu=False)]
    assert names == ["parity_tests", "kda_speed", "layers", "train_step"]
    gpu_results = gpu_all.RESULTS / "gpu.json"
    before = gpu_results.stat().st_mtime_ns if gpu_results.exists() else None
    assert gpu_all.main(["--dry-run-cpu", "--out", str(tmp_path / "gpu.json")]) == 0
    after = gpu_results.stat().st_mtime_ns if gpu_results.exists() else None
    assert after == before  # a dry run never writes where GPU results live
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["dry_run_cpu"] is True and "say nothing about a GPU" in report["note"]
    assert report["gpu"] == "none (CPU dry run)" and report["versions"]["torch"]
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", report["git_commit"]) and report["date"]
    assert set(report["parts"]) == {"kda_speed", "layers", "train_step"}  # the parity tests need a GPU
    for name, part in report["parts"].items():  # each script's own JSON, merged, itself marked as a dry run
        assert part["status"] == 0 and part["results"]["dry_run_cpu"] is True, (name, part["output_tail"])

    train_step = report["parts"]["train_step"]
    assert "MFU" in train_step["output_tail"]  # the train step reports MFU against a peak
    assert [r["model"] for r in train_step["results"]["results"]] == ["k3_tiny", "dense_peer"]
    assert not train_step["results"]["errors"]
    [ratio] = train_step["results"]["ratios_to_dense_peer"]  # k3_tiny over the peer, through the same Trainer
    assert ratio["model"] == "k3_tiny/chunk" and ratio["tokens_per_s"] > 0 and ratio["mfu"] > 0
    assert report["headline"]["k3_over_dense_peer"] == [ratio]

    layers = report["parts"]["layers"]["results"]
    # the head's loss without FLA's fused form: its Triton kernels need CUDA
    expected = {"moe", "dense_swiglu", "dense_situ", "kda", "mla", "head_loss_chunked", "head_loss_whole_logits"}
    assert set(layers["layers"]) == expected
    assert all(layer["achieved_tflops_per_s"] > 0 for layer in layers["layers"].values())
    macs = layers["multiply_adds_per_token"]  # the dense FFN does the MoE's FLOPs, to within rounding its width
    assert abs(macs["dense_swiglu"] - macs["moe"]) <= 3 * layers["d_model"] / 2
    assert report["headline"]["moe_flops_per_s_over_dense_swiglu"] == layers["moe_flops_per_s_over_dense_swiglu"] > 0
    assert layers["target"] == {"moe_over_dense_swiglu_at_least": 0.6, "met": None}  # no verdict from a CPU


@pytest.mark.parametrize("out", ["gpu.json", "elsewhere/gpu.json"])
def test_gpu_check_dry_run_refuses_to_write_under_the_results_folder(out, capsys):
    import gpu_all

    with pytest.raises(SystemExit) as exit_status:
        gpu_all.main(["--dry-run-cpu", "--out", str(gpu_all.RESULTS / out)])
    assert exit_status.value.code == 2 and "where GPU results live" in capsys.readouterr().err
    assert not (gpu_all.RESULTS / "elsewhere").exists()
