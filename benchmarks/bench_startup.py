"""Start-up at scale: what building and allocating a run's model costs a rank (k3train/run/build.py's path: the model
on the meta device, sharded, then only this rank's part allocated and drawn, k3train/models/common/init.py) against
building it whole first and sharding it after (what k3train did before), and a dry run of one rank of Kimi K3.

    python benchmarks/bench_startup.py                 # ~1 GB fp32 model on 2 gloo ranks, both ways (~1 minute)
    python benchmarks/bench_startup.py --k3            # and rank 0 of K3 on 4,096 H200s, dry-run (many minutes)
    python benchmarks/bench_startup.py --quick         # a 20-second smoke test (k3_tiny)

Each way runs in fresh processes (a peak of resident memory is a process's), FSDP2 over the ranks, 1 thread a rank,
malloc returning freed memory (as a dry run sets it): per rank the seconds to build and the peak resident memory
added over the process's baseline, beside its share of the model and the whole model's fp32 bytes. The K3 rank is
`python -m k3train ... dry_run.world_size=4096 dry_run.rank=0` with the planner's fitting recipe for 4,096 H200s
(FSDP2 x ep 128, bf16, block checkpointing; train.seq_len 8: the built-in corpus must hold one global batch of 4,096
rows), on the built-in corpus tokenised by a byte-level tokenizer.json with the release's 163,840 ids (256 bytes, an
end-of-document token, the rest reserved), so the embedding and head are the released model's; its dry_run.json read
back. Writes benchmarks/results/startup.json (or --out) with the
CPU, torch's SIMD level and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results_file import write_unless_quick  # benchmarks/, beside this script

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "startup.json"
GIB = 2**30
K3_VOCAB = 163_840  # the release's (conf/model/k3.yaml)
K3_DRY_RUN = [
    "model=k3", "precision=bf16", "train.seq_len=8", "train.batch_size=1",
    "train.activation_checkpointing=block", "parallel=fsdp", "parallel.ep=128", "train.max_steps=1",
    "dry_run.world_size=4096", "dry_run.rank=0",
]  # fmt: skip


def _resident(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith(field))) * 1024


def _rank(rank: int, world: int, init: str, out: str, way: str, model_name: str, layers: int) -> None:
    from k3train.config import model_option
    from k3train.models.common.init import InitialWeights, materialise
    from k3train.models.common.parallelize import FullyShard
    from k3train.runtime.cpu import prepare_cpu_training
    from k3train.runtime.parallel_dims import ParallelDims

    torch.set_num_threads(1)
    prepare_cpu_training(keep_freed=False)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))  # fmt: skip
    from hydra.utils import instantiate

    cfg = model_option(model_name)
    cfg.vocab_size, cfg.n_layers = 32768, layers
    dims = ParallelDims.for_strategy("fsdp", world, rank, "cpu", 1, 1, 1, 1)
    torch.manual_seed(0)
    before = _resident("VmRSS:")
    start = time.perf_counter()
    if way == "meta":  # k3train's path
        with torch.device("meta"):
            model = instantiate(cfg)
        model.parallelize(dims, FullyShard())
        materialise(model, torch.device("cpu"), InitialWeights(model.init_rules(), 0))
    else:  # before: the whole model built and drawn on every rank, then sharded
        model = instantiate(cfg)
        model.parallelize(dims, FullyShard())
    seconds = time.perf_counter() - start
    held = sum(p.to_local().numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    result = {"seconds": seconds, "added_peak": _resident("VmHWM:") - before, "held": held * 4, "whole": whole * 4}
    Path(out, f"{way}{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def build_both_ways(model_name: str, layers: int, world: int) -> dict:
    out = {}
    for way in ("meta", "whole_first"):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(world, f"{tmp}/init", tmp, way, model_name, layers), nprocs=world)
            ranks = [json.loads(Path(tmp, f"{way}{r}.json").read_text()) for r in range(world)]
        out[way] = ranks
        r = ranks[0]
        print(
            f"{way:>12}: {r['seconds']:6.1f} s, peak +{r['added_peak'] / GIB:5.2f} GiB on rank 0 (its share "
            f"{r['held'] / GIB:.2f} GiB of {r['whole'] / GIB:.2f} GiB)",
            flush=True,
        )
    return out


def released_vocabulary_tokenizer(path: Path) -> list[str]:
    """A byte-level BPE tokenizer.json with K3_VOCAB ids (no merges: text is its bytes), and the data overrides that
    tokenise the built-in corpus with it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    vocab |= {f"<|reserved_{i}|>": len(vocab) + i for i in range(K3_VOCAB - len(vocab))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))
    return [f"data.tokenizer={path}", "data.eod_token='<|endoftext|>'"]


def k3_dry_run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = released_vocabulary_tokenizer(Path(tmp, "tokenizer.json"))
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "k3train", *K3_DRY_RUN, *data, f"hydra.run.dir={tmp}/run"],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
        print(proc.stdout, end="")
        return {**json.loads(Path(tmp, "run", "dry_run.json").read_text()), "wall_s": wall, "overrides": K3_DRY_RUN}


def main() -> None:
    from k3train.runtime.cpu import cpu_description  # as the helpers above: k3train loads inside the functions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--k3", action="store_true", help="also dry-run rank 0 of K3 on 4,096 H200s")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_name, layers = ("k3_tiny", 2) if args.quick else ("k3_small", 24)
    result = {
        **cpu_description(),
        "load_average": os.getloadavg(),
        "cores": os.cpu_count(),
        "model": f"{model_name} at {layers} layers, vocab 32768, FSDP2 over {args.ranks} gloo ranks",
        "build": build_both_ways(model_name, layers, args.ranks),
    }
    if args.k3:
        result["k3_dry_run"] = k3_dry_run()
    write_unless_quick(args.out, args.quick, RESULTS, result)


if __name__ == "__main__":
    main()
