"""Does the best lr transfer across width? A 5-point lr grid at width w and at 4w, under standard and under mup
(model.parametrization=mup with mup_base_width=w: tuned at w), on the built-in corpus, each through the scaling
ladder (python -m k3train.ladder), so finished runs are kept and a rerun only fits.

    python benchmarks/bench_mup_transfer.py [--widths 32,128] [--lrs 2.5e-3,5e-3,1e-2,2e-2,4e-2] [--steps 150]

The figure of merit is how many grid points the best lr moves from w to 4w: the issue asks for 0 or 1 under mup
and more under standard. At w the two parametrizations are the same model, so their losses there must be equal,
which the script checks. Writes benchmarks/results/mup_transfer.json with the CPU and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COMMON = ["train.eval_interval=0", "train.checkpoint_interval=0", "train.progress=lines"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="k3_tiny")
    parser.add_argument("--widths", default="32,128", help="w,4w")
    parser.add_argument("--lrs", default="2.5e-3,5e-3,1e-2,2e-2,4e-2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dir", type=Path, default=REPO / "outputs" / "mup_transfer", help="the ladders' folder")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "mup_transfer.json")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    grid = sorted(float(x) for x in args.lrs.split(","))
    load_before, t0 = os.getloadavg()[0], time.time()
    ladders = {}
    for parametrization in ("standard", "mup"):
        out = args.dir / parametrization
        cmd = [
            sys.executable,
            "-m",
            "k3train.ladder",
            str(out),
            f"--model={args.model}",
            f"--widths={args.widths}",
            f"--lrs={args.lrs}",
            f"--steps={args.steps}",
            "--",
            f"model.parametrization={parametrization}",
            f"model.mup_base_width={widths[0]}",
            *COMMON,
        ]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        ladders[parametrization] = json.loads((out / "ladder.json").read_text())
    result = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "wall_s": round(time.time() - t0, 1),
        "model": args.model,
        "widths": widths,
        "lrs": grid,
        "steps": args.steps,
    }
    for parametrization, ladder in ladders.items():
        rungs = {r["width"]: r for r in ladder["rungs"]}
        losses = {w: {j["lr"]: j["final_val_loss"] for j in rungs[w]["jobs"]} for w in widths}
        best = {w: grid.index(rungs[w]["best_lr"]) for w in widths}
        result[parametrization] = {
            "val_loss": {str(w): {f"{lr:g}": losses[w][lr] for lr in grid} for w in widths},
            "best_lr": {str(w): rungs[w]["best_lr"] for w in widths},
            "best_lr_at_grid_edge": {str(w): rungs[w]["best_lr_at_grid_edge"] for w in widths},
            "grid_points_moved": abs(best[widths[-1]] - best[widths[0]]),
        }
    base = widths[0]
    same = result["standard"]["val_loss"][str(base)] == result["mup"]["val_loss"][str(base)]
    result["equal_at_base_width"] = same
    print(json.dumps({p: result[p]["best_lr"] | {"moved": result[p]["grid_points_moved"]} for p in ladders}))
    print(f"equal losses at the base width {base}: {same}")
    write_results(args.out, result)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
