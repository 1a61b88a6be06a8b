"""prepare's tokens/s: one worker against a pool of N worker processes, for .jsonl and .parquet inputs.

    python benchmarks/bench_prepare.py               # ~16 MB, fastest of 3 interleaved runs (~3 min on 2 cores)
    python benchmarks/bench_prepare.py --quick       # ~3 MB, once each (< 1 minute); writes only with --out

The corpus is generated (seeded): documents of 200 to 20,000 characters, each a run of consecutive words from a
random place in the built-in corpus (pydoc_data.topics), so the word distribution is real English but the text is
not one block repeated. It is written as one .jsonl and, with `datasets` installed, as one .parquet holding the
same documents (pyarrow, 1,024 rows per row group). Each input is prepared (`prepare_dataset`, val_fraction 0.05,
1M-token shards: the whole command's work, reading, the val pre-pass, tokenizing and writing) with the byte
tokenizer and with bench_data.py's 4,096-entry byte-level BPE, by 1 worker (tokenizing in the main process; for
BPE the tokenizers library then uses its own thread per core) and by N worker processes (default: every usable
core; each single-threaded, the main process reads and writes), plus BPE by 1 worker with
TOKENIZERS_PARALLELISM=false: one process, one thread. tokens/s counts the tokens written (both splits) over the
wall time (the fastest run), and over the CPU time used (this process's threads and the pool's processes): on a
machine other work keeps busy, wall-clock speedups say little, while tokens per CPU second show what the pool's
processes cost beside one process (pickling the text, the main process's share). The datasets written by 1 and N
workers are checked to be identical (fingerprints).

Prints the figures side by side with the CPU (lscpu's model name, torch's CPU capability) and the load average
(/proc/loadavg before and after), and writes benchmarks/results/prepare.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from bench_data import train_bpe  # benchmarks/, beside this script
from results_file import write_unless_quick

from k3train.data import HFTokenizer, prepare_dataset
from k3train.data.builtin import builtin_documents
from k3train.runtime.cpu import cpu_description, usable_cpus

RESULTS = Path(__file__).resolve().parent / "results" / "prepare.json"


def generate_documents(megabytes: float, seed: int = 0) -> list[str]:
    words = " ".join(builtin_documents()).split(" ")
    rng = random.Random(seed)
    docs, size = [], 0
    while size < megabytes * 1e6:
        start, n = rng.randrange(len(words)), rng.randrange(30, 3000)
        doc = " ".join(words[start : start + n])[: rng.randrange(200, 20_000)]
        docs.append(doc)
        size += len(doc.encode())
    return docs


def write_inputs(docs: list[str], tmp: Path) -> dict[str, Path]:
    inputs = {"jsonl": tmp / "corpus.jsonl"}
    with open(inputs["jsonl"], "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    try:
        import datasets  # noqa: F401  (prepare reads .parquet through it)
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        print("datasets is not installed (pip install datasets): .jsonl only")
        return inputs
    inputs["parquet"] = tmp / "corpus.parquet"
    pq.write_table(pa.table({"text": docs}), inputs["parquet"], row_group_size=1024)
    return inputs


def lscpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None)


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads) and of its reaped children (the pool's workers)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def time_prepare(path: Path, out: Path, single_thread: bool = False, **kwargs) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds, manifest) of one prepare."""
    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the tokenizers library at each call
    try:
        start, cpu = time.perf_counter(), cpu_seconds()
        manifest = prepare_dataset([path], out, overwrite=True, shard_tokens=1 << 20, **kwargs)
        return time.perf_counter() - start, cpu_seconds() - cpu, manifest
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)


