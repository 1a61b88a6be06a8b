"""The CPU benchmark suite in one command: every figure side by side in one run, the machine's load beside each.

    python benchmarks/run_all.py            # about 10 minutes on 2 cores
    python benchmarks/run_all.py --quick    # tiny shapes, a smoke test of the suite (well under a minute)

Sections (each a function of the benchmark script named beside it):
  loader        batches/s of the token loader over the built-in corpus           bench_data.time_loader
  kda           chunk_kda against the per-step reference (and FLA when installed) bench_kda.compare
  moe           MoE dispatch against a dense SwiGLU of equal active FLOPs         bench_moe.bench_case
  muon          Muon's share of a k3_small train step                             bench_muon.muon_share
  cpu           matmul GFLOP/s by dtype and thread count; Newton-Schulz dtypes     k3train.observe.mfu, bench_cpu
  train_step    tokens/s and MFU of k3_tiny and k3_small (seq_len 1024)            bench_model.bench_case
  overhead      the Trainer against a bare loop, k3_tiny at the default batch      bench_train.framework_overhead
  checkpoint    save and resume MB/s, share of wall time at the default interval  bench_train.checkpoint_cost
then the targets: framework overhead <= 2%, k3_small MFU >= 40% of the fp32 matmul peak, checkpoint save + resume
< 5% of wall time. Writes <out>/suite.json and <out>/suite.md (out: benchmarks/results, or --out).
A section that fails is recorded with its error and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the bench_* modules beside this file, also when imported by a test

from k3train.runtime.cpu import configure_openmp  # noqa: E402

configure_openmp()  # as `python -m k3train` does, before torch loads

import bench_cpu  # noqa: E402
import bench_data  # noqa: E402
import bench_kda  # noqa: E402
import bench_model  # noqa: E402
import bench_moe  # noqa: E402
import bench_muon  # noqa: E402
import bench_train  # noqa: E402
import torch  # noqa: E402

from k3train.data import TokenData  # noqa: E402
from k3train.observe.mfu import calibrate_cpu_matmul  # noqa: E402
from k3train.runtime.cpu import apply_threads, choose_threads, cpu_description, prepare_cpu_training  # noqa: E402

TARGETS = {"framework_overhead": 0.02, "k3_small_mfu": 0.40, "checkpoint_share": 0.05}
VERDICT = {True: "yes", False: "NO", "unclear": "unclear: the A/B rounds' quartiles straddle the limit"}
SMALL_SHAPES = ("train.batch_size=2", "train.seq_len=64")  # --quick


def loader(data: TokenData, quick: bool) -> dict:
    return bench_data.time_loader(data.path, batches=50 if quick else 20000, B=8, T=256 if quick else 1024)


def kda(data: TokenData, quick: bool) -> dict:
    if quick:
        return bench_kda.compare(B=1, H=2, T=128, K=16, V=16, C=16, recurrent_T=16, reps=1, warmup=0)
    return bench_kda.compare(B=1, H=4, T=2048, K=64, V=64, C=64, recurrent_T=256, reps=3, warmup=1)


def moe(data: TokenData, quick: bool) -> dict:
    cases = bench_moe.CASES[:1] if quick else bench_moe.CASES
    return {
        name: bench_moe.bench_case(name, d, n, k, shared, ffn, 256 if quick else tokens, 1 if quick else 5)
        for name, d, n, k, shared, ffn, tokens in cases
    }


def muon(data: TokenData, quick: bool) -> dict:
    if quick:
        return bench_muon.muon_share("k3_tiny", 1, 32, data.vocab_size, steps=1)
    return bench_muon.muon_share("k3_small", 2, 128, data.vocab_size, steps=2)


def cpu(data: TokenData, quick: bool) -> dict:
    threads = torch.get_num_threads()
    matmul = {}
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            matmul[f"{name}/{n}_threads"] = calibrate_cpu_matmul(dtype, budget_s=0.1 if quick else 1.0) / 1e9
    torch.set_num_threads(threads)
    out = {"matmul_gflop_per_s": matmul, "machine": cpu_description()}
    if not quick:
        out["newton_schulz_k3_tiny"] = bench_cpu.newton_schulz_step_s("k3_tiny", reps=2)
    return out


def train_step(data: TokenData, quick: bool) -> dict:
    if quick:
        return {"k3_tiny": bench_model.bench_case("k3_tiny", data.vocab_size, 2, 64, steps=1)}
    return {name: bench_model.bench_case(name, vocab, B, T, steps=7) for name, vocab, B, T in bench_model.CASES}


def overhead(data: TokenData, quick: bool) -> dict:
    if quick:
        return bench_train.framework_overhead(data, rounds=1, steps=2, overrides=SMALL_SHAPES)
    return bench_train.framework_overhead(data, rounds=10, steps=5)


def checkpoint(data: TokenData, quick: bool) -> dict:
    if quick:
        return {"k3_tiny": bench_train.checkpoint_cost(data, "k3_tiny", overrides=SMALL_SHAPES)}
    return {name: bench_train.checkpoint_cost(data, name) for name in ("k3_tiny", "k3_small")}


SECTIONS: dict[str, Callable[[TokenData, bool], dict]] = {
    "loader": loader,
    "kda": kda,
    "moe": moe,
    "muon": muon,
    "cpu": cpu,
    "train_step": train_step,
    "overhead": overhead,
    "checkpoint": checkpoint,
}


def run_section(name: str, data: TokenData, quick: bool) -> dict:
    load_before, t0 = os.getloadavg(), time.perf_counter()
    try:
        result = {"result": SECTIONS[name](data, quick)}
    except Exception as exc:  # noqa: BLE001 - record it and go on: one failure must not hide the other figures
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        **result,
        "seconds": time.perf_counter() - t0,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }


def targets(sections: dict) -> dict:
    """Each target's figure, its limit, whether it is met, and the load average while it was measured."""
    out = {}

    def add(name: str, section: str, figure: Callable[[dict], float], limit: float, below: bool) -> None:
        entry = sections.get(section, {})
        try:
            value = figure(entry["result"])
        except (KeyError, TypeError):
            return
        met = value <= limit if below else value >= limit
        if name == "framework_overhead_k3_tiny":
            # The A/B rounds' own spread decides: when their quartiles lie on both sides of the limit, the rounds
            # cannot tell 2% from noise either way (on a shared 2-core machine they spread by ~10%).
            q1, q3 = entry["result"]["overhead_of_rounds_quartiles"]
            met = True if q3 <= limit else False if q1 > limit else "unclear"
        out[name] = {
            "value": value,
            "limit": limit,
            "met": met,
            "load_avg": entry["load_avg_before"][0],
            "section": section,
        }

    add(
        "framework_overhead_k3_tiny",
        "overhead",
        lambda r: r["overhead_median_of_rounds"],
        TARGETS["framework_overhead"],
        below=True,
    )
    # The same target measured directly (the Trainer's own seconds over its step time): the A/B rounds' noise on
    # a shared machine is several percent, this figure's is not.
    add(
        "framework_overhead_k3_tiny_accounting",
        "overhead",
        lambda r: r["accounting"]["trainer_own_share"],
        TARGETS["framework_overhead"],
        below=True,
    )
    add("k3_small_mfu_seq1024", "train_step", lambda r: r["k3_small"]["mfu"], TARGETS["k3_small_mfu"], below=False)
    for model in ("k3_tiny", "k3_small"):
        add(
            f"checkpoint_share_{model}",
            "checkpoint",
            lambda r, m=model: r[m]["share_of_wall"],
            TARGETS["checkpoint_share"],
            below=True,
        )
    return out


