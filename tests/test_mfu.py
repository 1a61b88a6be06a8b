"""`mfu` in the train events: FLOPs from the model, the peak from a setting, the GPU table or a cached calibration."""

import json

import pytest
import torch

from k3train.config import TrainConfig
from k3train.observe import mfu as mfu_module
from k3train.observe.metrics import read_metrics
from k3train.observe.mfu import MFU, Calibration, Peak, calibrate_cpu_matmul, cpu_peak, gpu_peak
from k3train.runtime.cpu import cpu_description

from helpers.trainer import WrapsSmoke, make_trainer


class CountedSmoke(WrapsSmoke):
    """The smoke model with a FLOP count, as a model that implements CountsFlops would have."""

    def flops_per_token(self, seq_len):
        return {"forward": 1000.0 * seq_len, "training": 3000.0 * seq_len}


@pytest.mark.parametrize(
    "name, dtype, peak, row",
    [  # torch.cuda.get_device_name() -> the datasheet's dense figure and the table row that gave it
        ("NVIDIA H200", "bf16", 989.5e12, "H200"),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12, "H100"),
        ("NVIDIA H100 PCIe", "bf16", 756e12, "H100 PCIe"),  # not the SXM figure
        ("NVIDIA H200 NVL", "fp16", 835e12, "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12, "A100"),  # fp32 without TF32: the CUDA-core figure
    ],
)
def test_known_gpus_get_their_datasheet_peak(name, dtype, peak, row):
    assert torch.get_float32_matmul_precision() == "highest"  # torch's default: fp32 matmuls are not TF32
    assert gpu_peak(name, dtype) == Peak(peak, f"datasheet: NVIDIA {row} dense {dtype}")


def test_fp32_matmuls_allowed_tf32_get_the_tf32_peak():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32") == Peak(156e12, "datasheet: NVIDIA A100 dense tf32")
        assert gpu_peak("NVIDIA H100 PCIe", "bf16") == Peak(756e12, "datasheet: NVIDIA H100 PCIe dense bf16")
    finally:
        torch.set_float32_matmul_precision(before)


def test_an_unknown_gpu_has_no_peak_and_says_how_to_give_one():
    peak = gpu_peak("NVIDIA GeForce GTX 1080", "fp32")
    assert peak.flops_per_s is None and "train.peak_flops" in peak.source


def test_calibration_is_plausible_and_leaves_the_global_rng_alone():
    torch.set_num_threads(1)
    rng = torch.get_rng_state()
    flops = calibrate_cpu_matmul(torch.float32, budget_s=0.2)
    assert 1e8 < flops < 1e13  # any CPU of the last 20 years; a unit error (GFLOP/s) would fail
    assert torch.equal(torch.get_rng_state(), rng)  # a run's random stream is the same with or without it


