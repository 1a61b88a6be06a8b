"""Is training fast on this CPU? Newton-Schulz dtypes, train steps under load, the quickstart's throughput.

    python benchmarks/bench_cpu.py                 # about 3-5 minutes on 2 cores
    python benchmarks/bench_cpu.py --no-small      # skip k3_small's Newton-Schulz (the slowest part)

(a) Newton-Schulz over every Muon matrix of k3_tiny and k3_small (one optimizer step's worth, random momentum)
    in bf16, fp32, and what optim.ns_dtype=auto picks here.
(b) A k3_tiny train step (forward, backward, MuonAdamW step; batch 8 x 256, the quickstart's) alone and beside 1
    and 2 busy competitor processes (`while True: pass`), with train.cpu_threads=adaptive (OpenMP threads that spin
    ~30 ms, and CpuThreads, k3train/train/cpu_threads.py, giving threads up while the competitors run) against
    OpenMP threads that sleep at once (OMP_WAIT_POLICY=PASSIVE: what auto gets on CPUs busy at start) and torch's
    defaults (a thread per core, OpenMP's own policy); alone, also with Newton-Schulz forced to fp32 (auto's choice
    on a CPU without native bf16) and with AdamW. Each configuration runs in a fresh process (OpenMP's settings are
    fixed when torch loads), for at most --probe-budget seconds; the steps timed come after 2.5 s of warm-up steps,
    so that CpuThreads has measured one window.
(c) The quickstart itself (`python -m k3train`, cut to --quickstart-steps updates): tokens/s and the model FLOP
    utilisation, the model's training FLOPs per token (run.json's `flops`, k3train/models/k3/flops.py) over a
    measured fp32 [2048 x 2048] matmul peak at the same thread count.
Prints a table with the CPU model, torch's CPU capability and the load average beside the figures, and writes
benchmarks/results/cpu.json. Other processes on the machine change every figure: read the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3train.config import model_option
from k3train.runtime.cpu import configure_openmp

PROBE_MODE = sys.argv[2] if sys.argv[1:2] == ["--probe"] else "k3train"
if PROBE_MODE != "torch_default":  # a probe of torch's defaults keeps OpenMP's own policy
    configure_openmp(spin=PROBE_MODE == "k3train")  # as `python -m k3train` does, before torch loads

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from k3train.optim.build import resolve_ns_dtype  # noqa: E402
from k3train.optim.muon import NS_DTYPES, as_matrices, zeropower_via_newtonschulz5  # noqa: E402
from k3train.optim.param_groups import partition_parameters  # noqa: E402
from k3train.runtime.cpu import apply_threads, choose_threads, cpu_description, openmp_setting  # noqa: E402
from k3train.train.cpu_threads import CpuThreads  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 257  # the built-in byte-level corpus


def build_model(name: str, **overrides) -> torch.nn.Module:
    cfg = model_option(name)
    cfg.vocab_size = VOCAB
    for key, value in overrides.items():
        cfg[key] = value
    torch.manual_seed(0)
    return hydra.utils.instantiate(cfg)


def build_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    """conf/optim/<name>.yaml; "muon_adamw:fp32" forces optim.ns_dtype=fp32 (what auto picks without native bf16)."""
    name, _, ns_dtype = name.partition(":")
    cfg = OmegaConf.load(ROOT / "conf" / "optim" / f"{name}.yaml")
    if ns_dtype:
        cfg.ns_dtype = ns_dtype
    return hydra.utils.instantiate(cfg)(model)


# ---- (a) Newton-Schulz ----------------------------------------------------------------------------------------
def newton_schulz_step_s(model_name: str, reps: int) -> dict:
    model = build_model(model_name)
    gen = torch.Generator().manual_seed(0)
    views = [
        as_matrices(torch.randn(a.shape, generator=gen), a.head_split)
        for a in partition_parameters(model)
        if a.kind == "muon"
    ]
    out = {"muon_matrices": sum(v.shape[0] for v in views), "muon_params": sum(v.numel() for v in views)}
    for name, dtype in NS_DTYPES.items():
        times = []
        for _ in range(reps + 1):  # the first pass warms up
            t0 = time.perf_counter()
            for v in views:
                zeropower_via_newtonschulz5(v, dtype=dtype)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:]) if reps else times[0]
    out["auto"] = resolve_ns_dtype("auto", torch.device("cpu"))
    out["auto_s"] = out[out["auto"]]
    return out


# ---- (b) train steps under load -------------------------------------------------------------------------------
def probe(optim: str, steps: int, budget_s: float, governor: CpuThreads | None = None, warmup_s: float = 2.5) -> dict:
    """In a fresh process: median k3_tiny train-step time (fwd + bwd + optimizer step) at batch 8 x 256, over the
    `steps` steps after `warmup_s` of warm-up steps; the governor (if any) ticks after every step, as in training."""
    model = build_model("k3_tiny")
    opt = build_optimizer(model, optim)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(VOCAB, (8, 256), generator=gen) for _ in range(2))
    if governor is not None:
        governor.setup(model, opt, None)
    warmup: list[float] = []
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < steps:
        t0 = time.perf_counter()
        _, loss = model(x, targets=y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if governor is not None:
            governor.tick()
        now = time.perf_counter()
        (times if now - start > warmup_s and warmup else warmup).append(now - t0)
        if times and now - start > budget_s:  # beside spinning threads a step can take a minute
            break
    if not times:
        times = warmup[-1:]
    return {
        "median_s": statistics.median(times),
        "steps": len(times),
        "first_s": warmup[0],
        "warmup_steps": len(warmup),
        "threads": torch.get_num_threads(),  # at the end (CpuThreads may have changed it)
        "openmp": openmp_setting(),
    }


def run_probe(mode: str, optim: str, competitors: int, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(competitors)]
    try:
        time.sleep(0.5 if competitors else 0)  # let them take their cores before the process decides anything
        proc = subprocess.run(
            [sys.executable, __file__, "--probe", mode, optim, str(args.steps), str(args.probe_budget)],
            env=env,
            capture_output=True,
            text=True,
            timeout=args.probe_budget + 300,
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"probe {mode} {optim} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe_main(mode: str, optim: str, steps: int, budget_s: float) -> None:
    governor = None
    if mode in ("k3train", "sleeping"):  # OpenMP was set at import, as `python -m k3train` does (sleeping: before)
        threads = choose_threads("auto")
        apply_threads(threads)
        if mode == "k3train" and threads.threads > 1:
            governor = CpuThreads.for_this_process(threads.threads)
    else:  # torch's defaults: no OpenMP setting (see the top of this file), a thread per physical core
        assert mode == "torch_default", mode
    print(json.dumps(probe(optim, steps, budget_s, governor)))


# ---- (c) the quickstart ---------------------------------------------------------------------------------------
def matmul_peak_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 3) -> float:
    a = torch.randn(n, n).to(dtype)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def quickstart(steps: int, planned_steps: int = 200) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "k3train",
            "experiment=quickstart",
            f"train.max_steps={steps}",
            "train.eval_interval=0",
            f"train.log_interval={steps // 2}",
            "train.progress=lines",
            f"hydra.run.dir={tmp}/run",
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"quickstart failed:\n{proc.stderr}")
        events = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl", encoding="utf-8")]
        manifest = json.loads(Path(f"{tmp}/run/run.json").read_text())
    last = [e for e in events if e["event"] == "train"][-1]  # the second half of the updates: warm
    flops_per_token = manifest["flops"]["flops_per_token"]["training"]  # k3train/models/k3/flops.py
    torch.set_num_threads(manifest["environment"]["cpu_threads"])
    peak = matmul_peak_gflops(torch.float32)
    first = next(line for line in proc.stdout.splitlines() if "first update took" in line)
    return {
        "updates": steps,
        "wall_s": round(wall, 1),
        "tokens_per_s": round(last["tokens_per_s"]),
        "step_time_s": round(last["step_time_s"], 3),
        "first_update_line": first,
        "model_gflop_per_token": flops_per_token / 1e9,
        "achieved_gflop_per_s": round(last["tokens_per_s"] * flops_per_token / 1e9, 2),
        "fp32_matmul_peak_gflop_per_s": round(peak, 1),
        "mfu": round(last["tokens_per_s"] * flops_per_token / 1e9 / peak, 4),
        "threads": manifest["environment"]["cpu_threads"],
        "ns_dtype": sorted({g["ns_dtype"] for g in manifest["optimizer"] if "ns_dtype" in g}),
        f"estimated_{planned_steps}_update_s": round(wall + (planned_steps - steps) * last["step_time_s"], 1),
    }


# ---- report ---------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed train steps per configuration in (b)")
    ap.add_argument("--probe-budget", type=float, default=25.0, help="seconds per (b) configuration, at most")
    ap.add_argument("--ns-reps", type=int, default=3, help="timed Newton-Schulz passes for k3_tiny")
    ap.add_argument("--no-small", action="store_true", help="skip k3_small in (a)")
    ap.add_argument("--quickstart-steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu.json")
    ap.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        mode, optim, steps, budget = args.probe
        return probe_main(mode, optim, int(steps), float(budget))

    result: dict = {"machine": cpu_description(), "torch": torch.__version__}
    threads = choose_threads("auto")
    apply_threads(threads)
    result["auto_threads"] = threads.as_dict()
    print(
        f"CPU: {result['machine']['cpu_model']} | torch {torch.__version__} capability "
        f"{result['machine']['torch_cpu_capability']} | native bf16: {result['machine']['native_bf16']} | "
        f"auto threads: {threads.threads} | load average at start: {result['machine']['load_average']}"
    )

    print("\n(a) Newton-Schulz, one optimizer step over every Muon matrix, seconds")
    print(f"{'model':<10} {'matrices':>8} {'bf16':>9} {'fp32':>9}  auto")
    result["newton_schulz"] = {}
    for name in ["k3_tiny"] + ([] if args.no_small else ["k3_small"]):
        r = newton_schulz_step_s(name, args.ns_reps if name == "k3_tiny" else 0)
        result["newton_schulz"][name] = r
        print(
            f"{name:<10} {r['muon_matrices']:>8} {r['bf16']:>9.3f} {r['fp32']:>9.3f}  {r['auto']} ({r['auto_s']:.3f})",
            flush=True,
        )

    print(
        f"\n(b) k3_tiny train step (batch 8 x 256), median seconds; load average "
        f"{[round(x, 2) for x in os.getloadavg()]}"
    )
    print(f"{'optimizer':<15} {'settings':<14} {'alone':>8} {'+1 busy':>8} {'+2 busy':>8}  threads at the end, OpenMP")
    result["train_step"] = {}
    for optim, mode, levels in [
        ("muon_adamw", "k3train", (0, 1, 2)),
        ("muon_adamw", "sleeping", (0, 1, 2)),
        ("muon_adamw", "torch_default", (0, 1, 2)),
        ("muon_adamw:fp32", "k3train", (0,)),
        ("adamw", "k3train", (0,)),
    ]:
        row = {f"{n}_busy": run_probe(mode, optim, n, args) for n in levels}
        result["train_step"][f"{optim}/{mode}"] = row
        cells = [f"{row[f'{n}_busy']['median_s']:>8.3f}" if f"{n}_busy" in row else f"{'-':>8}" for n in (0, 1, 2)]
        print(
            f"{optim:<15} {mode:<14} {' '.join(cells)}  "
            f"{'/'.join(str(r['threads']) for r in row.values())}, {row['0_busy']['openmp']}",
            flush=True,
        )

    print(f"\n(c) quickstart (python -m k3train, {args.quickstart_steps} updates)")
    q = quickstart(args.quickstart_steps)
    result["quickstart"] = q
    print(
        f"{q['tokens_per_s']:,} tokens/s, {q['step_time_s']} s/update, {q['achieved_gflop_per_s']} GFLOP/s model "
        f"= MFU {q['mfu']:.1%} of a {q['fp32_matmul_peak_gflop_per_s']} GFLOP/s fp32 matmul peak "
        f"({q['threads']} threads, Newton-Schulz {q['ns_dtype']}); 200 updates: ~{q['estimated_200_update_s']} s"
    )
    print(f"  {q['first_update_line']}")

    steps = result["train_step"]
    spin = steps["muon_adamw/k3train"]
    alone = spin["0_busy"]["median_s"]
    result["targets"] = {
        "muon_over_adamw_step": round(alone / steps["adamw/k3train"]["0_busy"]["median_s"], 2),  # <= 1.5
        "muon_fp32_ns_over_adamw_step": round(
            steps["muon_adamw:fp32/k3train"]["0_busy"]["median_s"] / steps["adamw/k3train"]["0_busy"]["median_s"], 2
        ),
        "one_busy_over_alone": round(steps["muon_adamw/k3train"]["1_busy"]["median_s"] / alone, 2),  # <= 2.5
        "one_busy_over_alone_torch_default": round(
            steps["muon_adamw/torch_default"]["1_busy"]["median_s"]
            / steps["muon_adamw/torch_default"]["0_busy"]["median_s"],
            2,
        ),
        "quickstart_estimated_s": q["estimated_200_update_s"],  # < 180 on 2 idle cores of an AVX2-only CPU
        # spinning threads + CpuThreads over sleeping threads (the choice before), per load level: < 1 is faster
        "spin_over_sleeping": {
            level: round(spin[level]["median_s"] / steps["muon_adamw/sleeping"][level]["median_s"], 2)
            for level in ("0_busy", "1_busy", "2_busy")
        },
    }
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    t = result["targets"]
    print(
        f"\ntargets: Muon+AdamW / AdamW step {t['muon_over_adamw_step']} (<= 1.5; Newton-Schulz in fp32: "
        f"{t['muon_fp32_ns_over_adamw_step']}); beside 1 busy / alone "
        f"{t['one_busy_over_alone']} (<= 2.5; torch defaults: {t['one_busy_over_alone_torch_default']}); "
        f"quickstart ~{t['quickstart_estimated_s']} s (< 180); spinning threads + CpuThreads over sleeping threads "
        f"{t['spin_over_sleeping']}; load average at end {result['load_average_at_end']}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