def time_cases(path: Path, out: Path, cases: dict[str, dict], repeats: int) -> dict[str, dict]:
    """The fastest of `repeats` runs per case, the cases interleaved so that a changing load hits each alike."""
    seconds: dict[str, list[float]] = {case: [] for case in cases}
    cpu: dict[str, list[float]] = {case: [] for case in cases}
    manifests = {}
    for _ in range(repeats):
        for case, kwargs in cases.items():
            elapsed, used, manifests[case] = time_prepare(path, out, **kwargs)
            seconds[case].append(elapsed)
            cpu[case].append(used)
    row = {}
    for case, manifest in manifests.items():
        tokens, best = sum(s["num_tokens"] for s in manifest["splits"].values()), min(seconds[case])
        row[case] = {
            "seconds": best,
            "all_seconds": seconds[case],
            "tokens": tokens,
            "tokens_per_s": tokens / best,
            # CPU time is what the work costs whatever else runs: tokens per CPU second compares the pool's
            # overhead with one process's on a loaded machine, where wall-clock speedups say little
            "cpu_seconds": min(cpu[case]),
            "tokens_per_cpu_s": tokens / min(cpu[case]),
            "fingerprint": manifest["fingerprint"],
        }
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, help="corpus size in MB of text (default 16; 3 with --quick)")
    p.add_argument("--workers", type=int, default=usable_cpus()[0], help="the pool's size (default: usable cores)")
    p.add_argument("--repeats", type=int, help="runs per case, the fastest kept (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="a small corpus, one run per case; no results file")
    p.add_argument("--out", type=Path, help="results file (default: benchmarks/results/prepare.json)")
    args = p.parse_args()
    mb = args.mb or (3 if args.quick else 16)
    repeats = args.repeats or (1 if args.quick else 3)
    n = args.workers
    result: dict = {
        "benchmark": "prepare tokens/s, 1 worker vs a pool",
        "cpu": {"lscpu_model_name": lscpu_model(), **cpu_description(), "usable_cores": usable_cpus()[0]},
        "loadavg_before": Path("/proc/loadavg").read_text().strip(),
        "workers": n,
        "repeats": repeats,
    }
    cases = {"1 worker": {"workers": 1}, f"{n} workers": {"workers": n}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = generate_documents(mb)
        result["corpus"] = {"documents": len(docs), "text_mb": sum(len(d.encode()) for d in docs) / 1e6}
        inputs = write_inputs(docs, tmp)
        bpe = HFTokenizer(train_bpe(tmp / "tokenizer.json"), "<|endoftext|>")
        table = {}
        for fmt, path in inputs.items():
            for tok_name, tok in {"byte": None, "bpe4096": bpe}.items():
                these = {case: {**kwargs, "tokenizer": tok} for case, kwargs in cases.items()}
                if tok is not None:
                    these["1 worker, 1 thread"] = {"tokenizer": tok, "workers": 1, "single_thread": True}
                row = time_cases(path, tmp / "out", these, repeats)
                fingerprints = {r["fingerprint"] for r in row.values()}
                assert len(fingerprints) == 1, f"{fmt} {tok_name}: the worker counts wrote different datasets"
                table[f"{fmt} {tok_name}"] = row
    result["prepare"] = table
    result["loadavg_after"] = Path("/proc/loadavg").read_text().strip()

    cpu = result["cpu"]
    print(
        f"CPU: {cpu['lscpu_model_name'] or cpu['cpu_model']}, torch {cpu['torch_cpu_capability']}, "
        f"{cpu['usable_cores']} usable cores; /proc/loadavg {result['loadavg_before']} -> {result['loadavg_after']}"
    )
    print(f"corpus: {result['corpus']['text_mb']:.1f} MB, {result['corpus']['documents']:,} documents")
    columns = [*cases, "1 worker, 1 thread"]
    print("M tokens per wall second (per CPU second, all threads and processes)")
    print(f"{'input, tokenizer':<18} {'tokens':>11} " + " ".join(f"{c:>22}" for c in columns) + "  speedup")
    for name, row in table.items():
        cells = [
            f"{row[c]['tokens_per_s'] / 1e6:>11.2f} ({row[c]['tokens_per_cpu_s'] / 1e6:6.2f}/cpu)" if c in row else "-"
            for c in columns
        ]
        speedup = row[f"{n} workers"]["tokens_per_s"] / row["1 worker"]["tokens_per_s"]
        print(
            f"{name:<18} {row['1 worker']['tokens']:>11,} " + " ".join(f"{c:>22}" for c in cells) + f"  {speedup:6.2f}x"
        )
    write_unless_quick(args.out, args.quick, RESULTS, result)


if __name__ == "__main__":
    main()
