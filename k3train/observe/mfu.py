"""Model FLOP utilisation: the training FLOP/s a run achieves over the hardware's peak, as `mfu` in train events.

The FLOPs come from the model (the optional `CountsFlops` capability, k3train/models/protocol.py); the peak, per
device, from the first that applies:
1. `train.peak_flops` (FLOP/s), the user's number;
2. on a GPU, the vendor's dense (no 2:4 sparsity) peak for the autocast dtype, from the table below;
3. on a CPU, a matmul timed once per machine and cached in $K3TRAIN_CACHE (or ~/.cache/k3train)/peak_flops.json,
   keyed by CPU model, dtype and thread count: the best of a second of [n, n] matmuls, with the date and the load
   average it was taken at. A cached entry is used as it is, whatever the load now, so that runs on one machine
   divide by the same peak (docs/decisions/cpu-peak-calibration.md); K3TRAIN_RECALIBRATE=1 (or deleting the file)
   measures again and replaces it. train.peak_flops overrides it all.
An unknown GPU has no peak: `mfu` is null and the summary says to set train.peak_flops.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from k3train.files import write_atomic
from k3train.models.protocol import CountsFlops
from k3train.runtime.cpu import cpu_description
from k3train.runtime.paths import cache_root

TERA = 1e12
# Dense peaks by dtype in FLOP/s, from NVIDIA's datasheets (their tensor-core figures are quoted with sparsity:
# halved here). fp32 is the CUDA-core figure (torch multiplies fp32 without TF32 by default); tf32 applies when
# torch.set_float32_matmul_precision allows it. More specific names first: "H100 PCIe" before "H100".
GPU_PEAKS: list[tuple[str, dict[str, float]]] = [
    # NVIDIA H100 Tensor Core GPU datasheet (2023): SXM / PCIe / NVL columns.
    ("H100 PCIe", {"bf16": 756 * TERA, "fp16": 756 * TERA, "tf32": 378 * TERA, "fp32": 51 * TERA}),
    ("H100 NVL", {"bf16": 835 * TERA, "fp16": 835 * TERA, "tf32": 417.5 * TERA, "fp32": 60 * TERA}),
    ("H100", {"bf16": 989.5 * TERA, "fp16": 989.5 * TERA, "tf32": 494.5 * TERA, "fp32": 67 * TERA}),
    # NVIDIA H200 Tensor Core GPU datasheet (2024): H200 SXM / H200 NVL columns.
    ("H200 NVL", {"bf16": 835 * TERA, "fp16": 835 * TERA, "tf32": 417.5 * TERA, "fp32": 60 * TERA}),
    ("H200", {"bf16": 989.5 * TERA, "fp16": 989.5 * TERA, "tf32": 494.5 * TERA, "fp32": 67 * TERA}),
    # NVIDIA HGX B200 datasheet (2024), per GPU.
    ("B200", {"bf16": 2250 * TERA, "fp16": 2250 * TERA, "tf32": 1100 * TERA, "fp32": 75 * TERA}),
    # NVIDIA A100 Tensor Core GPU datasheet (2021), 40 GB and 80 GB alike.
    ("A100", {"bf16": 312 * TERA, "fp16": 312 * TERA, "tf32": 156 * TERA, "fp32": 19.5 * TERA}),
    # NVIDIA L40S datasheet (2023).
    ("L40S", {"bf16": 362 * TERA, "fp16": 362 * TERA, "tf32": 183 * TERA, "fp32": 91.6 * TERA}),
]
CACHE_FILE = "peak_flops.json"
RECALIBRATE_ENV = "K3TRAIN_RECALIBRATE"  # 1: measure the CPU peak again and replace the cached entry


@dataclass(frozen=True)
class Calibration:
    """When and how busy the machine was when a CPU peak was measured, and whether this run took it from the cache."""

    measured_at: str | None  # ISO 8601, UTC; None: an entry from before k3train recorded the date
    load_avg: float | None
    cached: bool


@dataclass(frozen=True)
class Peak:
    flops_per_s: float | None  # per device; None: unknown
    source: str
    calibration: Calibration | None = None  # a CPU's measured peak only


def gpu_peak(device_name: str, dtype: str) -> Peak:
    """The table's peak for a GPU named like torch.cuda.get_device_name(), in the dtype its matmuls run in."""
    if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    for name, peaks in GPU_PEAKS:
        if name.lower() in device_name.lower():
            if dtype not in peaks:
                return Peak(None, f"no {dtype} peak in the table for NVIDIA {name}: set train.peak_flops")
            return Peak(peaks[dtype], f"datasheet: NVIDIA {name} dense {dtype}")
    return Peak(None, f"unknown GPU {device_name!r}: set train.peak_flops to its peak FLOP/s")