def markdown(report: dict) -> str:
    lines = [
        f"# Benchmark suite{' (--quick)' if report['quick'] else ''}",
        "",
        f"{report['machine']['cpu_model']}, torch {report['torch']}, {report['threads']} threads, "
        f"started {report['started']}",
        "",
        "| target | value | limit | met | load avg (1 min) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, t in report["targets"].items():
        lines.append(f"| {name} | {t['value']:.4g} | {t['limit']} | {VERDICT[t['met']]} | {t['load_avg']} |")
    lines += ["", "| section | seconds | load avg before -> after | key figures |", "| --- | --- | --- | --- |"]
    for name, s in report["sections"].items():
        figures = s.get("error") or key_figures(name, s["result"])
        lines.append(
            f"| {name} | {s['seconds']:.1f} | {s['load_avg_before'][0]} -> {s['load_avg_after'][0]} | {figures} |"
        )
    return "\n".join(lines) + "\n"


def key_figures(name: str, r: dict) -> str:
    """One cell of the summary table: the figures a reader looks for first."""
    if name == "loader":
        return f"{r['tokens_per_s'] / 1e6:.1f} M tokens/s"
    if name == "kda":
        rec = r["vs_naive_recurrent"]
        return (
            f"chunk fwd+bwd {r['fwd_bwd_seconds_median']['chunk_kda'] * 1e3:.1f} ms; {rec['speedup']:.1f}x the "
            f"per-step reference at T={rec['T']}"
        )
    if name == "moe":
        return "; ".join(f"{k}: {v['ratio_moe_over_dense']:.2f}x dense FLOP/s" for k, v in r.items())
    if name == "muon":
        return (
            f"{r['model']}: Muon {r['muon_share_of_train_step']:.0%} of the train step, "
            f"{r['muon_achieved_gflop_per_s']} GFLOP/s"
        )
    if name == "cpu":
        return "; ".join(f"{k} {v:.1f} GFLOP/s" for k, v in r["matmul_gflop_per_s"].items())
    if name == "train_step":
        return "; ".join(
            f"{k} {v['batch']}x{v['seq_len']}: {v['tokens_per_s']:.0f} tok/s, MFU {v['mfu']:.1%} "
            f"({v['mfu_fwd_bwd_only']:.1%} fwd+bwd)"
            for k, v in r.items()
        )
    if name == "overhead":
        q1, q3 = r["overhead_of_rounds_quartiles"]
        own = r["accounting"]
        return (
            f"Trainer {r['trainer_step_s_median']:.3f} s vs bare {r['bare_step_s_median']:.3f} s per step: "
            f"{r['overhead_median_of_rounds']:+.1%} (rounds' quartiles {q1:+.1%} / {q3:+.1%}); the Trainer's "
            f"own time {own['trainer_own_s_per_step'] * 1e3:.1f} ms of {own['step_s']:.3f} s per step "
            f"({own['trainer_own_share']:.2%})"
        )
    if name == "checkpoint":
        return "; ".join(
            f"{k}: {v['bytes'] / 1e6:.0f} MB, save {v['save_mb_per_s']:.0f} MB/s, load "
            f"{v['load_mb_per_s']:.0f} MB/s, {v['share_of_wall']:.2%} of wall"
            for k, v in r.items()
        )
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test of the suite")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run these sections only")
    parser.add_argument("--threads", default="auto", help="torch threads: auto (as train.cpu_threads=auto) or N")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    apply_threads(choose_threads(args.threads))
    cpu_setup = prepare_cpu_training()  # as training on a CPU does
    data = TokenData.builtin()
    report = {
        "quick": args.quick,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **cpu_setup,
        "machine": cpu_description(),
        "sections": {},
    }
    for name in args.only or SECTIONS:
        print(f"== {name} (load average {os.getloadavg()[0]:.2f})", flush=True)
        report["sections"][name] = run_section(name, data, args.quick)
    report["targets"] = targets(report["sections"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "suite.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    summary = markdown(report)
    (args.out / "suite.md").write_text(summary)
    print(summary + f"wrote {args.out / 'suite.json'} and {args.out / 'suite.md'}")
    return 1 if any("error" in s for s in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
