"""The plan's memory prediction against a measured train step: k3_small on this CPU, one process and 2 gloo ranks.

    python benchmarks/bench_plan.py [--batch 2 --seq 1024 --rank-batch 1 --only one|ranks]

One process: for each case (activation checkpointing none and block; the configured optimizer, MuonAdamW, and
AdamW) a fresh process composes the config `python -m k3train model=k3_small ...` would run (vocab 32768, fp32,
QK-Clip's max-logit tracking on as its callback turns it on), builds the model and the optimizer, reads its
resident memory, runs one forward + backward + optimizer step and reads its peak resident memory (ru_maxrss); the
difference is what the step added, as benchmarks/bench_checkpointing.py measures it. The plan
(k3train/plan/memory.py) predicts the same quantity for a first step: the largest of the forward's end, the
backward and the update, with no optimizer state before the update (`first_step_added`).

Three allocator settings: glibc with a fixed mmap threshold of 128 KiB (MALLOC_MMAP_THRESHOLD_, "live"), under
which every tensor past 128 KiB is its own mapping and is returned when freed, so the resident memory follows the
bytes alive: what the plan predicts (target: within 25%); glibc's default, whose heap keeps freed blocks (it raises
its mmap threshold to the size of the tensors freed, so a layer's temporaries, interleaved in the heap with the
tensors it saves, stay resident); and what `python -m k3train` sets on a CPU (k3train/runtime/cpu.py's
keep_freed_memory: blocks up to 32 MiB from the heap, never trimmed).

Two ranks (live allocator, checkpointing none, MuonAdamW; `--rank-batch` sequences per rank, 1 by default, so the
global batch is the one process's): parallel=fsdp (mesh 1x2x1), parallel=ddp parallel.ep=2 (2x1x2) and
parallel=fsdp parallel.ep=2 (1x2x2). Two processes started as torchrun would (RANK, WORLD_SIZE; a file rendezvous)
join a gloo group, one thread each, and build what k3train/run/build.py builds: ParallelDims.for_strategy, the
model (same seed on both), `parallel.shard`, the optimizer (`_build_optimizer`, Muon with the data-parallel
group), `parallel.wrap`. Each rank then runs Trainer.train_step's work for one micro-batch of its own tokens:
forward through the wrapped model, backward, `parallel.finish_gradients`, the loss's mean over the ranks,
global_grad_norm, clip_gradients, optimizer.step. Each rank's resident memory before the step and its peak during
it are its own; the peak is counted from the start of the step (the kernel's high-water mark is reset then, via
/proc/self/clear_refs, since building a sharded model first builds it whole) and again at the end of each phase
(forward; backward; finishing the gradients, their norm and clipping; the update), so each phase's own peak is
recorded beside the plan's for it, and each rank's largest is compared with the plan's first_step_added for that
mesh, which is per device. Writes benchmarks/results/plan.json with the CPU model and the load average beside the
figures, and when each row was measured; `--only` re-runs one kind of case and keeps the other's rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from process_memory import peak_mib, reset_peak, rss_mib  # benchmarks/, beside this script

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
RANK_CASES = [  # (parallel, ep, mesh dp_replicate x dp_shard x ep), 2 ranks, checkpointing none, MuonAdamW, live
    ("fsdp", 1, (1, 2, 1)),
    ("ddp", 2, (2, 1, 2)),
    ("fsdp", 2, (1, 2, 2)),
]
RANKS = 2
RANK_TIMEOUT_S = 900  # a hung collective fails the case instead of the benchmark
TARGET = 0.25
MiB = 2**20


def overrides(mode: str, optim: str, batch: int, seq: int, parallel: str | None = None, ep: int = 1) -> list[str]:
    out = [
        "model=k3_small",
        "model.vocab_size=32768",
        "precision=fp32",
        f"optim={optim}",
        f"train.batch_size={batch}",
        f"train.seq_len={seq}",
        f"train.activation_checkpointing={mode}",
    ]
    return out + ([f"parallel={parallel}", f"parallel.ep={ep}"] if parallel else [])


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


def rank_probe(strategy: str, ep: int, batch: int, seq: int, init_file: str) -> dict:
    """One rank of a 2-rank run (RANK, WORLD_SIZE from the environment): k3train/run/build.py's parts, then
    Trainer.train_step's work for one micro-batch (fp32: no autocast, no loss scaling; one micro-batch: no no_sync)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from k3train.optim.qk_clip import set_max_logit_tracking
    from k3train.plan.__main__ import compose_config
    from k3train.run.build import _build_optimizer
    from k3train.runtime.cpu import prepare_cpu_training
    from k3train.runtime.distributed import mean_across_ranks
    from k3train.runtime.parallel_dims import ParallelDims
    from k3train.train.parallel import clip_gradients, global_grad_norm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # two ranks on this machine's two cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        cfg = compose_config(overrides("none", "muon_adamw", batch, seq, strategy, ep))
        train_cfg = OmegaConf.to_object(cfg.train)
        device = torch.device("cpu")
        prepare_cpu_training()  # under the live allocator malloc is left as the environment sets it
        torch.manual_seed(train_cfg.seed)  # every rank builds the same weights, as seed_everything makes them
        parallel = instantiate(cfg.parallel)
        dims = ParallelDims.for_strategy(parallel.name, world, rank, device.type, getattr(parallel, "ep", 1))
        model = instantiate(cfg.model).train()
        model.set_activation_checkpointing(train_cfg.activation_checkpointing)
        set_max_logit_tracking(model, "qk_clip" in cfg.callbacks)
        model.to(device)
        model = parallel.shard(model, device, dims)
        optimizer = _build_optimizer(instantiate(cfg.optim), model, dims)
        replicated = parallel.wrap(model, device, dims)
        params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(1 + rank)  # each rank its own rows of the global batch
        x, y = (torch.randint(0, cfg.model.vocab_size, (batch, seq), generator=gen) for _ in range(2))
        dist.barrier()
        before = rss_mib()
        phases, reset = {}, reset_peak()

        def phase(name: str) -> None:  # the peak since the last phase ended, then a fresh high-water mark
            phases[name] = round(peak_mib() - before, 1)
            reset_peak()

        t0 = time.perf_counter()
        _, loss = replicated(x, targets=y)
        phase("forward")
        loss.backward()
        phase("backward")
        parallel.finish_gradients(model, dims)
        mean_across_ranks(loss.detach().float().item(), device, dims.dp_group)
        grad_norm = global_grad_norm(params, dims)
        if train_cfg.clip_norm is not None:
            clip_gradients(params, train_cfg.clip_norm, grad_norm)
        phase("gradients finished, norm, clip")
        rss_before_update = rss_mib() - before
        optimizer.step()
        phase("optimizer step")
        step_s = time.perf_counter() - t0
        dist.barrier()
        return {
            "rank": rank,
            "step_s": round(step_s, 2),
            "rss_before_mib": round(before, 1),
            "peak_added_mib": max(phases.values()) if reset else round(peak_mib() - before, 1),
            "peak_added_by_phase_mib": phases if reset else {},  # each phase's own peak, over rss_before_mib
            "rss_added_before_update_mib": round(rss_before_update, 1),
            "peak_from_step_start": reset,
        }
    finally:
        dist.destroy_process_group()


