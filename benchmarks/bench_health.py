"""What the K3 health panel costs a training step: k3_small's forward and backward with the panel's measurements on
(KDA gate figures, the residual stream's RMS after every layer) against off, interleaved update by update in one
process, so the machine's load is the same for both halves of each pair.

    python benchmarks/bench_health.py            # k3_small, batch 4 x 256, 10 pairs after 2 warm-up ones
    python benchmarks/bench_health.py --quick    # k3_tiny, 2 pairs (a smoke test, nothing written)

The router's load counts (load CV, dead experts, bias drift) are made either way: balancing needs them. The step
timed is the forward and backward alone, without the optimizer step, so the share printed is an upper bound on the
panel's share of a whole update. Also times one read of the panel (KimiK3.diagnostics, once per log line). Target:
under 2% (issue 50). Writes benchmarks/results/health.json (or --out) with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import hydra
import torch
from results_file import write_unless_quick  # benchmarks/, beside this script

from k3train.config import model_option
from k3train.runtime.cpu import cpu_description

RESULTS = Path(__file__).resolve().parent / "results" / "health.json"


def health_cost(model_name: str, batch_size: int, seq_len: int, pairs: int, vocab_size: int = 256) -> dict:
    cfg = model_option(model_name)
    cfg.vocab_size = vocab_size
    torch.manual_seed(0)
    model = hydra.utils.instantiate(cfg)
    x = torch.randint(vocab_size, (batch_size, seq_len))
    y = torch.randint(vocab_size, (batch_size, seq_len))

    def step(on: bool) -> float:
        model.set_health_tracking(on)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _, loss = model(x, targets=y)
        loss.backward()
        return time.perf_counter() - t0

    on, off = [], []
    for i in range(2 + pairs):
        first, second = (True, False) if i % 2 == 0 else (False, True)  # which goes first alternates
        times = {first: step(first), second: step(second)}
        if i >= 2:
            on.append(times[True])
            off.append(times[False])
    model.set_health_tracking(True)
    step(True)
    t0 = time.perf_counter()
    panel = model.diagnostics()
    read_s = time.perf_counter() - t0
    ratios = [a / b for a, b in zip(on, off)]
    return {
        "model": model_name,
        "batch": f"{batch_size} x {seq_len}",
        "pairs": pairs,
        "fwd_bwd_on_s": on,
        "fwd_bwd_off_s": off,
        "on_over_off_per_pair": ratios,
        "on_over_off_median": statistics.median(ratios),
        "median_on_s": statistics.median(on),
        "median_off_s": statistics.median(off),
        "panel_read_s": read_s,
        "panel_figures": len(panel),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load_before = os.getloadavg()
    if args.quick:
        result = health_cost("k3_tiny", 2, 64, 2)
    else:
        result = health_cost("k3_small", 4, 256, args.pairs)
    result = {
        **cpu_description(),  # the CPU model, torch's SIMD level, native bf16, the load average after
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **result,
    }
    share = result["on_over_off_median"] - 1
    print(
        f"{result['model']} {result['batch']}: fwd+bwd {result['median_off_s']:.3f} s without the panel, "
        f"{result['median_on_s']:.3f} s with it; per pair on/off median {result['on_over_off_median']:.4f} "
        f"({100 * share:+.2f}%), pairs {min(result['on_over_off_per_pair']):.4f}-"
        f"{max(result['on_over_off_per_pair']):.4f}; one read of the panel {result['panel_read_s'] * 1e3:.1f} ms "
        f"({result['panel_figures']} figures)"
    )
    write_unless_quick(args.out, args.quick, RESULTS, result)


if __name__ == "__main__":
    main()
