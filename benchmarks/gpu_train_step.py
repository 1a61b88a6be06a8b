"""k3_small train-step throughput on one GPU: bf16 autocast, Muon + AdamW, KDA through FLA and through chunk.

Times the real update (forward, backward, grad clip, MuonAdamW step, QK-Clip) on random tokens after warm-up, for
each KDA implementation, and reports tokens/s, peak memory and model FLOP utilisation (the model's training FLOPs
per token, k3train/models/k3/flops.py, against the GPU's datasheet peak for the dtype, k3train/observe/mfu.py).
Sized to finish in about 3 minutes on one H200; stops starting new cases past --budget-s.

    python benchmarks/gpu_train_step.py                 # needs CUDA (and k3train[gpu] for the fla case)
    python benchmarks/gpu_train_step.py --dry-run-cpu   # exercises this script on CPU with k3_tiny, tiny shapes

The whole GPU check is one command (the parity tests, then the timings):
    python -m pytest -m gpu && python benchmarks/gpu_kda_speed.py --budget-s 200 && \
        python benchmarks/gpu_train_step.py --budget-s 150
Writes benchmarks/results/gpu_train_step.json (the dry run writes to a temporary file unless --out is given).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from k3train.observe.mfu import resolve_peak
from k3train.optim import qk_clip
from k3train.optim.build import muon_adamw

ROOT = Path(__file__).resolve().parents[1]


def build(model_name: str, vocab: int, implementation: str, device: torch.device):
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{model_name}.yaml")
    cfg.vocab_size, cfg.kda_implementation = vocab, implementation
    torch.manual_seed(0)
    model = instantiate(cfg).to(device).train()
    optimizer = muon_adamw(
        model,
        lr=3e-3,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        eps=1e-8,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        rms_match=0.2,
        head_wise=True,
        orthogonality_check_interval=10**9,
    )  # diagnostics off: time the update alone
    return model, optimizer


def run_case(
    model_name: str,
    vocab: int,
    B: int,
    T: int,
    implementation: str,
    device: torch.device,
    steps: int,
    dtype: torch.dtype,
) -> dict:
    model, optimizer = build(model_name, vocab, implementation, device)
    qk_clip.set_max_logit_tracking(model, True)
    x = torch.randint(0, vocab, (B, T), device=device)
    y = torch.randint(0, vocab, (B, T), device=device)

    def step() -> float:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(x, targets=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        qk_clip.qk_clip_(model, 100.0)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # a sync point: the step is finished when this returns

    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    tokens_per_s = B * T / median
    result = {
        "model": model_name,
        "kda_implementation": implementation,
        "B": B,
        "T": T,
        "dtype": str(dtype),
        "step_s_median": median,
        "step_s_all": times,
        "tokens_per_s": tokens_per_s,
        "params": model.param_counts(),
        "model_flops_per_token": model.flops_per_token(T)["training"],
    }
    peak = resolve_peak(None, device, {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"))
    result.update(peak_flops_per_s=peak.flops_per_s, peak_source=peak.source)
    if peak.flops_per_s:
        result["mfu"] = tokens_per_s * result["model_flops_per_token"] / peak.flops_per_s
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(
        f"{model_name} kda={implementation:9s} B={B} T={T}: {median * 1e3:8.1f} ms/step  "
        f"{tokens_per_s:10,.0f} tok/s"
        + (f"  MFU {result['mfu']:.1%}" if "mfu" in result else "")
        + (f"  peak {result['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in result else ""),
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run-cpu", action="store_true")
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no new case after this many seconds")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.dry_run_cpu:
        device, dtype, model_name, vocab = torch.device("cpu"), torch.float32, "k3_tiny", 257
        cases, implementations = [(2, 64)], ["chunk"]
        out = Path(args.out or tempfile.mkstemp(suffix=".json")[1])
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_train_step.py needs CUDA (use --dry-run-cpu to exercise it on CPU)")
        device, dtype, model_name, vocab = torch.device("cuda"), torch.bfloat16, "k3_small", 32768
        cases, implementations = [(8, 2048), (16, 2048)], ["fla", "chunk"]
        out = Path(args.out or ROOT / "benchmarks" / "results" / "gpu_train_step.json")

    start, results, errors = time.time(), [], {}
    for B, T in cases:
        for implementation in implementations:
            if time.time() - start > args.budget_s:
                errors[f"{implementation}/B{B}/T{T}"] = "skipped: time budget spent"
                continue
            try:
                results.append(run_case(model_name, vocab, B, T, implementation, device, args.steps, dtype))
            except Exception as exc:  # noqa: BLE001 - record and go on: one failure must not hide the others
                errors[f"{implementation}/B{B}/T{T}"] = f"{type(exc).__name__}: {exc}"
                print(f"{implementation} B={B} T={T}: {errors[f'{implementation}/B{B}/T{T}']}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "results": results, "errors": errors}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
