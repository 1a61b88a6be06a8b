"""Train-step throughput and MFU of k3_tiny and k3_small on CPU: forward + backward + optimizer step.

    python benchmarks/bench_model.py [--steps 5]
Builds each model from its conf/model YAML (vocab 257, the byte-level built-in corpus), times `steps` train steps
after 2 warm-up steps on random tokens, and writes benchmarks/results/model.json: median step time (forward +
backward, and the optimizer step), tokens/s, the total/active/embedding parameters, the model's training FLOPs per
token (k3train/models/k3/flops.py) and MFU against this CPU's calibrated fp32 matmul peak (k3train/observe/mfu.py),
with and without the optimizer step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from results_file import write_results  # benchmarks/, beside this script

from k3train.config import model_option
from k3train.observe.mfu import calibrate_cpu_matmul
from k3train.runtime.cpu import prepare_cpu_training

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
RESULTS = Path(__file__).resolve().parent / "results" / "model.json"
CASES = [  # (config, vocab_size, batch, seq_len)
    ("k3_tiny", 257, 8, 256),
    ("k3_small", 32768, 2, 1024),  # the target: MFU at seq_len 1024
]


def build_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    return instantiate(OmegaConf.load(CONF.parent / "optim" / f"{name}.yaml"))(model)


def bench_case(name: str, vocab: int, B: int, T: int, steps: int, optimizer: str = "adamw") -> dict:
    torch.manual_seed(0)
    cfg = model_option(name)
    cfg.vocab_size = vocab
    model = instantiate(cfg).train()
    model.check_data(vocab, T)
    opt = build_optimizer(model, optimizer)
    x, y = torch.randint(0, vocab, (B, T)), torch.randint(0, vocab, (B, T))
    fwd_bwd, step, peaks = [], [], []
    for i in range(steps + 2):
        peaks.append(calibrate_cpu_matmul(torch.float32, budget_s=0.5))  # side by side: load hits both alike
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            fwd_bwd.append(t1 - t0)
            step.append(time.perf_counter() - t1)
    fwd_bwd_s, opt_s = statistics.median(fwd_bwd), statistics.median(step)
    flops = model.flops_per_token(T)["training"]
    peak = statistics.median(peaks[2:])  # medians of both: measured side by side, under the same load
    result = {
        "batch": B,
        "seq_len": T,
        "vocab_size": vocab,
        "optimizer": optimizer,
        "steps_timed": steps,
        "fwd_bwd_s_median": fwd_bwd_s,
        "optimizer_step_s_median": opt_s,
        "step_seconds_median": fwd_bwd_s + opt_s,
        "tokens_per_s": B * T / (fwd_bwd_s + opt_s),
        "training_flops_per_token": flops,
        "peak_flops_per_s": peak,
        "peak_source": "fp32 matmul calibrated before each timed step, median",
        "peak_flops_per_s_all": peaks,
        "mfu": B * T * flops / (fwd_bwd_s + opt_s) / peak,
        "mfu_fwd_bwd_only": B * T * flops / fwd_bwd_s / peak,
        "threads": torch.get_num_threads(),
        "load_avg": os.getloadavg(),
        **model.param_counts(),
    }
    print(
        f"{name:9s} B={B} T={T} {optimizer}: {fwd_bwd_s:.3f} + {opt_s:.3f} s/step, "
        f"{result['tokens_per_s']:8.0f} tokens/s, MFU {result['mfu']:.1%} ({result['mfu_fwd_bwd_only']:.1%} "
        f"without the optimizer step) of {peak / 1e9:.1f} GFLOP/s; params total "
        f"{result['total'] / 1e6:.2f}M, active {result['active'] / 1e6:.2f}M",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    prepare_cpu_training()  # as training on a CPU does
    out = {
        "benchmark": "train step (fwd + bwd + AdamW), fp32, CPU, random tokens, MFU of the calibrated fp32 peak",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_at_start": os.getloadavg(),
        "cases": {name: bench_case(name, vocab, B, T, args.steps) for name, vocab, B, T in CASES},
    }
    write_results(RESULTS, out)


if __name__ == "__main__":
    main()
