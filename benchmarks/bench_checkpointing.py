"""What activation checkpointing saves and costs: peak memory and step time of one train step per mode.

    python benchmarks/bench_checkpointing.py [--model k3_small --batch 2 --seq 1024]

Each mode (none, block, selective) runs in a fresh process: the model (vocab 32768) and AdamW are built, the resident
memory is read, then one forward + backward + optimizer step runs and the process's peak resident memory
(ru_maxrss) is read; the difference is what the step added (activations, gradients, optimizer state, transients).
Gradients and optimizer state (3 x the parameters' bytes) are the same in every mode; the rest is activations and
transients, which checkpointing cuts.
Writes benchmarks/results/checkpointing.json with the CPU model and load average beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "checkpointing.json"


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def probe(mode: str, model_name: str, batch: int, seq: int) -> dict:
    import torch
    from hydra.utils import instantiate

    from k3train.config import model_option

    torch.manual_seed(0)
    cfg = model_option(model_name)
    cfg.vocab_size = 32768
    model = instantiate(cfg).train()
    model.set_activation_checkpointing(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = (torch.randint(0, 32768, (batch, seq)) for _ in range(2))
    before = rss_mib()
    t0 = time.perf_counter()
    _, loss = model(x, targets=y)
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {
        "mode": mode,
        "step_s": seconds,
        "rss_before_mib": before,
        "peak_mib": peak,
        "step_added_mib": peak - before,
        "params_mib": params,
        # beyond the gradients and AdamW's two moments (3 x the parameters): activations and transients
        "activations_mib": peak - before - 3 * params,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_small")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.model, args.batch, args.seq)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_file import write_results

    from k3train.runtime.cpu import cpu_description

    load_before = os.getloadavg()
    rows = []
    for mode in ("none", "block", "selective"):
        out = subprocess.run(
            [sys.executable, __file__, "--probe", mode, "--model", args.model, "--batch", str(args.batch),
             "--seq", str(args.seq)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{mode:<10} step {row['step_s']:6.2f} s   peak {row['peak_mib']:8.0f} MiB   "
            f"added by the step {row['step_added_mib']:8.0f} MiB (activations ~{row['activations_mib']:6.0f} MiB)",
            flush=True,
        )
    none = rows[0]
    result = {
        "model": args.model,
        "batch": args.batch,
        "seq_len": args.seq,
        "machine": cpu_description(),
        "modes": rows,
        "step_added_over_none": {r["mode"]: round(r["step_added_mib"] / none["step_added_mib"], 3) for r in rows},
        "activations_over_none": {r["mode"]: round(r["activations_mib"] / none["activations_mib"], 3) for r in rows},
        "step_time_over_none": {r["mode"]: round(r["step_s"] / none["step_s"], 3) for r in rows},
        "load_avg": [load_before, os.getloadavg()],
    }
    write_results(RESULTS, result)
    print(f"added memory over none: {result['step_added_over_none']}; activations: {result['activations_over_none']}")
    print(f"step time over none: {result['step_time_over_none']}")


if __name__ == "__main__":
    main()
