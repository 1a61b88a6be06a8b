"""Data pipeline throughput: prepare (MB of text per second) and the loader (tokens per second).

    python benchmarks/bench_data.py [--repeats 16] [--batches 20000]

Prepare: the built-in corpus (pydoc_data.topics) repeated `repeats` times (~0.47 MB each) is written as one .jsonl
and prepared with the byte tokenizer and with a 4096-entry byte-level BPE trained here on the corpus, in process
and with a pool of one worker process per usable core. Throughput counts the UTF-8 bytes of document text.
Repeated text flatters BPE a little: the tokenizers library caches the encoding of each word it has seen, and
real corpora repeat words less.

Loader: TokenDataLoader at B=8, T=1024 over the byte-prepared data cut into 1M-token shards (so reads cross shard
boundaries), `batches` next_batch calls (passes restart with reset()), reported as input tokens (B*T) per second.

Prints the numbers and writes benchmarks/results/data.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from results_file import write_results  # benchmarks/, beside this script

from k3train.data import EndOfData, HFTokenizer, ShardedTokenDataset, TokenDataLoader, prepare_dataset
from k3train.data.builtin import builtin_documents
from k3train.runtime.cpu import usable_cpus

RESULTS = Path(__file__).resolve().parent / "results" / "data.json"


def write_corpus(path: Path, repeats: int) -> int:
    """The built-in documents `repeats` times as .jsonl; returns the UTF-8 bytes of document text."""
    docs = builtin_documents()
    with open(path, "w") as f:
        for _ in range(repeats):
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
    return repeats * sum(len(d.encode()) for d in docs)


def train_bpe(path: Path, vocab_size: int = 4096) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_documents(), trainer)
    tok.save(str(path))
    return path


def time_prepare(corpus: Path, out: Path, text_bytes: int, **kwargs) -> dict:
    start = time.perf_counter()
    manifest = prepare_dataset([corpus], out, overwrite=True, **kwargs)
    seconds = time.perf_counter() - start
    tokens = sum(s["num_tokens"] for s in manifest["splits"].values())
    return {
        "seconds": seconds,
        "mb_per_s": text_bytes / seconds / 1e6,
        "tokens": tokens,
        "bytes_per_token": text_bytes / tokens,
    }


def time_loader(data_dir: Path, batches: int, B: int = 8, T: int = 1024) -> dict:
    loader = TokenDataLoader(ShardedTokenDataset(data_dir, "train"), B, T)
    per_pass = loader.batches_remaining()
    start = time.perf_counter()
    for _ in range(batches):
        try:
            loader.next_batch()
        except EndOfData:
            loader.reset()
            loader.next_batch()
    seconds = time.perf_counter() - start
    return {
        "batch_size": B,
        "seq_len": T,
        "batches": batches,
        "batches_per_pass": per_pass,
        "seconds": seconds,
        "tokens_per_s": batches * B * T / seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--batches", type=int, default=20000)
    args = p.parse_args()
    cores = usable_cpus()[0]
    results: dict = {
        "benchmark": "data prepare MB/s and loader tokens/s",
        "python": platform.python_version(),
        "cores": cores,
        "load_avg_at_start": list(os.getloadavg()),
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        text_bytes = write_corpus(corpus, args.repeats)
        results["text_mb"] = text_bytes / 1e6
        bpe = HFTokenizer(train_bpe(tmp / "tokenizer.json"), "<|endoftext|>")
        # workers=1 tokenizes in this process (for BPE the tokenizers library still uses its own threads);
        # pool_N uses N worker processes, each single-threaded.
        cases = {
            "byte_in_process": dict(workers=1),
            f"byte_pool_{cores}": dict(workers=cores),
            "bpe4096_in_process": dict(tokenizer=bpe, workers=1),
            f"bpe4096_pool_{cores}": dict(tokenizer=bpe, workers=cores),
        }
        results["prepare"] = {}
        for name, kwargs in cases.items():
            out = tmp / name
            results["prepare"][name] = time_prepare(corpus, out, text_bytes, shard_tokens=1 << 20, **kwargs)
            print(
                f"prepare {name:>20}: {results['prepare'][name]['mb_per_s']:8.2f} MB/s "
                f"({results['prepare'][name]['seconds']:.2f} s, {results['prepare'][name]['tokens']:,} tokens)"
            )
        results["loader"] = time_loader(tmp / "byte_in_process", args.batches)
        print(
            f"loader B=8 T=1024: {results['loader']['tokens_per_s'] / 1e6:.1f} M tokens/s "
            f"({args.batches} batches in {results['loader']['seconds']:.3f} s)"
        )
    write_results(RESULTS, results)


if __name__ == "__main__":
    main()
