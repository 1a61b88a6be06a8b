"""KDA on one GPU: FLA's Triton chunk_kda (through k3train's fla_chunk_kda) against our pure-PyTorch chunk_kda.

Parity of outputs, final state and every gradient (fp32, and bf16 inputs against an fp32 reference), the layer with
implementation="fla" against "chunk" under bf16 autocast, then fwd+bwd time of both at a few sizes. Sized to finish
well under 8 minutes on one H200 (Triton autotuning included); stops timing new sizes past --budget-s.
Metric: FLA's own test metric, RMS(a - ref) / RMS(ref) per tensor ("err_ratio"); FLA's tests accept about 0.005
for o and 0.008-0.02 for gradients.

    python benchmarks/gpu_kda_parity.py                  # needs CUDA and pip install 'k3train[gpu]'
    python benchmarks/gpu_kda_parity.py --dry-run-cpu    # exercises this script on CPU, the per-step reference
                                                         # standing in for FLA; says nothing about FLA
Writes benchmarks/results/gpu_kda_parity.json (the dry run writes to a temporary file unless --out is given).
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
import torch.nn.functional as F

from k3train.models.kda import KimiDeltaAttention, chunk_kda, fla_chunk_kda, naive_recurrent_kda

SHAPE_KEYS = ("B", "T", "H", "HV", "K", "V")
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def make_inputs(B, T, H, HV, K, V, device, dtype, seed=0) -> list[torch.Tensor]:
    """As the layer produces them: L2-normalised q, k; g <= 0 in fp32; beta in (0, 1); an fp32 initial state."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen))
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = 0.1 * torch.randn(B, HV, K, V, generator=gen)
    cast = [dtype, dtype, dtype, torch.float32, dtype, torch.float32]
    return [x.to(device=device, dtype=dt).requires_grad_() for x, dt in zip((q, k, v, g, beta, h0), cast)]


def fwd_bwd(fn: Callable, inputs: list[torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    for x in inputs:
        x.grad = None
    o, S = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
    dS = torch.randn(S.shape, generator=gen).to(S.device, S.dtype)
    ((o * do).sum() + (S * dS).sum()).backward()
    return dict(zip(NAMES, [o.detach(), S.detach()] + [x.grad for x in inputs]))


def err_ratio(a: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (a.double() - ref.double()).square().mean().sqrt()
    return (diff / ref.double().square().mean().sqrt().clamp(min=1e-30)).item()


def compare(a: dict, ref: dict) -> dict[str, float]:
    return {name: err_ratio(a[name], ref[name]) for name in NAMES}


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


def guarded(report: dict, key: str, check: Callable[[], object]) -> None:
    """Run one check; record its result or the error, so one failure does not lose the rest of the run."""
    try:
        report[key] = check()
    except Exception as err:  # noqa: BLE001 - recorded and printed, the script goes on
        report[key] = {"error": f"{type(err).__name__}: {err}"}
    print(f"{key}: {json.dumps(report[key], indent=None)[:600]}", flush=True)


def op_parity(fast: Callable, device: torch.device, dtype: torch.dtype, shape: tuple) -> dict:
    B, T, H, HV, K, V = shape
    inputs = make_inputs(B, T, H, HV, K, V, device, dtype)
    # The reference sees the same (possibly bf16-rounded) values, computed in fp32.
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    return {
        "shape": dict(zip(SHAPE_KEYS, shape)),
        "dtype": str(dtype),
        "err_ratio": compare(fwd_bwd(fast, inputs), fwd_bwd(chunk_kda, ref_inputs)),
    }


def layer_parity(implementation: str, device: torch.device, d_model: int, T: int) -> dict:
    torch.manual_seed(0)
    ref = KimiDeltaAttention(d_model, n_heads=4, head_dim=d_model // 4).to(device)
    layer = KimiDeltaAttention(d_model, n_heads=4, head_dim=d_model // 4, implementation=implementation).to(device)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, T, d_model, device=device)
    results = []
    for module in (layer, ref):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = module(x)
        y.float().square().mean().backward()
        results.append((y.detach(), torch.cat([p.grad.flatten() for p in module.parameters()])))
    errors = {"y": err_ratio(results[0][0], results[1][0]), "param_grads": err_ratio(results[0][1], results[1][1])}
    return {"d_model": d_model, "T": T, "autocast": "bfloat16", "err_ratio": errors}


def speed(fast: Callable, device: torch.device, shape: tuple, dtype: torch.dtype, reps: int) -> dict:
    B, T, H, HV, K, V = shape
    inputs = make_inputs(B, T, H, HV, K, V, device, dtype)
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
    parser.add_argument("--budget-s", type=float, default=360.0, help="start no new timing after this many seconds")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    start = time.perf_counter()

    if args.dry_run_cpu:
        device, fast, implementation = torch.device("cpu"), naive_recurrent_kda, "recurrent"
        parity_shapes = [(1, 100, 2, 4, 16, 16)]
        layer_size = (64, 40)
        speed_shapes = [(1, 128, 2, 2, 32, 32)]
        out = Path(args.out or Path(tempfile.gettempdir()) / "gpu_kda_parity_dryrun.json")
    else:
        if not torch.cuda.is_available():
            sys.exit(
                "gpu_kda_parity.py needs a CUDA GPU (none found); on CPU use benchmarks/bench_kda.py, "
                "or --dry-run-cpu to exercise this script."
            )
        try:
            import fla
        except ImportError:
            sys.exit("gpu_kda_parity.py needs flash-linear-attention: pip install 'k3train[gpu]'")
        device, fast, implementation = torch.device("cuda"), fla_chunk_kda, "fla"
        # (B, T, H, HV, K, V): the CPU benchmark's shape, a GVA shape with a ragged T, the paper's head size.
        parity_shapes = [(1, 2048, 4, 4, 64, 64), (2, 1000, 4, 8, 64, 64), (2, 2048, 8, 8, 128, 128)]
        layer_size = (512, 1024)
        speed_shapes = [(4, 2048, 8, 8, 64, 64), (2, 4096, 16, 16, 128, 128), (1, 16384, 16, 16, 128, 128)]
        out = Path(args.out or Path(__file__).parent / "results" / "gpu_kda_parity.json")

    report: dict = {
        "dry_run_cpu": args.dry_run_cpu,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "fla": "naive_recurrent_kda stand-in" if args.dry_run_cpu else getattr(fla, "__version__", "?"),
    }
    for dtype in (torch.float32, torch.bfloat16):
        for i, shape in enumerate(parity_shapes):
            guarded(report, f"parity_{str(dtype)[6:]}_{i}", lambda s=shape, d=dtype: op_parity(fast, device, d, s))
    guarded(report, "layer_parity", lambda: layer_parity(implementation, device, *layer_size))
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
