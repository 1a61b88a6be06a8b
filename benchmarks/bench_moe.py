"""MoE layer fwd+bwd achieved FLOP/s against a dense SwiGLU FFN doing the same active FLOPs on the same tokens.

The dense FFN has width (experts_per_token + n_shared) * expert_ffn_dim, so its matmul FLOPs equal the MoE's
expert FLOPs; the MoE is also credited its router matmul. Both run side by side in one process, interleaved.

    python benchmarks/bench_moe.py [--repeats 10]
Writes benchmarks/results/moe.json. Target: MoE achieved FLOP/s >= 0.5x dense.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from results_file import write_results  # benchmarks/, beside this script

from k3train.models.common.swiglu import SwiGLU
from k3train.models.k3.moe import MoE

RESULTS = Path(__file__).resolve().parent / "results" / "moe.json"
# (name, d_model, n_experts, top-k, n_shared, expert_ffn_dim, tokens): the MoE shapes of k3_tiny and k3_small.
CASES = [
    ("k3_tiny", 128, 8, 2, 1, 128, 8 * 256),
    ("k3_small", 512, 64, 4, 1, 256, 4 * 512),
]


def fwd_bwd_seconds(module: torch.nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    module(x).square().mean().backward()
    return time.perf_counter() - start


def bench_case(name, d, n, k, shared, ffn, tokens, repeats):
    torch.manual_seed(0)
    moe = MoE(d, n, k, ffn, n_shared_experts=shared).train()
    dense = SwiGLU(d, (k + shared) * ffn)
    x = torch.randn(1, tokens, d)
    expert_flops = 3 * 2 * 3 * tokens * d * ffn * (k + shared)  # 3 matmuls, x2 FLOPs/MAC, fwd + 2x bwd
    moe_flops = expert_flops + 3 * 2 * tokens * d * n  # + the router
    for _ in range(2):  # warm-up
        fwd_bwd_seconds(moe, x), fwd_bwd_seconds(dense, x)
    t_moe, t_dense = [], []
    for _ in range(repeats):  # interleaved so that load from other processes hits both alike
        t_moe.append(fwd_bwd_seconds(moe, x))
        t_dense.append(fwd_bwd_seconds(dense, x))
    moe_s, dense_s = sorted(t_moe)[repeats // 2], sorted(t_dense)[repeats // 2]  # medians
    result = {
        "d_model": d,
        "n_experts": n,
        "top_k": k,
        "n_shared": shared,
        "expert_ffn_dim": ffn,
        "tokens": tokens,
        "moe_seconds": moe_s,
        "dense_seconds": dense_s,
        "moe_gflops_per_s": moe_flops / moe_s / 1e9,
        "dense_gflops_per_s": expert_flops / dense_s / 1e9,
    }
    result["ratio_moe_over_dense"] = result["moe_gflops_per_s"] / result["dense_gflops_per_s"]
    print(
        f"{name:9s} MoE {result['moe_gflops_per_s']:7.1f} GFLOP/s ({moe_s * 1e3:6.1f} ms)  dense "
        f"{result['dense_gflops_per_s']:7.1f} GFLOP/s ({dense_s * 1e3:6.1f} ms)  ratio "
        f"{result['ratio_moe_over_dense']:.2f}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    out = {
        "benchmark": "MoE fwd+bwd achieved FLOP/s vs dense SwiGLU with equal active FLOPs (median of repeats)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_at_start": os.getloadavg(),
        "cases": {name: bench_case(name, *shape, args.repeats) for name, *shape in CASES},
    }
    write_results(RESULTS, out)


if __name__ == "__main__":
    main()
