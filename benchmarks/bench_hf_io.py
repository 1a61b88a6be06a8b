"""Hugging Face sharded safetensors I/O (k3train/hf/shards.py): peak memory and throughput of a streamed write and a
streamed read into a preallocated model.

    python benchmarks/bench_hf_io.py [--total-mib 2048] [--shards 4] [--tensor-mib 64] [--dir /tmp]

A synthetic float32 checkpoint (--total-mib in tensors of --tensor-mib, 4096 columns) is written with write_shards
in --shards shards, from a generator that makes each tensor on demand, in a fresh subprocess. Then, each time in a
fresh subprocess, the "model" (torch.empty of every shape, filled with zeros, as a model's parameters are) is filled
by copying each tensor of ShardedSafetensors.items() into its destination: once cold (the shards' pages evicted from
the page cache with posix_fadvise(DONTNEED) first; the write fsynced them, so they are clean) and once warm (straight
after, from the page cache).

Each subprocess reports its peak RSS (getrusage(RUSAGE_SELF).ru_maxrss, read at its end) and its RSS before the
work (Python, torch and, for a read, the model). A streamed read should peak near baseline + model + one shard:
safe_open memory-maps the open shard, and the pages it has read count in RSS until the shard is closed. A streamed
write should peak near baseline + one shard + one tensor. Throughput is tensor bytes over wall time (the read's
includes the copy into the model). Prints the figures with the CPU model and load average and writes
benchmarks/results/hf_io.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import write_results  # benchmarks/, beside this script

MIB = 1 << 20
COLS = 4096
RESULTS = Path(__file__).resolve().parent / "results" / "hf_io.json"


def spec(total_mib: int, tensor_mib: int) -> list[tuple[str, tuple[int, int]]]:
    """(name, shape) of every float32 tensor: total_mib in tensors of tensor_mib, COLS columns each."""
    rows = tensor_mib * MIB // (4 * COLS)
    count = total_mib // tensor_mib
    return [(f"model.layers.{i // 4}.mlp.experts.{i % 4}.weight", (rows, COLS)) for i in range(count)]


def rss_now_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child_write(directory: Path, total_mib: int, tensor_mib: int, shards: int) -> dict:
    import torch

    from k3train.hf.shards import write_shards

    shapes = spec(total_mib, tensor_mib)
    baseline = rss_now_mib()

    def produce():
        for i, (name, shape) in enumerate(shapes):
            yield name, torch.full(shape, float(i))  # made on demand: the writer never sees the whole checkpoint

    start = time.perf_counter()
    files = write_shards(produce(), directory, max_shard_bytes=total_mib * MIB // shards)
    seconds = time.perf_counter() - start
    return {"files": files, "seconds": seconds, "baseline_rss_mib": baseline, "peak_rss_mib": peak_rss_mib()}


def child_read(directory: Path, total_mib: int, tensor_mib: int) -> dict:
    import torch

    from k3train.hf.shards import ShardedSafetensors

    shapes = dict(spec(total_mib, tensor_mib))
    baseline = rss_now_mib()
    model = {name: torch.zeros(shape) for name, shape in shapes.items()}  # the destination, as a model holds it
    with_model = rss_now_mib()
    order = {name: i for i, name in enumerate(shapes)}
    start = time.perf_counter()
    ckpt = ShardedSafetensors(directory)
    copied = 0
    for name, tensor in ckpt.items():
        model[name].copy_(tensor)
        copied += tensor.numel() * tensor.element_size()
        del tensor  # only the destination keeps the data
    seconds = time.perf_counter() - start
    peak = peak_rss_mib()
    wrong = [n for n, t in model.items() if t[0, 0].item() != order[n] or t[-1, -1].item() != order[n]]
    if copied != sum(t.numel() * t.element_size() for t in model.values()) or wrong:
        raise SystemExit(f"read back wrong data: copied {copied} bytes, wrong tensors {wrong[:3]}")
    return {
        "seconds": seconds,
        "bytes": copied,
        "baseline_rss_mib": baseline,
        "rss_with_model_mib": with_model,
        "peak_rss_mib": peak,
    }


def run_child(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env={**os.environ}
    )
    if proc.returncode != 0:
        raise SystemExit(f"child {args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def evict(directory: Path) -> None:
    """Drop the shards' clean pages from the page cache (a hint the kernel may partly ignore)."""
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=2048)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--tensor-mib", type=int, default=64)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, directory = args.child[0], Path(args.child[1])
        if kind == "write":
            result = child_write(directory, args.total_mib, args.tensor_mib, args.shards)
        else:
            result = child_read(directory, args.total_mib, args.tensor_mib)
        print(json.dumps(result))
        return

    free = shutil.disk_usage(args.dir).free
    if free < args.total_mib * MIB + (1 << 30):
        raise SystemExit(
            f"{args.dir} has {free / 2**30:.1f} GiB free; the checkpoint needs {args.total_mib} MiB + 1 GiB"
        )
    sizes = ["--total-mib", str(args.total_mib), "--tensor-mib", str(args.tensor_mib), "--shards", str(args.shards)]
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="bench_hf_io-", dir=args.dir) as tmp:
        ckpt = Path(tmp) / "ckpt"
        write = run_child("write", str(ckpt), *sizes)
        shard_mib = max((ckpt / f).stat().st_size for f in write["files"]) / MIB
        evict(ckpt)
        cold = run_child("read", str(ckpt), *sizes)
        warm = run_child("read", str(ckpt), *sizes)
    load_end = list(os.getloadavg())

    model_mib = len(spec(args.total_mib, args.tensor_mib)) * args.tensor_mib
    for r in (cold, warm):
        r["gb_per_s"] = r["bytes"] / r["seconds"] / 1e9
        r["peak_over_baseline_mib"] = r["peak_rss_mib"] - r["baseline_rss_mib"]
        r["peak_over_baseline_per_model_plus_shard"] = r["peak_over_baseline_mib"] / (model_mib + shard_mib)
    write["gb_per_s"] = model_mib * MIB / write["seconds"] / 1e9
    write["peak_over_baseline_mib"] = write["peak_rss_mib"] - write["baseline_rss_mib"]
    result = {
        "benchmark": "HF sharded safetensors: streamed write, streamed read into a preallocated model",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_at_start": load_start,
        "load_avg_at_end": load_end,
        "checkpoint": {
            "dtype": "float32",
            "model_mib": model_mib,
            "tensors": len(spec(args.total_mib, args.tensor_mib)),
            "tensor_mib": args.tensor_mib,
            "shards": len(write["files"]),
            "largest_shard_mib": shard_mib,
        },
        "write": write,
        "read_cold": cold,
        "read_warm": warm,
    }

    print(f"CPU {result['cpu']} ({result['cores']} cores), load average {load_start} -> {load_end}")
    print(
        f"checkpoint: {model_mib} MiB float32, {result['checkpoint']['tensors']} tensors of {args.tensor_mib} MiB,"
        f" {len(write['files'])} shards, largest {shard_mib:.0f} MiB"
    )
    print(
        f"write: {write['gb_per_s']:.2f} GB/s, peak RSS {write['peak_rss_mib']:.0f} MiB = baseline"
        f" {write['baseline_rss_mib']:.0f} + {write['peak_over_baseline_mib']:.0f} (one shard is {shard_mib:.0f})"
    )
    for label, r in (("read cold", cold), ("read warm", warm)):
        print(
            f"{label}: {r['gb_per_s']:.2f} GB/s (with the copy into the model), peak RSS {r['peak_rss_mib']:.0f} MiB"
            f" = baseline {r['baseline_rss_mib']:.0f} + {r['peak_over_baseline_mib']:.0f}; model {model_mib},"
            f" model + largest shard {model_mib + shard_mib:.0f}"
            f" (peak over baseline / that = {r['peak_over_baseline_per_model_plus_shard']:.2f})"
        )
    write_results(args.out, result)


if __name__ == "__main__":
    main()