def test_cpu_peak_is_measured_once_per_cpu_dtype_and_thread_count(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mfu_module, "calibrate_cpu_matmul", lambda dtype: calls.append(dtype) or 5e10)
    monkeypatch.setattr(mfu_module.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    monkeypatch.delenv("K3TRAIN_RECALIBRATE", raising=False)
    threads = torch.get_num_threads()
    try:
        first = cpu_peak("fp32", cache_dir=tmp_path)
        again = cpu_peak("fp32", cache_dir=tmp_path)
        torch.set_num_threads(threads + 1)
        other = cpu_peak("fp32", cache_dir=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert first.flops_per_s == again.flops_per_s == other.flops_per_s == 5e10
    assert calls == [torch.float32, torch.float32]  # the second thread count calibrates; the repeat does not
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert len(cached) == 2 and all("fp32" in key for key in cached)
    assert "calibration" in first.source


def test_a_user_peak_wins_and_mfu_is_tokens_times_flops_over_the_peak_of_all_devices():
    model = CountedSmoke(vocab_size=257)
    meter = MFU.for_model(model, 64, torch.device("cpu"), "fp32", peak_setting=1e9, devices=2)
    assert meter.peak == Peak(1e9, "train.peak_flops")
    assert meter.of(2000.0) == pytest.approx(2000.0 * 3000.0 * 64 / 2e9)
    assert meter.as_dict()["flops_per_token"] == {"forward": 64000.0, "training": 192000.0}


def test_a_model_without_a_flop_count_logs_mfu_null():
    meter = MFU.for_model(WrapsSmoke(vocab_size=257), 64, torch.device("cpu"), "fp32", peak_setting=None)
    assert meter.of(1000.0) is None and "does not count" in meter.describe()


def test_peak_flops_setting_is_checked():
    with pytest.raises(ValueError, match="train.peak_flops must be > 0"):
        TrainConfig(peak_flops=0)


def test_every_train_event_has_mfu(tmp_path, builtin_data):
    model = CountedSmoke(builtin_data.vocab_size)
    trainer = make_trainer(tmp_path, builtin_data, model, max_steps=3, peak_flops=1e9)
    assert trainer.fit() == "max_steps"
    train = [e for e in read_metrics(tmp_path / "metrics.jsonl") if e["event"] == "train"]
    assert len(train) == 3
    for event in train:  # seq_len 16: 48,000 training FLOPs per token
        assert event["mfu"] == pytest.approx(event["tokens_per_s"] * 48_000 / 1e9)


def test_a_peak_measured_on_a_busy_machine_is_measured_again_when_quieter_and_the_highest_is_kept(
    tmp_path, monkeypatch
):
    """Load only lowers a measured peak (and so raises every MFU computed from it): a calibration at load 6 on 2 CPUs
    says so, is measured again once the load is a core lower, and the higher figure is kept; a quiet one is used as it
    is, whatever a later start would measure, so MFU compares across runs."""
    measured = iter([4e10, 3e10, 9e10, 5e10])
    monkeypatch.setattr(mfu_module, "calibrate_cpu_matmul", lambda dtype: next(measured))
    monkeypatch.delenv("K3TRAIN_RECALIBRATE", raising=False)
    monkeypatch.setattr(mfu_module.os, "cpu_count", lambda: 2)
    loads = {"now": 6.0}
    monkeypatch.setattr(mfu_module.os, "getloadavg", lambda: (loads["now"], 0.0, 0.0))
    first = cpu_peak("fp32", cache_dir=tmp_path)
    assert first.flops_per_s == 4e10 and not first.calibration.cached
    assert "measured now at load average 6 (a busy machine: 2 CPUs, so this peak is low and MFU reads high" in (
        first.source
    )
    measured_at = first.calibration.measured_at

    loads["now"] = 5.5  # not a core quieter: the cached figure, still said to be busy
    same = cpu_peak("fp32", cache_dir=tmp_path)
    assert same.flops_per_s == 4e10 and same.calibration == Calibration(measured_at, 6.0, cached=True)
    assert f"measured {measured_at} at load average 6 (a busy machine" in same.source
    assert "from the cache" in same.source

    loads["now"] = 4.5  # quieter, but still busy: measured again (3e10), and the higher kept
    kept = cpu_peak("fp32", cache_dir=tmp_path)
    assert kept.flops_per_s == 4e10 and "30.0 GFLOP/s at load average 4.5 now; kept: 40.0 GFLOP/s" in kept.source
    loads["now"] = 4.0  # not a core quieter than the last try: not measured a third time
    assert cpu_peak("fp32", cache_dir=tmp_path).calibration == Calibration(measured_at, 6.0, cached=True)

    loads["now"] = 0.5  # quiet: measured again, higher, and cached with its load
    quiet = cpu_peak("fp32", cache_dir=tmp_path)
    assert quiet.flops_per_s == 9e10 and "at load average 0.5 (replacing 40.0 GFLOP/s measured" in quiet.source
    assert "a busy machine" not in quiet.source.split("(replacing")[0]
    cache = (tmp_path / "peak_flops.json").read_bytes()
    loads["now"] = 0.0
    again = cpu_peak("fp32", cache_dir=tmp_path)  # a quiet entry: as it is
    assert again.flops_per_s == 9e10 and again.calibration.cached and "a busy machine" not in again.source
    assert next(measured) == 5e10 and (tmp_path / "peak_flops.json").read_bytes() == cache
    record = MFU({"forward": 1.0, "training": 3.0}, 64, again).as_dict()  # run.json's flops
    assert record["peak_calibration"]["load_avg"] == 0.5 and record["peak_calibration"]["cached"] is True


def test_the_cpu_peak_is_measured_again_only_when_asked(tmp_path, monkeypatch):
    measured = iter([9e10, 4e10])
    monkeypatch.setattr(mfu_module, "calibrate_cpu_matmul", lambda dtype: next(measured))
    monkeypatch.setattr(mfu_module.os, "getloadavg", lambda: (1.0, 0.0, 0.0))
    monkeypatch.setattr(mfu_module.os, "cpu_count", lambda: 8)  # load 1 of 8 CPUs: quiet
    monkeypatch.setenv("K3TRAIN_RECALIBRATE", "0")
    assert cpu_peak("fp32", cache_dir=tmp_path).flops_per_s == 9e10  # nothing cached: measured
    assert cpu_peak("fp32", cache_dir=tmp_path).flops_per_s == 9e10  # 0 asks for nothing
    monkeypatch.setenv("K3TRAIN_RECALIBRATE", "1")
    asked = cpu_peak("fp32", cache_dir=tmp_path)
    assert asked.flops_per_s == 4e10 and not asked.calibration.cached  # asked: the new figure, lower or not
    assert "measured now at load average 1 (replacing 90.0 GFLOP/s measured 20" in asked.source
    monkeypatch.delenv("K3TRAIN_RECALIBRATE")
    assert cpu_peak("fp32", cache_dir=tmp_path).flops_per_s == 4e10  # and it is the one kept
    assert next(measured, None) is None


def test_a_cache_entry_from_before_the_date_was_kept_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(mfu_module, "calibrate_cpu_matmul", lambda dtype: pytest.fail("measured again"))
    monkeypatch.delenv("K3TRAIN_RECALIBRATE", raising=False)
    key = f"{cpu_description()['cpu_model']} | fp32 | {torch.get_num_threads()} threads"
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: {"flops_per_s": 1.38e11, "load_avg": 3.5}}))
    monkeypatch.setattr(mfu_module.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(mfu_module.os, "cpu_count", lambda: 8)  # load 3.5 of 8 CPUs: quiet
    peak = cpu_peak("fp32", cache_dir=tmp_path)
    assert peak.flops_per_s == 1.38e11 and peak.calibration == Calibration(None, 3.5, cached=True)
    assert "measured on a date not recorded at load average 3.5" in peak.source
