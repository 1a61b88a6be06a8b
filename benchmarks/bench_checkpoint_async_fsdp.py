"""Asynchronous sharded checkpoints against synchronous ones under FSDP2 on 2 gloo ranks (`python -m k3train` under
torchrun): what the update loop waits for per save, read from the runs' `checkpoint` events.

    python benchmarks/bench_checkpoint_async_fsdp.py           # k3_small, batch 2 x 256, saves every 2 updates
    python benchmarks/bench_checkpoint_async_fsdp.py --quick   # k3_tiny (a smoke test, nothing written)

The same run twice, side by side, alternating (`--pairs`): train.checkpoint_async=false (each save's `seconds` is
the whole write) and =true (`seconds` is the copy of each rank's shards to shared memory, `background_s` DCP's
writer processes behind the loop). The run's closing save is synchronous in both and left out, and so is each
async run's first save, which allocates the staging buffers (reported apart, with the writer processes' start
before training: one-offs a run pays once). Also the
update time with a write behind it against the updates without. Target (issue 51): blocked <= 25% of the
synchronous save's wall time. Writes benchmarks/results/checkpoint_async_fsdp.json (or --out) with the CPU and its
load.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import write_unless_quick

from k3train.observe.metrics import read_metrics
from k3train.runtime.cpu import cpu_description

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_async_fsdp.json"
STARTED = re.compile(r"checkpoint writer processes started in ([0-9.]+) s")


def run(model: str, batch: int, seq: int, steps: int, every: int, background: bool, run_dir: Path) -> tuple:
    """The run's events, and the seconds its writer processes took to start (None: saves in the loop)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "k3train",
        f"model={model}",
        "parallel=fsdp",
        f"train.batch_size={batch}",
        f"train.seq_len={seq}",
        f"train.max_steps={steps}",
        f"train.checkpoint_interval={every}",
        f"train.checkpoint_async={str(background).lower()}",
        "train.eval_interval=0",
        "train.log_interval=1",
        "train.progress=lines",
        "train.cpu_threads=1",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[7:])} failed:\n{proc.stderr[-3000:]}")
    started = STARTED.search(proc.stdout)
    return read_metrics(run_dir / "metrics.jsonl"), float(started.group(1)) if started else None


def figures(events: list[dict], steps: int, background: bool) -> dict:
    saves = [e for e in events if e["event"] == "checkpoint" and e["step"] < steps]  # the closing save is sync
    step_s = {e["step"]: e["step_time_s"] for e in events if e["event"] == "train"}
    out = {"bytes": saves[0]["bytes"], "first_save_s": saves[0]["seconds"]}
    if background:
        out["first_background_s"] = saves[0]["background_s"]
        saves = saves[1:]
        behind = [step_s[e["step"] + 1] for e in saves if e["step"] + 1 in step_s]  # the update the write ran behind
        out["step_s_behind_a_write"] = statistics.median(behind) if behind else None
        out["background_s"] = statistics.median(e["background_s"] for e in saves)
    out["blocked_s"] = statistics.median(e["seconds"] for e in saves)
    out["saves"] = len(saves)
    out["step_s_median"] = statistics.median(v for s, v in step_s.items() if s > 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model, batch, seq, steps, every = ("k3_tiny", 2, 64, 7, 2) if args.quick else ("k3_small", 2, 256, 9, 2)
    before = cpu_description()
    result: dict = {"model": model, "batch": f"{batch} x {seq} per rank", "ranks": 2, "every": every, "pairs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1 if args.quick else args.pairs):
            pair = {}
            for background in (False, True):
                name = "async" if background else "sync"
                events, started = run(model, batch, seq, steps, every, background, Path(tmp) / f"{name}-{i}")
                pair[name] = {**figures(events, steps, background), "writers_start_s": started}
            pair["blocked_over_wall"] = pair["async"]["blocked_s"] / pair["sync"]["blocked_s"]
            result["pairs"].append(pair)
            s, a = pair["sync"], pair["async"]
            print(
                f"pair {i}: {s['bytes'] / 2**20:.0f} MiB checkpoint; sync {s['blocked_s']:.2f} s a save; async "
                f"blocked {a['blocked_s']:.3f} s ({100 * pair['blocked_over_wall']:.0f}%), written in "
                f"{a['background_s']:.2f} s behind an update of {a['step_s_behind_a_write'] or 0:.2f} s (median update "
                f"{a['step_s_median']:.2f} s async, {s['step_s_median']:.2f} s sync); the first async save "
                f"{a['first_save_s']:.2f} s blocked, {a['first_background_s']:.2f} s behind; the writer processes "
                f"started in {a['writers_start_s'] or 0:.1f} s before training",
                flush=True,
            )
    result["blocked_over_wall_median"] = statistics.median(p["blocked_over_wall"] for p in result["pairs"])
    result = {**before, "load_average_after": cpu_description()["load_average"], **result}
    print(f"blocked / synchronous wall time, median: {result['blocked_over_wall_median']:.3f} (target <= 0.25)")
    write_unless_quick(args.out, args.quick, RESULTS, result)


if __name__ == "__main__":
    main()
