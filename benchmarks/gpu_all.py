"""The whole GPU check on one H200, within 8 minutes: the GPU parity tests, KDA kernel speed, k3_small's layers
(KDA, MLA, MoE against a dense SwiGLU of its active FLOPs) and k3_small's train step beside its dense peer (tokens/s,
MFU against the datasheet peak, k3train/observe/mfu.py, and the ratios k3_small / dense_peer).

    python benchmarks/gpu_all.py                # needs CUDA and pip install 'k3train[gpu]'
    python benchmarks/gpu_all.py --dry-run-cpu  # exercises the scripts on CPU (no parity tests): says nothing
                                                # about a GPU, and never writes into benchmarks/results/
Each part runs in its own process under a time limit (a hung kernel cannot eat the others' time), the limits
adding up to at most TOTAL_LIMIT_S; the scripts also stop starting new cases past their own --budget-s, which
leaves each a margin to finish the case it is in (a part killed at its limit writes no JSON). Each script writes its
own JSON (benchmarks/results/gpu_<part>.json); this one merges them, with each part's exit status, seconds and
output tail, the date, the GPU, the torch / triton / flash-linear-attention versions and the git commit, into
benchmarks/results/gpu.json. A dry run writes all of it to a temporary directory (or --out), marked as a dry run.

Measured on a fresh H200 (2026-11-30: torch 2.11.0+cu130, flash-linear-attention 0.6.0, triton 3.6.0, no Triton
cache): FLA's Triton kernels autotune and compile on first use. The parity tests passed as far as they got (4 in
the 150 s limit, then in a second call on the same machine 2 more in 250 s: 6 passed, none failed, the rest never
ran) and the two scripts of then printed nothing within 80 and 95 s. The limits here fit a machine whose Triton
cache is warm; on a fresh one, expect the parity part to time out and give it the time first
(`python -m pytest -m gpu tests`), or carry a warm ~/.triton/cache. Since the layers and the dense peer were added
(not yet measured on a GPU) the limits are 120 / 90 / 80 / 180 s: the train step, now six cases, keeps the most.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TOTAL_LIMIT_S = 480  # 8 minutes
DRY_RUN_NOTE = "CPU dry run of the GPU check: tiny shapes on CPU; these numbers say nothing about a GPU"
# (name, command, time limit in seconds); a script part writes gpu_<name>.json (its --out)
PARTS: list[tuple[str, list[str], int]] = [
    ("parity_tests", ["-m", "pytest", "-q", "-m", "gpu", "tests"], 120),
    ("kda_speed", ["benchmarks/gpu_kda_speed.py", "--budget-s", "60"], 90),
    ("layers", ["benchmarks/gpu_layers.py", "--budget-s", "50"], 80),
    ("train_step", ["benchmarks/gpu_train_step.py", "--budget-s", "130"], 180),
]


def is_script(args: list[str]) -> bool:
    return args[0] != "-m"


def plan(dry_run_cpu: bool) -> list[tuple[str, list[str], int]]:
    """The commands to run, in order, without their --out; on CPU the scripts' dry runs (the parity tests need a
    GPU)."""
    if not dry_run_cpu:
        return [(name, [sys.executable, *args], limit) for name, args, limit in PARTS]
    return [(name, [sys.executable, *args, "--dry-run-cpu"], limit) for name, args, limit in PARTS if is_script(args)]


def run_part(command: list[str], limit_s: int) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
        status, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        status = "timeout"
        output = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
    return {
        "command": command[1:],
        "status": status,
        "seconds": round(time.perf_counter() - t0, 1),
        "limit_s": limit_s,
        "output_tail": output[-3000:],
    }


TALLY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def pytest_counts(output: str) -> dict[str, int] | None:
    """pytest's closing tally ("6 passed, 2 skipped in 80.1s") as {"passed": 6, "skipped": 2}; None without one
    (a run killed at its limit prints none)."""
    closing = [line for line in output.splitlines() if TALLY.search(line) and re.search(r" in [\d.]+s", line)]
    if not closing:
        return None
    return {
        outcome.removesuffix("s") if "error" in outcome else outcome: int(n)
        for n, outcome in TALLY.findall(closing[-1])
    }


def read_part_json(path: Path) -> dict | None:
    """A script's own JSON, or None when it wrote none (a timeout, a crash) or one that does not parse."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def environment(dry_run_cpu: bool) -> dict:
    """Asked after the parts have run, so that this process holds no GPU memory while they do."""
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": "none (CPU dry run)" if dry_run_cpu else torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": package_version("triton"),
            "flash-linear-attention": package_version("flash-linear-attention"),
        },
        "git_commit": git_commit(),
    }


def headline(parts: dict) -> dict:
    """Issue 27's figures, lifted out of the parts: the MoE's FLOP/s over the dense SwiGLU's and k3_small over its
    dense peer."""
    layers = parts.get("layers", {}).get("results") or {}
    train_step = parts.get("train_step", {}).get("results") or {}
    return {
        "moe_flops_per_s_over_dense_swiglu": layers.get("moe_flops_per_s_over_dense_swiglu"),
        "moe_target": layers.get("target"),
        "k3_over_dense_peer": train_step.get("ratios_to_dense_peer"),
    }


def output_path(out: Path | None, dry_run_cpu: bool) -> Path:
    """Where the merged report goes; a dry run anywhere but benchmarks/results/, so it never passes for a GPU's."""
    if not dry_run_cpu:
        return out or RESULTS / "gpu.json"
    out = out or Path(tempfile.mkdtemp(prefix="gpu_all_dry_run_")) / "gpu.json"
    if RESULTS.resolve() in out.resolve().parents:
        raise ValueError(f"--dry-run-cpu --out {out} is under {RESULTS}, where GPU results live: choose another place")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run-cpu", action="store_true")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the merged report (default benchmarks/results/gpu.json; the dry run: "
        "a temporary directory); the parts' JSON files go beside it",
    )
    args = parser.parse_args(argv)
    if not args.dry_run_cpu:
        import torch

        if not torch.cuda.is_available():
            sys.exit("gpu_all.py needs CUDA (use --dry-run-cpu to exercise it on CPU)")
    try:
        out = output_path(args.out, args.dry_run_cpu)
    except ValueError as err:
        parser.error(str(err))  # exit status 2, before any part runs
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = {}
    for name, command, limit in plan(args.dry_run_cpu):
        part_json = out.parent / f"gpu_{name}.json"
        script = is_script(command[1:])
        if script:
            part_json.unlink(missing_ok=True)  # a file left by an earlier run must not pass for this run's
            command = [*command, "--out", str(part_json)]
        print(f"== {name} (at most {limit} s): {' '.join(command[1:])}", flush=True)
        part = parts[name] = run_part(command, limit)
        print(part["output_tail"][-1500:], flush=True)
        part["results"] = read_part_json(part_json) if script else pytest_counts(part["output_tail"])
    report = {
        "dry_run_cpu": args.dry_run_cpu,
        **({"note": DRY_RUN_NOTE} if args.dry_run_cpu else {}),
        **environment(args.dry_run_cpu),
        "total_limit_s": TOTAL_LIMIT_S,
        "headline": headline(parts),
        "parts": parts,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    failed = [name for name, part in parts.items() if part["status"] != 0 or part["results"] is None]
    print(f"wrote {out}; " + (f"FAILED: {', '.join(failed)}" if failed else "all parts passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
