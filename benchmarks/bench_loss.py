"""LM head + cross-entropy, forward + backward: the whole-logits path against the chunked linear_cross_entropy.

old: F.cross_entropy(F.linear(h, W).float(), y), the [N, V] logits written in full (KimiK3 before
     k3train/models/common/loss.py); new: linear_cross_entropy(h, W, y, chunk_size) at several chunk sizes.
Both run side by side in one process, alternating, median of --repeats, at KimiK3 k3_small's head (N = batch 2 x
seq 1024 = 2048 rows, d 512, V 32768) and k3_tiny's (V 257), fp32. Peak memory: each path once in a fresh process
(VmHWM, the resident high-water mark, of the child minus that of a child that built the same inputs and ran
nothing; Linux only), since tracemalloc does not see torch's allocations.

    python benchmarks/bench_loss.py [--repeats 7]
Writes benchmarks/results/loss.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from k3train.runtime.cpu import configure_openmp

configure_openmp()  # as `python -m k3train` does, before torch loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from k3train.models.common.loss import default_chunk_size, linear_cross_entropy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (name, rows N, d_model, vocab V)
CASES = [("k3_small", 2048, 512, 32768), ("k3_tiny", 2048, 128, 257)]
CHUNKS = [128, 256, 512, 1024, 2048]


def inputs(n: int, d: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (0.02 * torch.randn(v, d, generator=g)).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=g)


def old_loss(hidden, weight, targets, chunk_size=None):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


def fwd_bwd_seconds(loss_fn, hidden, weight, targets, chunk_size=None) -> float:
    hidden.grad = weight.grad = None
    start = time.perf_counter()
    loss_fn(hidden, weight, targets, chunk_size).backward()
    return time.perf_counter() - start


def bench_case(n: int, d: int, v: int, repeats: int, chunks=CHUNKS) -> dict:
    hidden, weight, targets = inputs(n, d, v)
    runs = [("old", old_loss, None)] + [(f"chunk_{c}", linear_cross_entropy, c) for c in chunks]
    for _, fn, c in runs:  # warm-up
        fwd_bwd_seconds(fn, hidden, weight, targets, c)
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(repeats):  # alternating, so load from other processes hits every variant alike
        for name, fn, c in runs:
            times[name].append(fwd_bwd_seconds(fn, hidden, weight, targets, c))
    medians = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    result = {
        "rows": n,
        "d_model": d,
        "vocab": v,
        "median_ms": {k: 1e3 * s for k, s in medians.items()},
        "speedup_over_old": {k: medians["old"] / s for k, s in medians.items() if k != "old"},
    }
    print(f"N={n} d={d} V={v}: " + "  ".join(f"{k} {1e3 * s:6.1f} ms" for k, s in medians.items()))
    return result


def peak_rss_mb(mode: str, n: int, d: int, v: int, chunk_size: int) -> float:
    """The peak resident memory of a fresh child that builds the inputs and runs `mode` (old / new / none) once, in
    MiB. VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's, which has held every benchmark's tensors."""
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(n), str(d), str(v), str(chunk_size)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(proc.stdout.split()[-1])


def child(mode: str, n: int, d: int, v: int, chunk_size: int) -> None:
    hidden, weight, targets = inputs(n, d, v)
    if mode != "none":
        fwd_bwd_seconds(old_loss if mode == "old" else linear_cross_entropy, hidden, weight, targets, chunk_size)
    status = Path("/proc/self/status").read_text()
    print(int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, *shape = args.child
        return child(mode, *map(int, shape))
    out = {
        "benchmark": "LM head + cross-entropy fwd+bwd, fp32: whole logits (old) vs linear_cross_entropy by chunk "
        "size (median of repeats); peak RSS above the inputs, one fresh process per path",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_at_start": os.getloadavg(),
        "cases": {name: bench_case(n, d, v, args.repeats) for name, n, d, v in CASES},
    }
    for name, n, d, v in CASES:
        chunk = min(default_chunk_size(v), n)
        out["cases"][name]["default_chunk_size"] = chunk
        base = peak_rss_mb("none", n, d, v, chunk)
        peak = {mode: peak_rss_mb(mode, n, d, v, chunk) - base for mode in ("old", "new")}
        out["cases"][name]["peak_rss_above_inputs_mib"] = peak
        print(
            f"{name}: peak RSS above the inputs: old {peak['old']:.0f} MiB, new (default chunk, {chunk} rows) "
            f"{peak['new']:.0f} MiB"
        )
    out["load_avg_at_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loss.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'loss.json'}")


if __name__ == "__main__":
    main()
