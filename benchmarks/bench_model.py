"""Train-step throughput of k3_tiny and k3_small on CPU: forward + backward + AdamW step, tokens per second.

    python benchmarks/bench_model.py [--steps 5]
Builds each model from its conf/model YAML (vocab 257 for k3_tiny, the byte-level built-in corpus; 32768 for
k3_small), times `steps` train steps after 2 warm-up steps on random tokens, and writes
benchmarks/results/model.json with the median step time, tokens/s and the total/active/embedding parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
RESULTS = Path(__file__).resolve().parent / "results" / "model.json"
CASES = [  # (config, vocab_size, batch, seq_len)
    ("k3_tiny", 257, 8, 256),
    ("k3_small", 32768, 2, 512),
]


def bench_case(name: str, vocab: int, B: int, T: int, steps: int) -> dict:
    torch.manual_seed(0)
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.vocab_size = vocab
    model = instantiate(cfg).train()
    model.check_data(vocab, T)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    x, y = torch.randint(0, vocab, (B, T)), torch.randint(0, vocab, (B, T))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    result = {"batch": B, "seq_len": T, "vocab_size": vocab, "steps_timed": steps, "step_seconds_median": step_s,
              "step_seconds_all": times, "tokens_per_s": B * T / step_s, **model.param_counts()}
    print(f"{name:9s} B={B} T={T}: {step_s:.3f} s/step, {result['tokens_per_s']:8.0f} tokens/s; params total "
          f"{result['total'] / 1e6:.2f}M, active {result['active'] / 1e6:.2f}M, embedding {result['embedding'] / 1e6:.2f}M")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    out = {
        "benchmark": "train step (fwd + bwd + AdamW), fp32, CPU, random tokens",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "load_avg_at_start": os.getloadavg(),
        "cases": {name: bench_case(name, vocab, B, T, args.steps) for name, vocab, B, T in CASES},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
