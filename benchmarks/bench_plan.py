"""The plan's memory prediction against a measured train step: k3_small on this CPU, one process.

    python benchmarks/bench_plan.py [--batch 2 --seq 1024]

For each case (activation checkpointing none and block; the configured optimizer, MuonAdamW, and AdamW) a fresh
process composes the config `python -m k3train model=k3_small ...` would run (vocab 32768, fp32, QK-Clip's
max-logit tracking on as its callback turns it on), builds the model and the optimizer, reads its resident memory,
runs one forward + backward + optimizer step and reads its peak resident memory (ru_maxrss); the difference is what
the step added, as benchmarks/bench_checkpointing.py measures it. The plan (k3train/plan/memory.py) predicts the
same quantity for a first step: the largest of the forward's end, the backward and the update, with no optimizer
state before the update (`first_step_added`).

Three allocator settings: glibc with a fixed mmap threshold of 128 KiB (MALLOC_MMAP_THRESHOLD_, "live"), under
which every tensor past 128 KiB is its own mapping and is returned when freed, so the resident memory follows the
bytes alive: what the plan predicts (target: within 25%); glibc's default, whose heap keeps freed blocks (it raises
its mmap threshold to the size of the tensors freed, so a layer's temporaries, interleaved in the heap with the
tensors it saves, stay resident); and what `python -m k3train` sets on a CPU (k3train/runtime/cpu.py's
keep_freed_memory: blocks up to 32 MiB from the heap, never trimmed). Writes benchmarks/results/plan.json with the
CPU model and the load average beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "plan.json"
REPO = Path(__file__).resolve().parents[1]
LIVE = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc: a fixed threshold, no dynamic raising, freed maps returned
CASES = [  # (checkpointing, optimizer, allocator)
    ("none", "muon_adamw", "live"),
    ("block", "muon_adamw", "live"),
    ("none", "adamw", "live"),
    ("block", "adamw", "live"),
    ("none", "muon_adamw", "glibc default"),
    ("block", "muon_adamw", "glibc default"),
    ("none", "muon_adamw", "k3train training"),
    ("block", "muon_adamw", "k3train training"),
]
TARGET = 0.25
MiB = 2**20


def overrides(mode: str, optim: str, batch: int, seq: int) -> list[str]:
    return [
        "model=k3_small",
        "model.vocab_size=32768",
        "precision=fp32",
        f"optim={optim}",
        f"train.batch_size={batch}",
        f"train.seq_len={seq}",
        f"train.activation_checkpointing={mode}",
    ]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def probe(mode: str, optim: str, allocator: str, batch: int, seq: int) -> dict:
    import torch
    from hydra.utils import instantiate

    from k3train.optim.qk_clip import set_max_logit_tracking
    from k3train.plan.__main__ import compose_config
    from k3train.runtime.cpu import keep_freed_memory

    if allocator == "k3train training":
        keep_freed_memory()
    cfg = compose_config(overrides(mode, optim, batch, seq))
    torch.manual_seed(0)
    model = instantiate(cfg.model).train()
    model.set_activation_checkpointing(mode)
    set_max_logit_tracking(model, "qk_clip" in cfg.callbacks)
    optimizer = instantiate(cfg.optim)(model)
    x, y = (torch.randint(0, 32768, (batch, seq)) for _ in range(2))
    before = rss_mib()
    t0 = time.perf_counter()
    _, loss = model(x, targets=y)
    forward = peak_mib() - before
    loss.backward()
    backward = peak_mib() - before
    optimizer.step()
    return {
        "step_s": round(time.perf_counter() - t0, 2),
        "rss_before_mib": round(before, 1),
        "peak_added_mib": round(peak_mib() - before, 1),
        "peak_added_by_phase_mib": {"forward": round(forward, 1), "backward": round(backward, 1)},
    }


def predict(mode: str, optim: str, batch: int, seq: int) -> dict:
    from k3train.plan.__main__ import compose_config
    from k3train.plan.memory import plan_memory
    from k3train.plan.mesh import Mesh
    from k3train.plan.spec import build_spec

    memory = plan_memory(build_spec(compose_config(overrides(mode, optim, batch, seq)), "cpu"), Mesh(), "cpu")
    state = sum(memory.optimizer.values())
    stored = memory.params + state
    return {
        "first_step_added_mib": round(memory.first_step_added / MiB, 1),
        "phases_without_stored_mib": {k: round((v - stored) / MiB, 1) for k, v in memory.phases.items()},
        "optimizer_state_mib": round(state / MiB, 1),
        "activations_mib": round(memory.activations / MiB, 1),
        "gradients_mib": round(memory.grads / MiB, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--probe", nargs=3, metavar=("MODE", "OPTIM", "ALLOCATOR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe, args.batch, args.seq)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_file import write_results

    from k3train.runtime.cpu import cpu_description

    load_before = os.getloadavg()
    rows = []
    for mode, optim, allocator in CASES:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(LIVE if allocator == "live" else {})}
        out = subprocess.run(
            [sys.executable, __file__, "--probe", mode, optim, allocator, "--batch", str(args.batch),
             "--seq", str(args.seq)],
            capture_output=True, text=True, check=True, env=env, cwd=REPO,
        )  # fmt: skip
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        predicted = predict(mode, optim, args.batch, args.seq)
        ratio = predicted["first_step_added_mib"] / measured["peak_added_mib"]
        row = {
            "checkpointing": mode,
            "optimizer": optim,
            "allocator": allocator,
            "measured": measured,
            "predicted": predicted,
            "predicted_over_measured": round(ratio, 3),
            "within_target": abs(ratio - 1) <= TARGET,
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }
        rows.append(row)
        print(
            f"{mode:<6} {optim:<11} {allocator:<16} measured +{measured['peak_added_mib']:7.0f} MiB   "
            f"predicted +{predicted['first_step_added_mib']:7.0f} MiB   ratio {ratio:5.3f}   "
            f"step {measured['step_s']:5.1f} s",
            flush=True,
        )
    result = {
        "what": "resident memory one first train step adds (ru_maxrss minus RSS before it) against the plan's "
        "first_step_added; k3_small, one CPU process",
        "model": "k3_small",
        "overrides": overrides("<mode>", "<optim>", args.batch, args.seq),
        "batch": args.batch,
        "seq_len": args.seq,
        "machine": cpu_description(),
        "threads": __import__("torch").get_num_threads(),
        "target": f"|predicted / measured - 1| <= {TARGET} with the live allocator",
        "rows": rows,
        "load_avg": [load_before, os.getloadavg()],
    }
    write_results(RESULTS, result)


if __name__ == "__main__":
    main()
