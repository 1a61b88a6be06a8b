"""Muon + AdamW versus AdamW on k3_tiny and the built-in corpus, at equal steps, each at its best of three lrs.

Runs the sweep conf/experiment/muon_vs_adamw.yaml describes (`python -m k3train -m experiment=muon_vs_adamw`),
reads each job's metrics.jsonl, prints a table and writes benchmarks/results/muon_vs_adamw.json. The grid, the
steps and the model are the experiment's unless given here.

    python benchmarks/sweep_muon_vs_adamw.py [--steps 200] [--lrs 1e-3,3e-3,1e-2] [--model k3_tiny]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="train.max_steps (default: the experiment's)")
    parser.add_argument("--lrs", help="the lr grid, comma-separated (default: the experiment's)")
    parser.add_argument("--model", help="a conf/model option (default: the experiment's)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "muon_vs_adamw.json"))
    args = parser.parse_args()

    sweep_dir = REPO / "outputs" / "sweeps" / f"muon_vs_adamw-{time.strftime('%Y%m%d-%H%M%S')}"
    given = {"model": args.model, "optim.lr": args.lrs, "train.max_steps": args.steps}
    cmd = [
        sys.executable,
        "-m",
        "k3train",
        "-m",
        "experiment=muon_vs_adamw",
        *(f"{key}={value}" for key, value in given.items() if value is not None),
        f"hydra.sweep.dir={sweep_dir}",
    ]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    wall = time.time() - t0

    rows = []
    for job in sorted(sweep_dir.iterdir(), key=lambda p: p.name):
        if not (job / "run.json").exists():
            continue
        config = json.loads((job / "run.json").read_text())["config"]
        events = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        evals = [e for e in events if e["event"] == "eval"]
        trains = [e for e in events if e["event"] == "train"]
        rows.append(
            {
                "optimizer": config["optim"]["_target_"].rsplit(".", 1)[-1],
                "lr": config["optim"]["lr"],
                "steps": trains[-1]["step"],
                "final_train_loss": trains[-1]["loss"],
                "val_loss": evals[-1]["loss"],
                "mean_step_time_s": sum(e["step_time_s"] for e in trains) / len(trains),
            }
        )
    best = {}
    for r in rows:
        if r["optimizer"] not in best or r["val_loss"] < best[r["optimizer"]]["val_loss"]:
            best[r["optimizer"]] = r
    print(f"\n{'optimizer':<12}{'lr':>8}{'steps':>7}{'train loss':>12}{'val loss':>10}{'s/step':>8}")
    for r in sorted(rows, key=lambda r: (r["optimizer"], r["lr"])):
        mark = "  <- best" if best[r["optimizer"]] is r else ""
        print(
            f"{r['optimizer']:<12}{r['lr']:>8g}{r['steps']:>7}{r['final_train_loss']:>12.4f}{r['val_loss']:>10.4f}"
            f"{r['mean_step_time_s']:>8.3f}{mark}"
        )
    # What ran, as the jobs composed it (the experiment's values unless given above).
    model = OmegaConf.load(sweep_dir / "0" / ".hydra" / "hydra.yaml").hydra.runtime.choices.model
    lrs = ",".join(f"{lr:g}" for lr in sorted({r["lr"] for r in rows}))
    result = {
        "model": model,
        "steps": max(r["steps"] for r in rows),
        "lrs": lrs,
        "wall_s": round(wall, 1),
        "runs": rows,
        "best": best,
        "sweep_dir": str(sweep_dir),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
