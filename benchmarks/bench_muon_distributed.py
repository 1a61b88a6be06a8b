"""Muon's Newton-Schulz per step on 1 rank against the same work spread over N gloo ranks (k3_small by default).

    python benchmarks/bench_muon_distributed.py                  # 1 rank vs 2 ranks, threads = cores / ranks
    python benchmarks/bench_muon_distributed.py --model k3_tiny --ranks 1 2 --steps 3

Builds the model from conf/model/<model>.yaml and MuonAdamW from conf/optim/muon_adamw.yaml, gives every Muon
parameter the same random gradient on every rank (what DDP's all-reduce leaves; timing does not depend on the
values), and times MuonAdamW's update of the Muon groups (momentum, Newton-Schulz, the all-gather, applying the
update), split into this rank's Newton-Schulz compute and the all-gather. Each configuration gets torch threads =
CPU cores / ranks, so 1 and N ranks use the same cores. Medians over the timed steps, the slowest rank's figure.
The machine's load average is recorded before and after each configuration: on a shared machine it is part of
the result. Writes benchmarks/results/muon_distributed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

# As `python -m k3train` does (k3train/runtime/cpu.py), before torch loads OpenMP: idle threads sleep instead of
# spinning, which keeps a 2-thread rank near its fair share on a machine that other processes also use.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hydra  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from k3train.config import model_option  # noqa: E402
from k3train.optim import muon as muon_module  # noqa: E402
from k3train.optim import muon_distributed  # noqa: E402
from k3train.optim.muon import MuonAdamW  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Stopwatch:
    """Accumulates the time spent inside a wrapped function."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def _muon_optimizer(args: argparse.Namespace) -> MuonAdamW:
    cfg = model_option(args.model)
    cfg.vocab_size = args.vocab_size
    torch.manual_seed(0)
    model = hydra.utils.instantiate(cfg)
    opt = hydra.utils.instantiate(OmegaConf.load(ROOT / "conf" / "optim" / "muon_adamw.yaml"), ns_dtype=args.ns_dtype)(
        model
    )
    gen = torch.Generator().manual_seed(1)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen) if group["kind"] == "muon" else None
    return opt


def _time_steps(opt: MuonAdamW, steps: int) -> dict[str, float]:
    """Medians over `steps` timed updates (after one warm-up) of the Muon groups, in seconds."""
    newton_schulz = muon_module.zeropower_via_newtonschulz5 = Stopwatch(muon_module.zeropower_via_newtonschulz5)
    gather = muon_distributed._all_gather_single = Stopwatch(muon_distributed._all_gather_single)
    samples: dict[str, list[float]] = {"muon_update_s": [], "newton_schulz_s": [], "all_gather_s": []}
    for i in range(1 + steps):
        newton_schulz.seconds = gather.seconds = 0.0
        t0 = time.perf_counter()
        with torch.no_grad():
            for group in opt.param_groups:
                if group["kind"] == "muon":
                    opt._muon_step(group)
        if i:
            samples["muon_update_s"].append(time.perf_counter() - t0)
            samples["newton_schulz_s"].append(newton_schulz.seconds)
            samples["all_gather_s"].append(gather.seconds)
    return {k: statistics.median(v) for k, v in samples.items()}


def _rank_main(rank: int, world_size: int, args: argparse.Namespace, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(args.threads_per_rank)
    if world_size > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
        )
    try:
        opt = _muon_optimizer(args)
        if world_size > 1:
            dist.barrier()
        result = _time_steps(opt, args.steps)
        result["matrices_parameters"] = sum(len(g["params"]) for g in opt.param_groups if g["kind"] == "muon")
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def _measure(world_size: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        load_before = os.getloadavg()
        mp.spawn(_rank_main, args=(world_size, args, str(Path(tmp) / "init"), tmp), nprocs=world_size)
        load_after = os.getloadavg()
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]
    slowest = {k: round(max(r[k] for r in ranks), 4) for k in ("muon_update_s", "newton_schulz_s", "all_gather_s")}
    return {
        "ranks": world_size,
        "threads_per_rank": args.threads_per_rank,
        **slowest,
        "newton_schulz_s_per_rank": [round(r["newton_schulz_s"], 4) for r in ranks],
        "load_average_1_5_15_before": [round(x, 2) for x in load_before],
        "load_average_1_5_15_after": [round(x, 2) for x in load_after],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_small", help="a conf/model/<name>.yaml")
    ap.add_argument("--vocab-size", type=int, default=257, help="the built-in byte-level corpus has 257")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes to compare")
    ap.add_argument("--steps", type=int, default=3, help="timed steps, after 1 warm-up step")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="cores shared out among the ranks")
    ap.add_argument(
        "--ns-dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="fp32: what optim.ns_dtype=auto picks on a CPU without native bf16",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "muon_distributed.json")
    args = ap.parse_args()
    if not (ROOT / "conf" / "model" / f"{args.model}.yaml").exists():
        raise SystemExit(f"no model config conf/model/{args.model}.yaml")

    runs = []
    for world_size in args.ranks:
        args.threads_per_rank = max(1, args.cores // world_size)
        print(
            f"{args.model}: {world_size} rank(s) x {args.threads_per_rank} torch thread(s) "
            f"(threads = {args.cores} cores / {world_size} ranks, so every configuration uses the same cores)"
        )
        runs.append(_measure(world_size, args))
        print(json.dumps(runs[-1]))
    base = runs[0]["muon_update_s"]
    result = {
        "model": args.model,
        "ns_dtype": args.ns_dtype,
        "timed_steps": args.steps,
        "cores": args.cores,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "backend": "gloo",
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "what": "seconds per step of MuonAdamW's Muon groups (momentum, Newton-Schulz, all-gather, apply), the "
        "slowest rank, median; newton_schulz_s is that rank's own Newton-Schulz compute",
        "runs": runs,
        "speedup_vs_first": {str(r["ranks"]): round(base / r["muon_update_s"], 2) for r in runs},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = ", ".join(f"{r['ranks']} rank(s) {r['muon_update_s']} s" for r in runs)
    print(f"Muon groups' update per step (slowest rank, median): {summary}; wrote {args.out}")


if __name__ == "__main__":
    main()
