"""The whole GPU check on one H200, within 8 minutes: the GPU parity tests, KDA kernel speed, and the k3_small
train step's tokens/s and MFU (against the datasheet peak, k3train/observe/mfu.py).

    python benchmarks/gpu_all.py                # needs CUDA and pip install 'k3train[gpu]'
    python benchmarks/gpu_all.py --dry-run-cpu  # exercises the scripts on CPU (no parity tests): says nothing
                                                # about a GPU
Each part runs in its own process under a time limit (a hung kernel cannot eat the others' time), the limits
adding up to TOTAL_LIMIT_S; the scripts also stop starting new cases past their own --budget-s. Writes
benchmarks/results/gpu_all.json (each part's exit status, seconds and output tail) beside the scripts' own files.

Measured on a fresh H200 (2026-11-30: torch 2.11.0+cu130, flash-linear-attention 0.6.0, triton 3.6.0, no Triton
cache): FLA's Triton kernels autotune and compile on first use. The parity tests passed as far as they got (4 in
the 150 s limit, then in a second call on the same machine 2 more in 250 s: 6 passed, none failed, the rest never
ran) and the two scripts printed nothing within 80 and 95 s. The limits here fit a machine whose Triton cache
is warm; on a fresh one, expect the parity part to time out and give it the time first
(`python -m pytest -m gpu tests`), or carry a warm ~/.triton/cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOTAL_LIMIT_S = 480  # 8 minutes
# (name, command, time limit in seconds)
PARTS: list[tuple[str, list[str], int]] = [
    ("parity_tests", ["-m", "pytest", "-q", "-m", "gpu", "tests"], 150),
    ("kda_speed", ["benchmarks/gpu_kda_speed.py", "--budget-s", "100"], 150),
    ("train_step", ["benchmarks/gpu_train_step.py", "--budget-s", "110"], 170),
]


def plan(dry_run_cpu: bool) -> list[tuple[str, list[str], int]]:
    """The commands to run, in order; on CPU the scripts' dry runs (the parity tests need a GPU)."""
    if not dry_run_cpu:
        return [(name, [sys.executable, *args], limit) for name, args, limit in PARTS]
    return [(name, [sys.executable, *args, "--dry-run-cpu"], limit) for name, args, limit in PARTS if args[0] != "-m"]


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
        "output_tail": output[-3000:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run-cpu", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.dry_run_cpu:
        import torch

        if not torch.cuda.is_available():
            sys.exit("gpu_all.py needs CUDA (use --dry-run-cpu to exercise it on CPU)")
    report = {}
    for name, command, limit in plan(args.dry_run_cpu):
        print(f"== {name} (at most {limit} s): {' '.join(command[1:])}", flush=True)
        report[name] = run_part(command, limit)
        print(report[name]["output_tail"][-1500:], flush=True)
    out = args.out or (Path("/tmp") if args.dry_run_cpu else ROOT / "benchmarks" / "results") / "gpu_all.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    failed = [name for name, part in report.items() if part["status"] != 0]
    print(f"wrote {out}; " + (f"FAILED: {', '.join(failed)}" if failed else "all parts passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
