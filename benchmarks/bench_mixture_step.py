"""A mixture's update against a plain run's: what its per-source train losses cost a step.

    python benchmarks/bench_mixture_step.py             # k3_tiny, 3 rounds of 30 updates each way (~3 minutes)
    python benchmarks/bench_mixture_step.py --quick     # 1 round of 6 updates (a smoke test, nothing written)

Both ways train the same model on the same rows: `data=builtin`, and `data=mixture` (the shipped mixture: the built-in
corpus as its one source, weight 1), whose update step hands the model's forward a TargetLosses
(k3train/train/step.py) and sums the per-target losses by source. Each run is `python -m k3train` in its own
process, the two alternating round by round (the machine's load changes between rounds, not within a pair); a
round's figure is the median of its train events' step_time_s after the first 5 updates (warm-up). Writes
benchmarks/results/mixture_step.json (or --out) with the CPU, torch's SIMD level and the load average.

On a CPU both take linear_cross_entropy's chunked path, the per-target losses out of the same pass; on a GPU with
flash-linear-attention a mixture's loss also runs one chunked forward of the LM head without gradients beside FLA's
fused kernel (k3train/models/common/loss.py), which this CPU figure does not include.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import write_unless_quick  # benchmarks/, beside this script

from k3train.runtime.cpu import cpu_description

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "mixture_step.json"
WARMUP = 5
COMMON = [
    "model=k3_tiny", "train.log_interval=1", "train.eval_interval=0", "train.checkpoint_interval=0",
    "train.progress=lines",
]  # fmt: skip


def one_run(data: str, steps: int, run_dir: Path) -> float:
    """Median seconds per update of one run after its warm-up."""
    args = [sys.executable, "-m", "k3train", f"data={data}", f"train.max_steps={steps}", *COMMON]
    proc = subprocess.run([*args, f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"data={data}: {proc.stderr.strip().splitlines()[-1:]}")
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [e["step_time_s"] for e in events if e.get("event") == "train" and e["step"] > min(WARMUP, steps - 1)]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rounds, steps = (1, 6) if args.quick else (args.rounds, args.steps)
    load_before = os.getloadavg()
    plain, mixture = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            plain.append(one_run("builtin", steps, Path(tmp, f"plain{r}")))
            mixture.append(one_run("mixture", steps, Path(tmp, f"mixture{r}")))
            print(f"round {r}: plain {plain[-1]:.4f} s/update, mixture {mixture[-1]:.4f} s/update", flush=True)
    ratios = [m / p for m, p in zip(mixture, plain)]
    result = {
        **cpu_description(),  # the CPU model, torch's SIMD level, native bf16, the load average after
        "cores": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "model": "k3_tiny, the default batch (8 x 256), 1 process",
        "updates_per_run": steps,
        "warmup_updates": WARMUP,
        "plain_s_per_update": plain,
        "mixture_s_per_update": mixture,
        "mixture_over_plain": ratios,
        "mixture_over_plain_median": statistics.median(ratios),
    }
    print(f"mixture / plain, per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    write_unless_quick(args.out, args.quick, RESULTS, result)


if __name__ == "__main__":
    main()
