"""A scaling ladder on the built-in corpus: does a power law fitted on 4 rungs predict the 5th rung's loss?

    python benchmarks/bench_ladder.py [--widths 32,64,96,128,160] [--lrs 5e-3,1e-2,2e-2] [--steps 150]

Runs `python -m k3train.ladder` (k3_tiny's family under mup, tuned at the smallest width, every rung the same
tokens) with --holdout 1, so the widest rung is measured but left out of the fit, and copies its ladder.json into
benchmarks/results/ladder.json with the CPU and its load. The issue's target: the held-out loss predicted within
3%. Finished runs are kept under --dir: a rerun only fits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mup_transfer import COMMON, cpu_model  # noqa: E402
from results_file import write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="k3_tiny")
    parser.add_argument("--widths", default="32,64,96,128,160")
    parser.add_argument("--lrs", default="5e-3,1e-2,2e-2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dir", type=Path, default=REPO / "outputs" / "ladder_k3_tiny")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ladder.json")
    args = parser.parse_args()
    base = args.widths.split(",")[0]
    cmd = [sys.executable, "-m", "k3train.ladder", str(args.dir), f"--model={args.model}", f"--widths={args.widths}"]
    cmd += [f"--lrs={args.lrs}", f"--steps={args.steps}", "--holdout=1", "--"]
    cmd += ["model.parametrization=mup", f"model.mup_base_width={base}", *COMMON]
    print(" ".join(cmd), flush=True)
    load_before, t0 = os.getloadavg()[0], time.time()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    ladder = json.loads((args.dir / "ladder.json").read_text())
    result = {
        "cpu_model": cpu_model(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "wall_s": round(time.time() - t0, 1),
        "command": " ".join(cmd[1:]),
        **ladder,
    }
    for held in ladder.get("held_out", []):
        print(
            f"d_model {held['width']}: predicted {held['predicted_loss']:.4f}, measured {held['measured_loss']:.4f} "
            f"({100 * held['relative_error']:+.2f}%)"
        )
    write_results(args.out, result)


if __name__ == "__main__":
    main()
