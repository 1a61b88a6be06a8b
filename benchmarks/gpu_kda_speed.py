"""KDA on one GPU: fwd+bwd time and peak memory of FLA's Triton chunk_kda (through k3train's fla_chunk_kda) and of
our pure-PyTorch chunk_kda at a few sizes, bf16 inputs. Their parity (outputs, final state, every gradient) is
checked by tests/test_kda_gpu.py (`python -m pytest -m gpu`). Sized to finish in a few minutes on one H200 (Triton
autotuning included); stops timing new sizes past --budget-s.

    python benchmarks/gpu_kda_speed.py                  # needs CUDA and pip install 'k3train[gpu]'
    python benchmarks/gpu_kda_speed.py --dry-run-cpu    # exercises this script on CPU, the per-step reference
                                                        # standing in for FLA; says nothing about FLA
Writes benchmarks/results/gpu_kda_speed.json (the dry run writes to a temporary file unless --out is given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_kda import make_inputs  # benchmarks/ is on sys.path when a script there runs

from k3train.models.kda import chunk_kda, fla_chunk_kda, naive_recurrent_kda

SHAPE_KEYS = ("B", "T", "H", "K", "V")


def layer_inputs(B, T, H, K, V, device, dtype) -> list[torch.Tensor]:
    """bench_kda's inputs as the layer hands them over: q, k, v, beta in dtype; g and the initial state in fp32."""
    dtypes = [dtype, dtype, dtype, torch.float32, dtype, torch.float32]
    return [x.detach().to(device, dt).requires_grad_() for x, dt in zip(make_inputs(B, T, H, K, V), dtypes)]


def fwd_bwd(fn: Callable, inputs: list[torch.Tensor], seed: int = 1) -> None:
    for x in inputs:
        x.grad = None
    o, S = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
    dS = torch.randn(S.shape, generator=gen).to(S.device, S.dtype)
    ((o * do).sum() + (S * dS).sum()).backward()


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> list[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()  # warmup (and autotuning)
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def guarded(report: dict, key: str, measure: Callable[[], object]) -> None:
    """Run one measurement; record its result or the error, so one failure does not lose the rest of the run."""
    try:
        report[key] = measure()
    except Exception as err:  # noqa: BLE001 - recorded and printed, the script goes on
        report[key] = {"error": f"{type(err).__name__}: {err}"}
    print(f"{key}: {json.dumps(report[key], indent=None)[:600]}", flush=True)


def speed(fast: Callable, device: torch.device, shape: tuple, dtype: torch.dtype, reps: int) -> dict:
    inputs = layer_inputs(*shape, device, dtype)
    out = {"shape": dict(zip(SHAPE_KEYS, shape)), "dtype": str(dtype)}
    for name, fn in (("fla_chunk_kda", fast), ("chunk_kda", chunk_kda)):
        times = timed(lambda fn=fn: fwd_bwd(fn, inputs), device, reps)
        out[f"{name}_fwd_bwd_ms_median"] = 1e3 * statistics.median(times)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            fwd_bwd(fn, inputs)
            out[f"{name}_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["speedup_fla_over_chunk"] = out["chunk_kda_fwd_bwd_ms_median"] / out["fla_chunk_kda_fwd_bwd_ms_median"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run-cpu", action="store_true")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no new timing after this many seconds")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    start = time.perf_counter()

    if args.dry_run_cpu:
        device, fast = torch.device("cpu"), naive_recurrent_kda
        speed_shapes = [(1, 128, 2, 32, 32)]
        out = Path(args.out or Path(tempfile.gettempdir()) / "gpu_kda_speed_dryrun.json")
    else:
        if not torch.cuda.is_available():
            sys.exit(
                "gpu_kda_speed.py needs a CUDA GPU (none found); on CPU use benchmarks/bench_kda.py, "
                "or --dry-run-cpu to exercise this script."
            )
        try:
            import fla
        except ImportError:
            sys.exit("gpu_kda_speed.py needs flash-linear-attention: pip install 'k3train[gpu]'")
        device, fast = torch.device("cuda"), fla_chunk_kda
        speed_shapes = [(4, 2048, 8, 64, 64), (2, 4096, 16, 128, 128), (1, 16384, 16, 128, 128)]  # (B, T, H, K, V)
        out = Path(args.out or Path(__file__).parent / "results" / "gpu_kda_speed.json")

    report: dict = {
        "dry_run_cpu": args.dry_run_cpu,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "fla": "naive_recurrent_kda stand-in" if args.dry_run_cpu else getattr(fla, "__version__", "?"),
    }
    for i, shape in enumerate(speed_shapes):
        if time.perf_counter() - start > args.budget_s:
            report[f"speed_{i}"] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            continue
        guarded(report, f"speed_{i}", lambda s=shape: speed(fast, device, s, torch.bfloat16, args.reps))
    report["wall_s"] = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