def calibrate_cpu_matmul(dtype: torch.dtype, budget_s: float = 1.0) -> float:
    """The best FLOP/s of square matmuls in `dtype` on this CPU within about budget_s.

    n doubles from 128 while one product takes under 20 ms (up to 2048), so a CPU that emulates a dtype slowly
    still finishes within the budget."""
    n = 128
    generator = torch.Generator().manual_seed(0)  # its own: drawing from the global one would change the run
    a = torch.randn(n, n, generator=generator).to(dtype)
    while True:
        t0 = time.perf_counter()
        a @ a
        if time.perf_counter() - t0 > 0.02 or n >= 2048:
            break
        n *= 2
        a = torch.randn(n, n, generator=generator).to(dtype)
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def busy(load_avg: float | None) -> bool:
    """Whether a calibration at this load average shared the CPUs: at half of them busy or more, other work takes
    cores from the matmuls, so the peak measured is an underestimate (and every MFU computed from it reads high)."""
    return load_avg is not None and load_avg >= (os.cpu_count() or 1) / 2


def cpu_peak(dtype: str, cache_dir: Path | None = None) -> Peak:
    """The calibrated matmul peak of this CPU at torch's current thread count, measured (and cached) when there is
    none, or $K3TRAIN_RECALIBRATE asks (which replaces it). Load can only lower a measured peak, so a cached entry
    measured on a busy machine is measured again once the machine is quieter by at least a core's worth of load,
    and the higher of the two is kept; a quiet entry is used as it is, so MFU compares across runs."""
    threads = torch.get_num_threads()
    cpu = cpu_description()["cpu_model"]
    key = f"{cpu} | {dtype} | {threads} threads"
    path = cache_root(cache_dir) / CACHE_FILE
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cached = {}
    what = f"calibration: {dtype} matmul on {threads} threads of {cpu}"
    entry = cached.get(key)
    load_now = round(os.getloadavg()[0], 2)
    asked = recalibration_asked()
    if _usable(entry) and not asked:
        calibration = _calibration(entry, cached=True)
        then = calibration.load_avg
        quietest = min(then or 0.0, entry.get("quietest_try", math.inf))  # each try must be a core quieter still
        if not (busy(then) and load_now <= quietest - 1):  # quiet then, or no quieter now: the cached figure as it is
            return Peak(
                float(entry["flops_per_s"]),
                f"{what}, {_measured(calibration)}{_busy_note(then)}, from the cache {path}; {RECALIBRATE_ENV}=1 "
                "measures again",
                calibration,
            )
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[dtype]
    measured = {
        "flops_per_s": calibrate_cpu_matmul(torch_dtype),
        "load_avg": load_now,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    note, kept_old = "", False  # the figure a new measurement replaced, or was kept over it, stays in sight
    if _usable(entry):
        old = f"{entry['flops_per_s'] / 1e9:,.1f} GFLOP/s {_measured(_calibration(entry, cached=True))}"
        if asked or measured["flops_per_s"] >= entry["flops_per_s"]:
            note = f" (replacing {old})"
        else:  # load only lowers a peak: the higher figure is the truer one
            note = f" ({measured['flops_per_s'] / 1e9:,.1f} GFLOP/s at load average {load_now:g} now; kept: {old})"
            measured, kept_old = {**entry, "quietest_try": load_now}, True
    cached[key] = measured
    kept = f"cached in {path}" if _write_cache(path, cached) else f"not cached ({path} is not writable)"
    calibration = _calibration(measured, cached=kept_old)
    if kept_old:
        return Peak(float(measured["flops_per_s"]), f"{what}, the higher of two{note}, {kept}", calibration)
    source = f"{what}, {_measured(calibration)}{_busy_note(load_now)}{note}, {kept}"
    return Peak(float(measured["flops_per_s"]), source, calibration)


def _busy_note(load_avg: float | None) -> str:
    if not busy(load_avg):
        return ""
    return (
        f" (a busy machine: {os.cpu_count()} CPUs, so this peak is low and MFU reads high; measured again once the "
        "load is a core lower, the higher kept)"
    )


def _write_cache(path: Path, cached: dict) -> bool:
    text = json.dumps(cached, indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    except OSError:
        return False  # a read-only cache only costs a calibration per run
    return True


def recalibration_asked() -> bool:
    return os.environ.get(RECALIBRATE_ENV, "").strip() not in ("", "0")


def _calibration(entry: dict, cached: bool) -> Calibration:
    measured_at, load_avg = entry.get("measured_at"), entry.get("load_avg")
    return Calibration(
        measured_at if isinstance(measured_at, str) else None,
        load_avg if isinstance(load_avg, (int, float)) else None,
        cached,
    )


def _measured(calibration: Calibration) -> str:
    when = "now" if not calibration.cached else calibration.measured_at or "on a date not recorded"
    load = "" if calibration.load_avg is None else f" at load average {calibration.load_avg:g}"
    return f"measured {when}{load}"


def _usable(entry) -> bool:
    flops = entry.get("flops_per_s") if isinstance(entry, dict) else None
    return isinstance(flops, (int, float)) and math.isfinite(flops) and flops > 0


def resolve_peak(setting: float | None, device: torch.device, dtype: str) -> Peak:
    if setting is not None:
        return Peak(float(setting), "train.peak_flops")
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return cpu_peak(dtype)
    return Peak(None, f"no peak known for {device.type}: set train.peak_flops")


class MFU:
    """Training FLOPs per token and the peak of all devices together: mfu = tokens/s x FLOPs / peak."""

    def __init__(self, flops_per_token: dict[str, float] | None, seq_len: int, peak: Peak, devices: int = 1):
        self.flops_per_token, self.seq_len, self.peak, self.devices = flops_per_token, seq_len, peak, devices

    @classmethod
    def for_model(
        cls, model, seq_len: int, device: torch.device, dtype: str, peak_setting: float | None, devices: int = 1
    ) -> MFU:
        """No FLOP count (a model without flops_per_token): no peak is looked up either."""
        if not isinstance(model, CountsFlops):
            return cls(None, seq_len, Peak(None, f"{type(model).__name__} does not count its FLOPs"), devices)
        return cls(model.flops_per_token(seq_len), seq_len, resolve_peak(peak_setting, device, dtype), devices)

    def of(self, tokens_per_s: float) -> float | None:
        """The fraction (0..1) of the peak that tokens_per_s training tokens a second (all devices) achieve."""
        if self.flops_per_token is None or not self.peak.flops_per_s:
            return None
        return tokens_per_s * self.flops_per_token["training"] / (self.peak.flops_per_s * self.devices)

    def as_dict(self) -> dict:
        """run.json's record."""
        return {
            "flops_per_token": self.flops_per_token,
            "seq_len": self.seq_len,
            "peak_flops_per_s": self.peak.flops_per_s,
            "peak_source": self.peak.source,
            "peak_calibration": asdict(self.peak.calibration) if self.peak.calibration else None,
            "devices": self.devices,
        }

    def describe(self) -> str:
        if self.flops_per_token is None:
            return f"mfu: not computed ({self.peak.source})"
        flops = f"{self.flops_per_token['training'] / 1e6:,.1f} MFLOP per training token at seq {self.seq_len}"
        if not self.peak.flops_per_s:
            return f"mfu: not computed ({self.peak.source}); {flops}"
        return f"mfu: {flops}; peak {self.peak.flops_per_s / 1e9:,.1f} GFLOP/s per device ({self.peak.source})"
