"""The pipeline's bubble on CPU ranks: k3_tiny cut into 2 stages over 2 gloo ranks (one thread each), against one
process (one thread) accumulating the same micro-batches, for gpipe and 1f1b at m = 2, 4, 8 micro-batches.

    python benchmarks/bench_pp.py            # ~2 minutes on 2 cores
    python benchmarks/bench_pp.py --quick    # one m, two updates: a smoke test; writes nothing unless --out

An update's time t_pp on the pipeline and t_1 in one process (the median of the timed updates, after one warm-up,
forward, backward and no optimizer step). With the work split evenly and nothing idle, t_pp would be t_1 / pp; the
measured bubble is 1 - t_1 / (pp x t_pp). Beside it, the planner's (k3train/plan/pipeline.py, asked with the same
config: `python -m k3train.plan model=k3_tiny model.vocab_size=257 parallel.pp=2 parallel.pp_schedule=S
train.batch_size=2 train.seq_len=128 train.gradient_accumulation_steps=m`): the schedule's idle share (its bubble,
(pp - 1) / (m + pp - 1) for both schedules), and the idle share the plan's step implies once its stages are uneven
as the plan counts them (each stage's layers' FLOPs, the head's on the last: 1 - (1 - bubble) x the mean stage's
work / the slowest stage's). The measured figure also holds what the plan leaves out: what its FLOPs do not count
(norms, the mixes, the loss's elementwise work, the embedding), the activations travelling between processes
(gloo over loopback), and both ranks sharing the machine with whatever else runs.
Writes benchmarks/results/pp.json (or --out) with the CPU, torch's SIMD level and the load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
RESULTS = HERE / "results" / "pp.json"
ROWS, SEQ = 2, 128  # a micro-batch


def _model():
    from hydra.utils import instantiate

    from k3train.config import model_option

    torch.manual_seed(0)
    cfg = model_option("k3_tiny")
    cfg.vocab_size = 257
    return instantiate(cfg).train()


def planned(schedule: str, m: int) -> dict:
    """The planner's figures for this benchmark's run: the schedule's bubble, and the idle share with the plan's
    uneven stages."""
    from hydra import compose, initialize_config_module

    from k3train.config import register_configs
    from k3train.plan.pipeline import plan_pipeline, stage_spec
    from k3train.plan.spec import build_spec

    overrides = [
        "model=k3_tiny",
        "model.vocab_size=257",
        "parallel.pp=2",
        f"parallel.pp_schedule={schedule}",
        f"train.batch_size={ROWS}",
        f"train.seq_len={SEQ}",
        f"train.gradient_accumulation_steps={m}",
    ]
    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        spec = build_spec(compose(config_name="config", overrides=overrides), "cpu")
    plan = plan_pipeline(spec)
    work = [stage_spec(spec, plan, r).flops_per_token["forward"] for r in range(plan.pp)]
    mean = spec.flops_per_token["forward"] / plan.pp
    return {"bubble": plan.bubble, "uneven": 1 - (1 - plan.bubble) * mean / max(work), "stage_flops": work}


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 257, (ROWS * m, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _one_process(m: int, updates: int) -> list[float]:
    model = _model()
    x, y = _batch(m)
    times = []
    for _ in range(updates + 1):
        t0 = time.perf_counter()
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            _, loss = model(xs, targets=ys)
            (loss / m).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times[1:]


def _rank(rank: int, world: int, init: str, out: str, cases: list, updates: int) -> None:
    from k3train.runtime.parallel_layout import PipelineSettings
    from k3train.train.pipeline import Pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    result = {}
    for schedule, m in cases:
        model = _model()
        pipe = Pipeline(model, PipelineSettings(world, schedule), rank, None, torch.device("cpu"), m, (ROWS, SEQ))
        x, y = _batch(m)
        times = []
        for _ in range(updates + 1):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, y)
            dist.barrier()  # an update ends when its last stage is done
            times.append(time.perf_counter() - t0)
            for module in pipe.modules:
                module.zero_grad(set_to_none=True)
        result[f"{schedule} m={m}"] = times[1:]
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _cpu_model() -> str:
    from k3train.runtime.cpu import cpu_description

    return cpu_description()["cpu_model"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    ms, updates = ([2], 2) if args.quick else ([2, 4, 8], 5)
    cases = [(schedule, m) for schedule in ("gpipe", "1f1b") for m in ms]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, str(Path(tmp) / "init"), tmp, cases, updates), nprocs=2)
        pipelined = torch.load(Path(tmp) / "rank0.pt", weights_only=True)
    torch.set_num_threads(1)
    one = {m: statistics.median(_one_process(m, updates)) for m in ms}
    rows = {}
    for (schedule, m), key in zip(cases, pipelined):
        t_pp = statistics.median(pipelined[key])
        plan = planned(schedule, m)
        rows[key] = {
            "t_pipeline_s": round(t_pp, 4),
            "t_one_process_s": round(one[m], 4),
            "measured_bubble": round(1 - one[m] / (2 * t_pp), 3),
            "plan_bubble": round(plan["bubble"], 3),  # the schedule's idle share, k3train/plan/pipeline.py
            "plan_idle_with_uneven_stages": round(plan["uneven"], 3),
            "plan_stage_forward_flops_per_token": plan["stage_flops"],
        }
        print(f"{key:12s}  pipeline {t_pp:.3f} s  one process {one[m]:.3f} s  bubble measured "
              f"{rows[key]['measured_bubble']:.3f}, plan {rows[key]['plan_bubble']:.3f} (with the plan's uneven "
              f"stages {rows[key]['plan_idle_with_uneven_stages']:.3f})")  # fmt: skip
    result = {
        "cpu": platform.processor() or platform.machine(),
        "simd": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "load_avg": [load_before, os.getloadavg()],
        "cpu_model": _cpu_model(),
        "model": "k3_tiny (vocab 257), fp32, 2 stages of 2 layers, micro-batch 2 x 128 tokens",
        "updates_timed": updates,
        "cases": rows,
    }
    from results_file import write_unless_quick

    write_unless_quick(args.out, args.quick, RESULTS, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
