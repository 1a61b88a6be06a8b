"""Muon's share of a train step on CPU: forward+backward, then optimizer.step() split into its param groups.

    python benchmarks/bench_muon.py                      # k3_small, batch 2 x 128 tokens
    python benchmarks/bench_muon.py --model k3_tiny --batch-size 4 --seq-len 256

Builds the model from conf/model/<model>.yaml and MuonAdamW from conf/optim/muon_adamw.yaml, feeds random tokens
(timing does not depend on the data), and reports medians over the timed steps. Per-group times come from running
the optimizer's own per-group update (the loop inside MuonAdamW.step) one group at a time, interleaved with whole
step() calls so that both are measured side by side (each iteration thus applies the same gradients twice, which
changes nothing about the cost); torch.optim.AdamW over the same model is the baseline.
Writes benchmarks/results/muon.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import hydra
import torch
from omegaconf import OmegaConf
from results_file import write_results  # benchmarks/, beside this script

from k3train.config import model_option
from k3train.optim.muon import MuonAdamW, as_matrices
from k3train.optim.summary import format_param_groups

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    return hydra.utils.instantiate(OmegaConf.load(ROOT / "conf" / "optim" / f"{name}.yaml"))(model)


def newton_schulz_flops(opt: MuonAdamW) -> int:
    """Matmul FLOPs of one step's Newton-Schulz: per matrix [a, b] (a <= b) and iteration, X X^T (2a^2 b),
    gram^2 (2a^3) and poly X (2a^2 b)."""
    total = 0
    for g in opt.param_groups:
        if g["kind"] != "muon":
            continue
        for p, split in zip(g["params"], g["head_splits"]):
            n, *dims = as_matrices(p.detach(), split).shape
            a, b = sorted(dims)
            total += g["ns_steps"] * n * (4 * a * a * b + 2 * a**3)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_small", help="a conf/model/<name>.yaml")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=257, help="the built-in byte-level corpus has 257")
    ap.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads; 1 keeps numbers stable on a shared machine")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "muon.json")
    args = ap.parse_args()
    path = ROOT / "conf" / "model" / f"{args.model}.yaml"
    if not path.exists():
        raise SystemExit(f"no model config {path}; pick one of {sorted(p.stem for p in path.parent.glob('*.yaml'))}")
    torch.set_num_threads(args.threads)
    result = muon_share(args.model, args.batch_size, args.seq_len, args.vocab_size, args.steps)
    write_results(args.out, result, echo=True)


def muon_share(model_name: str, batch_size: int, seq_len: int, vocab_size: int, steps: int) -> dict:
    """Medians over `steps` steps (after 2 warm-up ones) of fwd+bwd, MuonAdamW.step(), each of its groups alone,
    and AdamW.step() over the same model; Muon's share of the train step and its Newton-Schulz GFLOP/s."""
    cfg = model_option(model_name)
    cfg.vocab_size = vocab_size
    torch.manual_seed(0)
    model = hydra.utils.instantiate(cfg)
    opt = _optimizer(model, "muon_adamw")
    assert isinstance(opt, MuonAdamW)
    baseline = _optimizer(model, "adamw")
    x = torch.randint(vocab_size, (batch_size, seq_len))
    y = torch.randint(vocab_size, (batch_size, seq_len))
    print(format_param_groups(opt.param_groups))

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        _, loss = model(x, targets=y)
        loss.backward()

    def group_update(group: dict) -> None:  # what MuonAdamW.step() does for one group
        (opt._muon_step if group["kind"] == "muon" else opt._adamw_step)(group)

    times: dict[str, list[float]] = {}
    for i in range(2 + steps):
        sample = {"fwd_bwd": _timed(fwd_bwd), "step_muon_adamw": _timed(opt.step)}
        with torch.no_grad():
            for g in opt.param_groups:
                sample[f"group/{g['name']}"] = _timed(lambda g=g: group_update(g))
        sample["step_adamw_baseline"] = _timed(baseline.step)
        if i >= 2:
            for k, v in sample.items():
                times.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    muon = sum(v for k, v in med.items() if k.startswith("group/muon"))
    adamw = sum(v for k, v in med.items() if k.startswith("group/adamw"))
    train_step = med["fwd_bwd"] + med["step_muon_adamw"]
    n_muon = sum(p.numel() for g in opt.param_groups if g["kind"] == "muon" for p in g["params"])
    n_total = sum(p.numel() for p in model.parameters())
    result = {
        "model": model_name,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "timed_steps": steps,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "params_total": n_total,
        "params_muon": n_muon,
        "median_s": {k: round(v, 5) for k, v in med.items()},
        "muon_groups_s": round(muon, 5),
        "adamw_groups_s": round(adamw, 5),
        "muon_newton_schulz_gflop": round(newton_schulz_flops(opt) / 1e9, 2),
        "muon_achieved_gflop_per_s": round(newton_schulz_flops(opt) / 1e9 / muon, 1),
        "muon_share_of_train_step": round(muon / train_step, 4),
        "muon_share_of_optimizer_step": round(muon / (muon + adamw), 4),
        "optimizer_step_vs_adamw_baseline": round(med["step_muon_adamw"] / med["step_adamw_baseline"], 2),
    }
    return result


if __name__ == "__main__":
    main()
