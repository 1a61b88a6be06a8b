"""The devices a plan can be made for: one table of vendor figures per GPU, and this machine's CPU, measured.

Every figure is per device. FLOP/s are dense (no 2:4 sparsity; vendors quote tensor-core peaks with it, twice the
dense figure); fp32 is the CUDA-core figure, what torch's fp32 matmuls reach without TF32 (its default). The link is
the intra-node GPU-to-GPU bandwidth as vendors quote NVLink: both directions together, so one direction gets half;
the network is per GPU, one direction (a 400 Gb/s NIC per GPU, rail-optimised). The FLOP/s agree with
k3train/observe/mfu.py's GPU_PEAKS (tests/test_plan.py checks it), which MFU divides by.

Sources (NVIDIA's pages and documents; the MLCommons entries are NVIDIA's and Nebius's system descriptions):
- H100 SXM: https://www.nvidia.com/en-us/data-center/h100/ (989 TFLOP/s dense bf16 = 1,979 with sparsity halved,
  67 TFLOP/s fp32, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s)
- H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ (the H100's compute; 141 GB HBM3e at 4.8 TB/s, NVLink
  900 GB/s), and NVIDIA's MLPerf system description (141 GB, 18 NVLink 4 links, 900 GB/s, 8 per node):
  https://raw.githubusercontent.com/mlcommons/inference_results_v4.1/main/closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json
- B200 (HGX / DGX B200): https://www.nvidia.com/en-us/data-center/dgx-b200/ (8 GPUs, 1,440 GB HBM3e at 64 TB/s,
  NVLink 14.4 TB/s: per GPU 180 GB, 8 TB/s, 1.8 TB/s) and
  https://raw.githubusercontent.com/mlcommons/inference_results_v6.0/main/closed/Nebius/systems/nebius_b200_n1.json
  (B200-SXM-180GB, 8 per node, 8x ConnectX-7 400 Gb/s); 2,250 TFLOP/s dense bf16 and 75 TFLOP/s fp32 as mfu.py
- The host link: PCIe Gen5 x16, 128 GB/s both directions (H100's and H200's pages, above; for B200 the same is
  assumed: the DGX B200 page gives no per-GPU host-link figure), so a checkpoint's copy to pinned host memory reaches
  at most 64 GB/s a GPU (plan/checkpoint.py)
- 8 GPUs a node and 400 Gb/s per GPU for HGX H100, H200 and B200 alike (NVIDIA's 2-8-9-400 reference design):
  https://docs.nvidia.com/reference-architectures/hgx-ai-factory-h100-h200-b200/abstract.md
`cpu` is this machine: the calibrated matmul peak of k3train/observe/mfu.py (cached per CPU, dtype and threads), the
total RAM from the OS, and a timed copy for the memory bandwidth; processes on it share the RAM and talk through
memory, so it has no network.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

TERA, GIGA = 1e12, 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float  # dense peak FLOP/s (fp16 alike)
    fp32_flops: float
    memory_bytes: float
    hbm_bytes_per_s: float | None
    link_bytes_per_s: float | None  # intra-node, both directions together (NVLink as quoted)
    network_bits_per_s: float | None  # per device, one direction; None: one node only
    devices_per_node: int | None  # None: every device on one node (the CPU)
    source: str
    host_link_bytes_per_s: float | None = None  # device to host memory, both directions together (PCIe as quoted)

    def peak_flops(self, precision: str) -> float:
        """The matmul peak in the run's precision (conf/precision: bf16, fp16 or fp32)."""
        return self.fp32_flops if precision == "fp32" else self.bf16_flops

    @property
    def link_one_way(self) -> float | None:
        return None if self.link_bytes_per_s is None else self.link_bytes_per_s / 2

    @property
    def host_one_way(self) -> float | None:
        """What a copy of the device's memory to the host's (a checkpoint's staging) can reach."""
        return None if self.host_link_bytes_per_s is None else self.host_link_bytes_per_s / 2

    @property
    def network_one_way(self) -> float | None:
        return None if self.network_bits_per_s is None else self.network_bits_per_s / 8

    def node_size(self, devices: int) -> int:
        return devices if self.devices_per_node is None else min(devices, self.devices_per_node)


GPUS: dict[str, Hardware] = {
    "h100": Hardware(
        "NVIDIA H100 SXM", 989.5 * TERA, 67 * TERA, 80 * GIGA, 3.35e12, 900 * GIGA, 400 * GIGA, 8,
        "nvidia.com/en-us/data-center/h100; NVIDIA HGX AI Factory RA (8 GPUs, 400 Gb/s each)", 128 * GIGA,
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM", 989.5 * TERA, 67 * TERA, 141 * GIGA, 4.8e12, 900 * GIGA, 400 * GIGA, 8,
        "nvidia.com/en-us/data-center/h200; NVIDIA HGX AI Factory RA (8 GPUs, 400 Gb/s each)", 128 * GIGA,
    ),
    "b200": Hardware(
        "NVIDIA B200 (HGX)", 2250 * TERA, 75 * TERA, 180 * GIGA, 8e12, 1800 * GIGA, 400 * GIGA, 8,
        "nvidia.com/en-us/data-center/dgx-b200; NVIDIA HGX AI Factory RA (8 GPUs, 400 Gb/s each)", 128 * GIGA,
    ),
}  # fmt: skip
CHOICES = (*GPUS, "cpu")


def lookup(name: str) -> Hardware:
    """The table's GPU, or this machine's CPU measured (a few seconds the first time: mfu.py caches its peaks)."""
    if name == "cpu":
        return this_cpu()
    if name not in GPUS:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(CHOICES)}")
    return GPUS[name]


def this_cpu() -> Hardware:
    from k3train.observe.mfu import cpu_peak
    from k3train.runtime.cpu import cpu_description

    fp32, bf16 = (cpu_peak(dtype).flops_per_s for dtype in ("fp32", "bf16"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    model = cpu_description()["cpu_model"]
    copy = memory_copy_bandwidth()
    return Hardware(
        f"CPU: {model}",
        bf16,
        fp32,
        float(ram),
        copy,
        copy,
        None,
        None,
        "measured: mfu.py calibration, RAM, a copy",
        2 * copy,  # staging a checkpoint is a copy within the same memory
    )


def memory_copy_bandwidth(megabytes: int = 256, repeats: int = 3) -> float:
    """Bytes a second one copy of a large fp32 tensor reads and writes, best of `repeats`."""
    import torch

    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best
