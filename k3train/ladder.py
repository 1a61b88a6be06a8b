"""python -m k3train.ladder: a scaling ladder. One model family at increasing widths (the rungs), an lr sweep at
each, then loss against training compute fitted as a power law, the best lr against size, and both predicted for
the next size up.

    python -m k3train.ladder OUT --model k3_tiny --widths 32,64,96,128 --lrs 3e-3,1e-2,3e-2 --steps 150 \\
        [--holdout 1] [--predict-width 256] [-- model.parametrization=mup hydra/launcher=submitit_slurm ...]

Each rung is one Hydra multirun (`python -m k3train -m`, whichever launcher the overrides after `--` pick: local or
SLURM) of its lrs into OUT/d<width>/lr_<lr>, with resume=auto. A job that finished (its run ended at max_steps) is
never run again: running the same command after an interruption runs only what is missing, and with --fit-only none.
The fit reads what the runs left (run.json's training FLOPs per token, metrics.jsonl's tokens and final val loss):
- loss = a * C^(-b) over each rung's best final val loss (C = training FLOPs, summed over the tokens trained),
  a least-squares line in log-log space;
- best lr = c * N^d over the rungs (N the active parameters), flagged where the best sits at an end of the grid;
- the next size's loss and best lr from both, at --predict-width (default: twice the widest rung), its C from the
  family's FLOPs per token and the last rung's tokens; --holdout K leaves the widest K rungs out of the fit and
  reports the prediction beside what they measured.
Writes OUT/ladder.json (the fit and every input) and OUT/ladder.png. Exit status 2 for bad input (one rung, widths
the family cannot take); 1 when a run failed.
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before anything loads torch (runtime/bootstrap.py)

import argparse
import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml

from k3train.config import option
from k3train.drawing import new_figure
from k3train.models.k3.config import WIDTH_FIELDS, KimiK3Config
from k3train.models.k3.flops import flops_per_token
from k3train.observe.run_manifest import read_run_json
from k3train.observe.sweep_table import read_job


@dataclass
class Job:
    lr: float
    run_dir: str
    end: str
    final_val_loss: float | None
    tokens: int
    compute: float | None  # training FLOPs over the tokens trained


@dataclass
class Rung:
    width: int
    active_params: int | None
    seq_len: int | None  # the training sequence length the FLOPs per token were counted at
    jobs: list[Job]

    def best(self) -> Job | None:
        done = [j for j in self.jobs if j.final_val_loss is not None and math.isfinite(j.final_val_loss)]
        return min(done, key=lambda j: j.final_val_loss) if done else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m k3train.ladder",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("out", type=Path, help="the ladder's folder: one sweep per rung, ladder.json, ladder.png")
    parser.add_argument("--model", default="k3_tiny", help="a conf/model option of the KimiK3 family")
    parser.add_argument("--widths", required=True, help="d_model of each rung, comma-separated, smallest first")
    parser.add_argument("--lrs", required=True, help="the lr grid every rung sweeps, comma-separated")
    parser.add_argument("--steps", type=int, required=True, help="train.max_steps of every job")
    parser.add_argument("--holdout", type=int, default=0, help="the widest rungs left out of the fit (0)")
    parser.add_argument("--predict-width", type=int, help="the d_model to predict (twice the widest rung)")
    parser.add_argument("--fit-only", action="store_true", help="run nothing: fit what the folder holds")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.overrides = argv[cut + 1 :]  # after --: what every job takes (model.*, train.*, hydra/launcher=...)
    try:
        widths = sorted({int(w) for w in args.widths.split(",")})
        lrs = sorted({float(x) for x in args.lrs.split(",")})
        if len(widths) - args.holdout < 2:
            raise ValueError(
                f"--widths={args.widths} with --holdout {args.holdout} leaves {len(widths) - args.holdout} rung(s) "
                "to fit: a ladder needs at least 2 (4 or more for a fit worth trusting)"
            )
        if args.steps < 1 or not lrs or min(lrs) <= 0:
            raise ValueError("--steps must be >= 1 and every lr > 0")
        family = family_config(args.model, args.overrides)
        predict_width = args.predict_width or 2 * widths[-1]
        for width in (*widths, predict_width):
            family.at_width(width)
    except ValueError as e:
        print(f"ladder: error: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.fit_only:
        for width in widths:
            failed += run_rung(args.out, args.model, family, width, lrs, args.steps, args.overrides)
    rungs = [read_rung(args.out, width, lrs) for width in widths]
    result = fit(rungs, args.holdout, family, predict_width, args.steps)
    result |= {"model": args.model, "overrides": args.overrides, "lrs": lrs, "steps": args.steps}
    (args.out / "ladder.json").write_text(json.dumps(result, indent=2) + "\n")
    draw(result, args.out / "ladder.png")
    print(render(result))
    print(f"wrote {args.out / 'ladder.json'} and {args.out / 'ladder.png'}")
    if failed:
        print(f"ladder: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def family_config(model: str, overrides: list[str]) -> KimiK3Config:
    """The option's KimiK3Config with the `model.*` overrides applied (vocab as the built-in corpus's: the shapes
    only decide which widths exist and the FLOPs of a predicted rung)."""
    node = option("model", model)
    if not str(node.get("_target_", "")).startswith("k3train.models.k3."):
        raise ValueError(f"--model={model}: a ladder scales the KimiK3 family's widths; give k3_tiny, k3_small, ...")
    fields = {k: v for k, v in node.items() if k != "_target_"}
    for override in overrides:
        key, _, value = override.partition("=")
        if key.startswith("model.") and key.count(".") == 1:
            fields[key[len("model.") :]] = yaml.safe_load(value) if value else None
    fields["vocab_size"] = fields.get("vocab_size") or 257
    return KimiK3Config(**fields)


def rung_overrides(family: KimiK3Config, width: int) -> list[str]:
    member = family.at_width(width)
    return [f"model.{name}={getattr(member, name)}" for name in ("d_model", *WIDTH_FIELDS) if getattr(member, name)]


def job_dir(out: Path, width: int, lr: float) -> Path:
    return out / f"d{width}" / f"lr_{lr:g}"


def run_rung(
    out: Path, model: str, family: KimiK3Config, width: int, lrs: list[float], steps: int, overrides: list[str]
) -> list[str]:
    """Run the rung's unfinished jobs as one multirun; the job directories that still did not finish."""
    missing = [lr for lr in lrs if not finished(job_dir(out, width, lr))]
    if not missing:
        print(f"rung d_model={width}: every lr finished, nothing to run", flush=True)
        return []
    cmd = [
        sys.executable,
        "-m",
        "k3train",
        "-m",
        f"model={model}",
        *rung_overrides(family, width),
        f"optim.lr={','.join(f'{lr:g}' for lr in missing)}",
        f"train.max_steps={steps}",
        "resume=auto",
        f"hydra.sweep.dir={out / f'd{width}'}",
        "hydra.sweep.subdir=lr_${optim.lr}",
        *overrides,
    ]
    print(f"rung d_model={width}: {len(missing)} of {len(lrs)} lr(s) to run\n  {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=False)
    return [str(job_dir(out, width, lr)) for lr in missing if not finished(job_dir(out, width, lr))]


def finished(run_dir: Path) -> bool:
    return run_dir.is_dir() and read_job(run_dir).end == "max_steps"


def read_rung(out: Path, width: int, lrs: list[float]) -> Rung:
    jobs, active, seq_len = [], None, None
    for lr in lrs:
        run_dir = job_dir(out, width, lr)
        if not run_dir.is_dir():
            continue
        row, run = read_job(run_dir), read_run_json(run_dir) or {}
        per_token = ((run.get("flops") or {}).get("flops_per_token") or {}).get("training")
        active = ((run.get("model") or {}).get("params") or {}).get("active", active)
        seq_len = (run.get("flops") or {}).get("seq_len", seq_len)
        compute = per_token * row.tokens if per_token and row.tokens else None
        jobs.append(Job(lr, str(run_dir), row.end, row.final_val_loss, row.tokens, compute))
    return Rung(width, active, seq_len, jobs)


def power_law(x: list[float], y: list[float]) -> dict:
    """y = coefficient * x^exponent by least squares in log-log space, with its R^2 there."""
    lx, ly = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    exponent, intercept = np.polyfit(lx, ly, 1)
    residual = ly - (intercept + exponent * lx)
    spread = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float((residual**2).sum()) / spread if spread > 0 else 1.0
    return {"coefficient": float(math.exp(intercept)), "exponent": float(exponent), "r2": r2}


def evaluate(law: dict, x: float) -> float:
    return law["coefficient"] * x ** law["exponent"]


def fit(rungs: list[Rung], holdout: int, family: KimiK3Config, predict_width: int, steps: int) -> dict:
    """The ladder's JSON: every rung and job, the two power laws, the held-out and the next-size predictions."""
    usable = [r for r in rungs if r.best() is not None and r.best().compute and r.active_params and r.seq_len]
    fitted = usable[: len(usable) - holdout] if holdout else usable
    result: dict = {"rungs": [rung_json(r) for r in rungs], "fit_widths": [r.width for r in fitted]}
    if len(fitted) < 2:
        result["fit"] = None
        result["note"] = f"{len(fitted)} rung(s) with a finished run: nothing to fit yet"
        return result
    loss_law = power_law([r.best().compute for r in fitted], [r.best().final_val_loss for r in fitted])
    lr_law = power_law([r.active_params for r in fitted], [r.best().lr for r in fitted])
    result["fit"] = {"loss_vs_compute": loss_law, "best_lr_vs_active_params": lr_law}
    result["held_out"] = [
        {
            "width": r.width,
            "compute": r.best().compute,
            "measured_loss": r.best().final_val_loss,
            "predicted_loss": evaluate(loss_law, r.best().compute),
            "relative_error": evaluate(loss_law, r.best().compute) / r.best().final_val_loss - 1,
            "measured_best_lr": r.best().lr,
            "predicted_best_lr": evaluate(lr_law, r.active_params),
        }
        for r in usable[len(fitted) :]
    ]
    last = fitted[-1]
    member = family.at_width(predict_width)
    compute = flops_per_token(member, last.seq_len)["training"] * last.best().tokens
    params = _active_params(member)
    result["prediction"] = {
        "width": predict_width,
        "active_params": params,
        "tokens": last.best().tokens,
        "compute": compute,
        "loss": evaluate(loss_law, compute),
        "best_lr": evaluate(lr_law, params),
    }
    return result


def _active_params(config: KimiK3Config) -> int:
    import torch

    from k3train.models.k3 import KimiK3

    with torch.device("meta"):
        return KimiK3(config).param_counts()["active"]


def rung_json(rung: Rung) -> dict:
    best = rung.best()
    lrs = sorted(j.lr for j in rung.jobs if j.final_val_loss is not None)
    edge = None
    if best is not None and len(lrs) > 1 and best.lr in (lrs[0], lrs[-1]):
        edge = "lowest" if best.lr == lrs[0] else "highest"
    return {
        "width": rung.width,
        "active_params": rung.active_params,
        "best_lr": best.lr if best else None,
        "best_loss": best.final_val_loss if best else None,
        "compute": best.compute if best else None,
        "best_lr_at_grid_edge": edge,  # the best may lie beyond the grid: widen it there
        "jobs": [asdict(j) for j in rung.jobs],
    }


def render(result: dict) -> str:
    lines = [f"{'d_model':>8} {'active params':>14} {'best lr':>9} {'val loss':>9} {'compute':>10}  note"]
    for r in result["rungs"]:
        note = f"best lr at the {r['best_lr_at_grid_edge']} end of the grid" if r["best_lr_at_grid_edge"] else ""
        if r["best_loss"] is None:
            lines.append(f"{r['width']:>8} {'':>14} {'':>9} {'':>9} {'':>10}  no finished run")
            continue
        lines.append(
            f"{r['width']:>8} {r['active_params']:>14,} {r['best_lr']:>9.3g} {r['best_loss']:>9.4f} "
            f"{r['compute']:>10.3g}  {note}"
        )
    if not result.get("fit"):
        return "\n".join([*lines, result.get("note", "")])
    loss, lr = result["fit"]["loss_vs_compute"], result["fit"]["best_lr_vs_active_params"]
    lines.append(f"loss = {loss['coefficient']:.4g} * C^{loss['exponent']:.4f} (R^2 {loss['r2']:.3f})")
    lines.append(f"best lr = {lr['coefficient']:.4g} * N^{lr['exponent']:.4f} (R^2 {lr['r2']:.3f})")
    for h in result["held_out"]:
        lines.append(
            f"held out d_model={h['width']}: predicted loss {h['predicted_loss']:.4f}, measured "
            f"{h['measured_loss']:.4f} ({100 * h['relative_error']:+.2f}%); best lr predicted "
            f"{h['predicted_best_lr']:.3g}, measured {h['measured_best_lr']:.3g}"
        )
    p = result["prediction"]
    lines.append(
        f"next size d_model={p['width']} ({p['active_params']:,} active params, C {p['compute']:.3g}): "
        f"loss {p['loss']:.4f}, best lr {p['best_lr']:.3g}"
    )
    return "\n".join(lines)


def draw(result: dict, path: Path) -> None:
    fig = new_figure(path, figsize=(16, 4.8), layout="constrained")
    if fig is None:
        return
    left, middle, right = fig.subplots(1, 3)
    for r in result["rungs"]:
        done = sorted((j["lr"], j["final_val_loss"]) for j in r["jobs"] if j["final_val_loss"] is not None)
        if done:
            middle.plot(*zip(*done), marker="o", label=f"d_model {r['width']}")
    middle.set(xscale="log", xlabel="lr", ylabel="final val loss", title="each rung's lr sweep")
    middle.legend(fontsize=8)
    best = [r for r in result["rungs"] if r["best_loss"] is not None]
    fitted = set(result.get("fit_widths", []))
    for r in best:
        left.scatter(r["compute"], r["best_loss"], color="C0" if r["width"] in fitted else "C3", zorder=3)
        right.scatter(r["active_params"], r["best_lr"], color="C0" if r["width"] in fitted else "C3", zorder=3)
    if result.get("fit"):
        p = result["prediction"]
        loss, lr = result["fit"]["loss_vs_compute"], result["fit"]["best_lr_vs_active_params"]
        c = np.geomspace(min(r["compute"] for r in best), p["compute"], 50)
        left.plot(c, [evaluate(loss, x) for x in c], "k--", label=f"fit: C^{loss['exponent']:.3f}")
        left.scatter(p["compute"], p["loss"], marker="*", s=150, color="C2", label=f"predicted d_model {p['width']}")
        n = np.geomspace(min(r["active_params"] for r in best), p["active_params"], 50)
        right.plot(n, [evaluate(lr, x) for x in n], "k--", label=f"fit: N^{lr['exponent']:.3f}")
        right.scatter(p["active_params"], p["best_lr"], marker="*", s=150, color="C2", label="predicted")
        left.legend(fontsize=8)
        right.legend(fontsize=8)
    left.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="best final val loss", title="loss vs compute")
    right.set(xscale="log", yscale="log", xlabel="active parameters", ylabel="best lr", title="best lr vs size")
    fig.suptitle("scaling ladder (blue: fitted rungs, red: held out)")
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
