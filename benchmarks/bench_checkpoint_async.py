"""Asynchronous checkpoints against synchronous ones, side by side in one process: what the update loop waits for.

    python benchmarks/bench_checkpoint_async.py           # k3_small, batch 2 x 256, 3 rounds
    python benchmarks/bench_checkpoint_async.py --quick   # k3_tiny, 1 round (a smoke test, nothing written)

Each round saves the same state twice: synchronously (the loop waits for the whole write: wall_s) and with
train.checkpoint_async (the loop waits while the state is copied: blocked_s; a thread writes it, background_s),
then trains on while that write runs, timing those updates against updates with no write behind them (the write's
cost to the loop beyond the copy: on a CPU the thread takes cycles from training). Target (issue 51): blocked_s <=
25% of wall_s. Writes benchmarks/results/checkpoint_async.json (or --out) with the CPU and its load.
The sharded format (FSDP2, ep > 1), written by DCP's writer processes, is bench_checkpoint_async_fsdp.py's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_train import build_trainer, composed  # benchmarks/, beside this script
from results_file import write_unless_quick

from k3train.data import TokenData
from k3train.runtime.cpu import cpu_description, prepare_cpu_training

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_async.json"


def _step_s(trainer) -> float:
    t0 = time.perf_counter()
    trainer.train_step()
    return time.perf_counter() - t0


def compare(model: str, batch: int, seq: int, rounds: int) -> dict:
    cfg = composed(f"model={model}", f"train.batch_size={batch}", f"train.seq_len={seq}", "train.progress=lines")
    data = TokenData.builtin()
    out: dict = {"model": model, "batch": f"{batch} x {seq}", "rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp), data)
        trainer.train_step()  # warm-up; fills the optimizer's state
        checkpointer = trainer.checkpointer
        for _ in range(rounds):
            quiet = [_step_s(trainer) for _ in range(2)]  # no write behind these
            t0 = time.perf_counter()
            size = checkpointer.save(trainer.state.step, wait=True)
            wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            checkpointer.save(trainer.state.step, wait=False)
            blocked = time.perf_counter() - t0
            behind = []  # updates while the write runs
            while (written := checkpointer.poll()) is None:
                behind.append(_step_s(trainer))
            out["rounds"].append(
                {
                    "bytes": size,
                    "sync_wall_s": wall,
                    "async_blocked_s": blocked,
                    "async_background_s": written["background_s"],
                    "blocked_over_wall": blocked / wall,
                    "step_s_quiet": statistics.median(quiet),
                    "step_s_behind_a_write": statistics.median(behind) if behind else None,
                    "updates_behind_the_write": len(behind),
                }
            )
            r = out["rounds"][-1]
            print(
                f"{size / 2**20:.0f} MiB: sync {wall:.2f} s; async blocked {blocked:.2f} s "
                f"({100 * blocked / wall:.0f}%), written in {r['async_background_s']:.2f} s behind "
                f"{len(behind)} update(s) of {r['step_s_behind_a_write'] or 0:.2f} s "
                f"(quiet: {r['step_s_quiet']:.2f} s)",
                flush=True,
            )
    out["blocked_over_wall_median"] = statistics.median(r["blocked_over_wall"] for r in out["rounds"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prepare_cpu_training()  # as training on a CPU does
    before = cpu_description()
    result = compare("k3_tiny", 2, 64, 1) if args.quick else compare("k3_small", 2, 256, args.rounds)
    result = {**before, "load_average_after": cpu_description()["load_average"], **result}
    print(f"blocked / synchronous wall time, median: {result['blocked_over_wall_median']:.3f} (target <= 0.25)")
    write_unless_quick(args.out, args.quick, RESULTS, result)


if __name__ == "__main__":
    main()
