"""Decoding k3_tiny: incremental (KDA recurrent state + MLA latent cache) against recomputing the full forward for
every new token (the naive way), at several context lengths.

For each context length L the model first takes L random tokens; then
  incremental: the median time of one forward_cached step for a new token (after prefilling L tokens);
  full recompute: the median time of one full forward over the L + 1 tokens (what the naive way pays per token).
The decoding memory is counted from the caches themselves: the KDA states (conv tails + recurrent state) and the
MLA latent cache, against what a per-head K/V cache of the same MLA layers would hold.

    python benchmarks/bench_generate.py                       # L = 256, 2048, 16384; 1 thread
    python benchmarks/bench_generate.py --contexts 256 2048 --threads 2

Writes benchmarks/results/generate.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from results_file import write_results  # benchmarks/, beside this script

from k3train.config import register_configs
from k3train.inference.sampling import prefill
from k3train.models.k3.cache import MLACache
from k3train.models.kda.state import KDAState

RESULTS = Path(__file__).resolve().parent / "results" / "generate.json"


def k3_tiny(vocab_size: int = 257):
    register_configs()
    with initialize_config_module("k3train.conf", version_base="1.3"):
        node = compose("config", overrides=["model=k3_tiny"]).model
    torch.manual_seed(0)
    return instantiate(node, vocab_size=vocab_size).eval()


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure(model, context: int, decode_steps: int, full_repeats: int) -> dict:
    c = model.config
    tokens = torch.randint(0, c.vocab_size, (1, context + decode_steps + 2))
    cache = model.empty_cache(1, tokens.shape[1])
    start = time.perf_counter()
    prefill(model, tokens[:, :context], cache)
    prefill_s = time.perf_counter() - start
    kda_bytes_before = sum(s.numel() * 4 for s in cache if isinstance(s, KDAState))
    step = iter(range(context, context + decode_steps + 2))
    model.forward_cached(tokens[:, next(step)][:, None], cache)  # warm-up
    incremental = median_time(lambda: model.forward_cached(tokens[:, next(step)][:, None], cache), decode_steps)
    full = median_time(lambda: model(tokens[:, : context + 1]), full_repeats)
    kda = [s for s in cache if isinstance(s, KDAState)]
    mla = [s for s in cache if isinstance(s, MLACache)]
    kda_bytes = sum(s.numel() * 4 for s in kda)
    assert kda_bytes == kda_bytes_before, "the KDA state grew while decoding"
    per_head_kv = (
        len(mla) * mla[0].length * c.mla_n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 4
    )
    return {
        "context": context,
        "prefill_s": prefill_s,
        "incremental_ms_per_token": incremental * 1e3,
        "full_recompute_ms_per_token": full * 1e3,
        "speedup": full / incremental,
        "kda_state_bytes": kda_bytes,
        "mla_latent_cache_bytes": sum(s.numel() * 4 for s in mla),
        "mla_per_head_kv_cache_bytes": per_head_kv,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 16384])
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="1: steadiest on a shared machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = k3_tiny()
    rows = []
    print(
        f"{'context':>8} {'incremental ms/tok':>19} {'full recompute ms/tok':>22} {'speedup':>8} "
        f"{'KDA state':>10} {'MLA latent cache':>17} {'per-head K/V would be':>22}"
    )
    for context in args.contexts:
        row = measure(model, context, args.decode_steps, full_repeats=3 if context <= 4096 else 2)
        rows.append(row)
        print(
            f"{context:>8} {row['incremental_ms_per_token']:>19.2f} {row['full_recompute_ms_per_token']:>22.1f} "
            f"{row['speedup']:>7.1f}x {row['kda_state_bytes'] / 1024:>8.1f}KB "
            f"{row['mla_latent_cache_bytes'] / 1024:>15.1f}KB {row['mla_per_head_kv_cache_bytes'] / 1024:>20.1f}KB",
            flush=True,
        )
    write_results(
        RESULTS,
        {
            "model": "k3_tiny (random init, vocab 257), batch 1, fp32",
            "threads": args.threads,
            "decode_steps": args.decode_steps,
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "load_average_at_end": os.getloadavg(),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
