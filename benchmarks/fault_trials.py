"""The fault suite's long mode: many seeded SIGKILL trials, the SIGTERM/SIGUSR1 and full-disk trials, and every
bad-input class; prints the figures a closing note needs and writes them to benchmarks/results/fault_trials.json.

    python benchmarks/fault_trials.py [--seeds 10] [--sharded-seeds 2] [--jobs 2] [--work DIR]
    python benchmarks/fault_trials.py --sharded-only --sharded-seeds 2     # tests/fault_sharded.py's alone

Each seed is 24 SIGKILL trials (smoke_test_lm, k3_tiny, k3_tiny under guard=rewind and k3_tiny saving
asynchronously x checkpoint_interval 1 and 5 x a kill at a random time, right after a step, and while last.pt's
temporary file exists; one or two kills each, then resume=auto). Each sharded seed is 12 trials of asynchronous
sharded checkpoints under torchrun (tests/fault_sharded.py: a rank, torchrun or a rank's writer process killed at
a random moment or during a write, checkpoint_interval 1 and 3), plus its full-disk trial once.
The trials are those of tests/test_fault_trials.py and tests/test_fault_inputs.py (tests/fault_harness.py,
tests/fault_inputs.py); the CI suite runs seed 0. Files damaged counts checkpoints, run.json and
metrics.jsonl left unreadable after a fault, plus files already in a run directory that a bad input changed or
removed: it must be 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fault_harness as fh  # noqa: E402
import fault_inputs as fi  # noqa: E402
import fault_sharded as fs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "fault_trials.json"
SHARDED_RESULTS = RESULTS.with_name("fault_trials_sharded.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="24 SIGKILL trials per seed")
    parser.add_argument("--first-seed", type=int, default=100, help="the CI suite uses seed 0")
    parser.add_argument("--sharded-seeds", type=int, default=2, help="12 sharded trials per seed")
    parser.add_argument("--sharded-only", action="store_true", help="the sharded trials alone")
    parser.add_argument("--jobs", type=int, default=2, help="trials run at once (each is a few processes)")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument(
        "--output", type=Path, help=f"default {RESULTS.name} ({SHARDED_RESULTS.name} with --sharded-only)"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="k3train-fault-"))
    cache = work / "cache"
    started = time.monotonic()

    sharded = [*fs.kill_trials(range(args.first_seed, args.first_seed + args.sharded_seeds)), fs.ShardedDiskTrial()]
    trials = [*fh.kill_trials(range(args.first_seed, args.first_seed + args.seeds)), *fh.SIGNAL_TRIALS, *fh.DISK_TRIALS]
    trials = sharded if args.sharded_only else [*trials, *sharded]
    results = fh.run_trials(trials, work, cache, jobs=args.jobs)
    bad_inputs = [] if args.sharded_only else [case for case in fi.BAD_INPUTS if not case.missing()]
    inputs = {case.name: fi.run_bad_input(case, work / "bad-input", cache) for case in bad_inputs}

    ran = [r for r in results.values() if not r.skipped]
    kill_names = {t.name for t in trials if isinstance(t, (fh.KillTrial, fs.ShardedKillTrial))}
    kills = [r for r in ran if r.name in kill_names]
    failed = {r.name: r.problems for r in ran if r.problems}
    failed.update({f"bad input: {k}": v for k, (v, _) in inputs.items() if v})
    figures = {
        "sigkill_trials": len(kills),
        "sigkill_kills_tried": sum(r.kills_tried for r in kills),
        "sigkill_kills_landed": sum(r.kills_landed for r in kills),
        "signal_and_disk_trials": len(ran) - len(kills),
        "trials_run": len(ran),
        "faults_landed": sum(r.kills_landed for r in ran),
        "resumed_bitwise": sum(r.bitwise for r in ran),
        "bad_input_classes_tried": len(inputs),
        "bad_input_classes_refused_cleanly": sum(not v for v, _ in inputs.values()),
        "files_damaged": sum(r.damaged for r in ran) + sum(damaged for _, damaged in inputs.values()),
        "skipped": {
            **{r.name: r.skipped for r in results.values() if r.skipped},
            **{c.name: c.missing() for c in fi.BAD_INPUTS if c.missing()},
        },
        "failures": failed,
        "wall_s": round(time.monotonic() - started, 1),
        "jobs": args.jobs,
        "seeds": [args.first_seed, args.first_seed + args.seeds - 1],
        "sharded_seeds": [args.first_seed, args.first_seed + args.sharded_seeds - 1],
        "sharded_only": args.sharded_only,
        "trials": {
            r.name: {"landed": r.kills_landed, "tried": r.kills_tried, "bitwise": r.bitwise, "notes": r.notes}
            for r in results.values()
        },
    }
    for key, value in figures.items():
        if key not in ("trials", "failures"):
            print(f"{key}: {value}")
    for name, problems in failed.items():
        print(f"FAILED {name}: " + " | ".join(p.splitlines()[0] for p in problems))
    args.output = args.output or (SHARDED_RESULTS if args.sharded_only else RESULTS)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {args.output}")
    sys.exit(1 if failed or figures["files_damaged"] else 0)


if __name__ == "__main__":
    main()
