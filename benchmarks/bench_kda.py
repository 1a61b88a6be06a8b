"""KDA on CPU: our chunk_kda fwd+bwd against flash-linear-attention's pure-PyTorch naive_chunk_kda, side by side.

Both run on the same inputs in one process (alternating, median of several repetitions after warmup), and the
outputs, final state and every gradient are compared. Our per-step recurrent reference is timed and compared at a
shorter T. Without flash-linear-attention installed only our numbers are reported.

    python benchmarks/bench_kda.py                    # B=1, H=4, T=2048, K=V=64, fp32
    /work/fla-venv/bin/python benchmarks/bench_kda.py # an environment with flash-linear-attention[cpu]
    ... --threads 1   # on a shared machine: with 2 threads the naive path's thousands of tiny ops stall on
                      # thread barriers whenever other work runs, and the ratio swings (16x quiet, 110x loaded)

Conventions match FLA's naive ops exactly (same layout, log-space g, scale defaulting to K**-0.5, q/k used as
given), so inputs pass through unchanged. Writes benchmarks/results/kda.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from k3train.models.kda.chunk import chunk_kda
from k3train.models.kda.naive import naive_recurrent_kda

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
Result = dict[str, torch.Tensor]


def make_inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> list[torch.Tensor]:
    """Inputs as the layer produces them: L2-normalised q, k; g = logsigmoid (<= 0); beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    h0 = 0.1 * torch.randn(B, H, K, V, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


def fwd_bwd(fn: Callable, inputs: list[torch.Tensor], do: torch.Tensor, dS: torch.Tensor) -> Result:
    """One forward and backward with fixed upstream gradients; returns outputs and input gradients."""
    for x in inputs:
        x.grad = None
    o, S = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    ((o * do).sum() + (S * dS).sum()).backward()
    return dict(zip(NAMES, [o.detach(), S.detach()] + [x.grad.clone() for x in inputs]))


def max_rel_diff(a: Result, ref: Result) -> dict[str, float]:
    """Per tensor: max |a - ref| / max |ref|."""
    return {n: ((a[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in NAMES}


def format_diffs(diffs: dict[str, float]) -> str:
    return ", ".join(f"{name} {d:.1e}" for name, d in diffs.items())


def time_side_by_side(fns: dict[str, Callable[[], Result]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call for each fn, calls interleaved so machine load hits all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def load_fla_naive_chunk() -> tuple[Callable | None, str]:
    try:
        import fla
        from fla.ops.kda.naive import naive_chunk_kda
    except ImportError as err:
        return None, f"flash-linear-attention not importable ({err}); pip install 'flash-linear-attention[cpu]'"
    return naive_chunk_kda, getattr(fla, "__version__", "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--V", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--recurrent-T", type=int, default=256, help="T for the (slow) per-step reference")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kda.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = compare(args.B, args.H, args.T, args.K, args.V, args.chunk_size, args.recurrent_T, args.reps, args.warmup)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def compare(B: int, H: int, T: int, K: int, V: int, C: int, recurrent_T: int, reps: int, warmup: int) -> dict:
    """chunk_kda against FLA's naive_chunk_kda (when installed) at T, and against the per-step reference at
    recurrent_T: fwd+bwd medians and the largest differences."""

    def ours(fn_inputs, do, dS) -> Result:
        return fwd_bwd(lambda *a, **kw: chunk_kda(*a, **kw, chunk_size=C), fn_inputs, do, dS)

    inputs = make_inputs(B, T, H, K, V)
    gen = torch.Generator().manual_seed(1)
    do, dS = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    fns: dict[str, Callable[[], Result]] = {"chunk_kda": lambda: ours(inputs, do, dS)}
    fla_naive_chunk, fla_version = load_fla_naive_chunk()
    if fla_naive_chunk is not None:
        fns["fla_naive_chunk_kda"] = lambda: fwd_bwd(
            lambda *a, **kw: fla_naive_chunk(*a, **kw, chunk_size=C), inputs, do, dS
        )
    times = time_side_by_side(fns, reps, warmup)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    report: dict = {
        "config": {
            "B": B,
            "H": H,
            "T": T,
            "K": K,
            "V": V,
            "chunk_size": C,
            "dtype": "float32",
            "reps": reps,
            "warmup": warmup,
        },
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "fla": fla_version,
        },
        "fwd_bwd_seconds_median": median,
        "fwd_bwd_seconds_all": times,
    }
    print(f"B={B} H={H} T={T} K={K} V={V} chunk={C} fp32, {torch.get_num_threads()} threads, median of {reps}")
    print(f"  chunk_kda            fwd+bwd {median['chunk_kda'] * 1e3:9.1f} ms")
    if fla_naive_chunk is None:
        print(f"  {fla_version}")
    else:
        diff = max_rel_diff(fns["chunk_kda"](), fns["fla_naive_chunk_kda"]())
        ratio = median["fla_naive_chunk_kda"] / median["chunk_kda"]
        report.update(speedup_vs_fla_naive_chunk=ratio, max_rel_diff_vs_fla_naive_chunk=diff)
        print(f"  fla naive_chunk_kda  fwd+bwd {median['fla_naive_chunk_kda'] * 1e3:9.1f} ms  (fla {fla_version})")
        print(f"  speedup {ratio:.1f}x; max |ours - fla| / max |fla|: " + format_diffs(diff))

    # Our per-step reference at a shorter T (it is one Python step per token).
    Tr = recurrent_T
    short = [x.detach()[:, :Tr] for x in inputs[:5]] + [inputs[5].detach()]  # time is dim 1, h0 has none
    short = [x.clone().requires_grad_() for x in short]
    do_short = do[:, :Tr]
    rec_fns = {
        "chunk_kda": lambda: ours(short, do_short, dS),
        "naive_recurrent_kda": lambda: fwd_bwd(naive_recurrent_kda, short, do_short, dS),
    }
    rec_times = time_side_by_side(rec_fns, reps=3, warmup=1)
    rec_median = {name: statistics.median(ts) for name, ts in rec_times.items()}
    rec_diff = max_rel_diff(rec_fns["chunk_kda"](), rec_fns["naive_recurrent_kda"]())
    report["vs_naive_recurrent"] = {
        "T": Tr,
        "fwd_bwd_seconds_median": rec_median,
        "max_rel_diff": rec_diff,
        "speedup": rec_median["naive_recurrent_kda"] / rec_median["chunk_kda"],
    }
    print(
        f"T={Tr}: chunk_kda {rec_median['chunk_kda'] * 1e3:.1f} ms, naive_recurrent_kda "
        f"{rec_median['naive_recurrent_kda'] * 1e3:.1f} ms; max rel diff " + format_diffs(rec_diff)
    )
    return report


if __name__ == "__main__":
    main()
