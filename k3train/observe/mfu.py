"""Model FLOP utilisation: the training FLOP/s a run achieves over the hardware's peak, as `mfu` in train events.

The FLOPs come from the model (the optional `CountsFlops` capability, k3train/models/protocol.py); the peak, per
device, from the first that applies:
1. `train.peak_flops` (FLOP/s), the user's number;
2. on a GPU, the vendor's dense (no 2:4 sparsity) peak for the autocast dtype, from the table below;
3. on a CPU, a matmul timed once per machine and cached in $K3TRAIN_CACHE (or ~/.cache/k3train)/peak_flops.json,
   keyed by CPU model, dtype and thread count: the best of a second of [n, n] matmuls. Other processes on the
   machine lower it (measured: docs/decisions/cpu-peak-calibration.md), so the entry keeps the load average it
   was taken at, and a later start on a clearly quieter machine (load average more than 1 lower) measures again
   and keeps the higher figure. train.peak_flops overrides it all.
An unknown GPU has no peak: `mfu` is null and the summary says to set train.peak_flops.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Peak:
    flops_per_s: float | None  # per device; None: unknown
    source: str


def gpu_peak(device_name: str, dtype: str) -> Peak:
    """The table's peak for a GPU named like torch.cuda.get_device_name(), in the dtype its matmuls run in."""
    if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    for name, peaks in GPU_PEAKS:
        if name.lower() in device_name.lower():
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


def cpu_peak(dtype: str, cache_dir: Path | None = None) -> Peak:
    """The calibrated matmul peak of this CPU at torch's current thread count, measured once and cached."""
    threads = torch.get_num_threads()
    cpu = cpu_description()["cpu_model"]
    key = f"{cpu} | {dtype} | {threads} threads"
    path = cache_root(cache_dir) / CACHE_FILE
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cached = {}
    entry, load = cached.get(key), os.getloadavg()[0]
    if not _usable(entry) or load + 1 < entry["load_avg"]:  # none yet, or taken on a busier machine than now
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        measured = {"flops_per_s": calibrate_cpu_matmul(torch_dtype), "load_avg": round(load, 2)}
        entry = max(entry, measured, key=lambda e: e["flops_per_s"]) if _usable(entry) else measured
        entry["load_avg"] = min(entry["load_avg"], measured["load_avg"])  # measure again only when quieter still
        cached[key] = entry
        text = json.dumps(cached, indent=2) + "\n"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda f: f.write(text.encode("utf-8")))
        except OSError:
            pass  # a read-only cache only costs a calibration per run
    return Peak(float(entry["flops_per_s"]), f"calibration: {dtype} matmul on {threads} threads of {cpu} ({path})")


def _usable(entry) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("flops_per_s"), (int, float))
        and isinstance(entry.get("load_avg"), (int, float))
    )


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
            "devices": self.devices,
        }

    def describe(self) -> str:
        if self.flops_per_token is None:
            return f"mfu: not computed ({self.peak.source})"
        flops = f"{self.flops_per_token['training'] / 1e6:,.1f} MFLOP per training token at seq {self.seq_len}"
        if not self.peak.flops_per_s:
            return f"mfu: not computed ({self.peak.source}); {flops}"
        return f"mfu: {flops}; peak {self.peak.flops_per_s / 1e9:,.1f} GFLOP/s per device ({self.peak.source})"