def run_ranks(strategy: str, ep: int, batch: int, seq: int) -> list[dict]:
    """Start RANKS processes of this script as torchrun would (RANK, WORLD_SIZE), with the live allocator; each
    prints its rank's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        procs, logs = [], []
        for rank in range(RANKS):
            env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **LIVE, "RANK": str(rank), "WORLD_SIZE": str(RANKS)}
            cmd = [sys.executable, __file__, "--rank-probe", strategy, str(ep), "--rank-batch", str(batch),
                   "--seq", str(seq), "--init-file", str(Path(tmp) / "init")]  # fmt: skip
            out, err = (open(Path(tmp) / f"rank{rank}.{kind}", "w+") for kind in ("out", "err"))
            logs.append((out, err))
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=REPO))
        deadline = time.monotonic() + RANK_TIMEOUT_S
        try:  # a rank that fails ends the case at once: its peer would wait in a collective until gloo's timeout
            while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"parallel={strategy} ep={ep}: {RANKS} ranks not done in {RANK_TIMEOUT_S} s")
                time.sleep(0.5)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts, errors = [], []
        for p, (out, err) in zip(procs, logs):
            out.seek(0), err.seek(0)
            texts.append(out.read())
            errors.append((p.returncode, err.read()))
            out.close(), err.close()
        failed = [e for e in errors if e[0] not in (0, -9)] or [e for e in errors if e[0]]  # -9: killed here
        if failed:
            raise RuntimeError(f"parallel={strategy} ep={ep}: a rank exited {failed[0][0]}:\n{failed[0][1][-4000:]}")
        return [json.loads(text.strip().splitlines()[-1]) for text in texts]


def predict(mode: str, optim: str, batch: int, seq: int, mesh: tuple[int, int, int] = (1, 1, 1),
            parallel: str | None = None) -> dict:  # fmt: skip
    from k3train.plan.__main__ import compose_config
    from k3train.plan.memory import plan_memory
    from k3train.plan.mesh import Mesh
    from k3train.plan.spec import build_spec

    cfg = compose_config(overrides(mode, optim, batch, seq, parallel, mesh[2]))
    memory = plan_memory(build_spec(cfg, "cpu"), Mesh(*mesh), "cpu")
    state = sum(memory.optimizer.values())
    stored = memory.params + state + memory.ddp_buckets
    out = {
        "first_step_added_mib": round(memory.first_step_added / MiB, 1),
        "phases_without_stored_mib": {k: round((v - stored) / MiB, 1) for k, v in memory.phases.items()},
        "optimizer_state_mib": round(state / MiB, 1),
        "activations_mib": round(memory.activations / MiB, 1),
        "gradients_mib": round(memory.grads / MiB, 1),
    }
    if mesh != (1, 1, 1):
        out["params_mib"] = round(memory.params / MiB, 1)
        out["ddp_buckets_mib"] = round(memory.ddp_buckets / MiB, 1)
        out["transients_mib"] = {k: round(v / MiB, 1) for k, v in memory.transients.items()}
    return out


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def one_process_rows(batch: int, seq: int) -> list[dict]:
    rows = []
    for mode, optim, allocator in CASES:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(LIVE if allocator == "live" else {})}
        out = subprocess.run(
            [sys.executable, __file__, "--probe", mode, optim, allocator, "--batch", str(batch), "--seq", str(seq)],
            capture_output=True, text=True, check=True, env=env, cwd=REPO,
        )  # fmt: skip
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        predicted = predict(mode, optim, batch, seq)
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
            "measured_at": now(),
        }
        rows.append(row)
        print(
            f"{mode:<6} {optim:<11} {allocator:<16} measured +{measured['peak_added_mib']:7.0f} MiB   "
            f"predicted +{predicted['first_step_added_mib']:7.0f} MiB   ratio {ratio:5.3f}   "
            f"step {measured['step_s']:5.1f} s",
            flush=True,
        )
    return rows


def rank_rows(batch: int, seq: int) -> list[dict]:
    rows = []
    for strategy, ep, mesh in RANK_CASES:
        t0 = time.perf_counter()
        ranks = run_ranks(strategy, ep, batch, seq)
        predicted = predict("none", "muon_adamw", batch, seq, mesh, strategy)
        ratios = [predicted["first_step_added_mib"] / r["peak_added_mib"] for r in ranks]
        phases = predicted["phases_without_stored_mib"]  # a first step's: no optimizer state before the update
        by_phase = {
            "forward": phases["forward end"],
            "backward": phases["backward"],
            "optimizer step": round(phases["optimizer step"] + predicted["optimizer_state_mib"], 1),
        }
        rows.append(
            {
                "parallel": strategy,
                "ep": ep,
                "mesh": "x".join(map(str, mesh)),
                "ranks": RANKS,
                "checkpointing": "none",
                "optimizer": "muon_adamw",
                "allocator": "live",
                "batch_per_rank": batch,
                "seq_len": seq,
                "measured_per_rank": ranks,
                "predicted": predicted,
                "predicted_first_step_by_phase_mib": by_phase,
                "predicted_over_measured_per_rank": [round(r, 3) for r in ratios],
                "within_target": all(abs(r - 1) <= TARGET for r in ratios),
                "case_s": round(time.perf_counter() - t0, 1),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "measured_at": now(),
            }
        )
        measured = " ".join(f"+{r['peak_added_mib']:6.0f}" for r in ranks)
        print(
            f"parallel={strategy:<4} ep {ep} mesh {rows[-1]['mesh']}  measured {measured} MiB (per rank)   "
            f"predicted +{predicted['first_step_added_mib']:6.0f} MiB   ratios "
            f"{' '.join(f'{r:5.3f}' for r in ratios)}   step {max(r['step_s'] for r in ranks):5.1f} s",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2, help="sequences of the one-process step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rank-batch", type=int, default=1, help="sequences per rank of the 2-rank steps")
    ap.add_argument("--only", choices=("one", "ranks"), help="run one kind of case, keep the other's rows")
    ap.add_argument("--probe", nargs=3, metavar=("MODE", "OPTIM", "ALLOCATOR"), help=argparse.SUPPRESS)
    ap.add_argument("--rank-probe", nargs=2, metavar=("PARALLEL", "EP"), help=argparse.SUPPRESS)
    ap.add_argument("--init-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe, args.batch, args.seq)))
        return
    if args.rank_probe:
        strategy, ep = args.rank_probe
        print(json.dumps(rank_probe(strategy, int(ep), args.rank_batch, args.seq, args.init_file)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_file import write_results

    from k3train.runtime.cpu import cpu_description

    old = json.loads(RESULTS.read_text()) if args.only and RESULTS.exists() else {}
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    if args.only == "ranks":
        rows = old.get("rows", [])
        keep = {k: old[k] for k in ("overrides", "batch", "seq_len", "machine", "threads") if k in old}
    else:
        rows = one_process_rows(args.batch, args.seq)
        keep = {
            "overrides": overrides("<mode>", "<optim>", args.batch, args.seq),
            "batch": args.batch,
            "seq_len": args.seq,
            "machine": cpu_description(),
            "threads": __import__("torch").get_num_threads(),
        }
    if args.only == "one":
        two = {k: old[k] for k in ("two_ranks", "two_ranks_machine") if k in old}
    else:
        two = {
            "two_ranks": rank_rows(args.rank_batch, args.seq),
            "two_ranks_machine": {**cpu_description(), "threads_per_rank": 1},
        }
    result = {
        "what": "resident memory one first train step adds (ru_maxrss minus RSS before it) against the plan's "
        "first_step_added; k3_small, one CPU process (rows) and 2 gloo ranks, each rank against the plan's per "
        "device figure for its mesh (two_ranks)",
        "model": "k3_small",
        **keep,
        "target": f"|predicted / measured - 1| <= {TARGET} with the live allocator",
        "rows": rows,
        "two_ranks_overrides": overrides("none", "muon_adamw", args.rank_batch, args.seq, "<parallel>", "<ep>"),
        **two,
        "load_avg": [load_before, os.getloadavg()],
        "runtime_s": round(time.perf_counter() - t0, 1),
    }
    write_results(RESULTS, result)


if __name__ == "__main__":
    main()
