"""`python -m k3train.prepare`: text files -> a prepared dataset directory (format: manifest.py).

    python -m k3train.prepare corpus/ extra/*.jsonl.gz --output data/mycorpus
    python -m k3train.prepare docs.jsonl --val-inputs held_out.jsonl --tokenizer tok/tokenizer.json \
        --eod-token "<|endoftext|>" --output data/bpe
    python -m k3train.prepare hub_download/data/ --text-field content --output data/code  # .parquet/.arrow rows

The pipeline streams: sources.py yields document pieces, which are grouped into ~CHUNK_CHARS chunks per split,
tokenized by a process pool (at most 2 chunks per worker in flight, results consumed in submission order, so the
output does not depend on the worker count and memory stays bounded), and appended to the split's shards while
their sha256 is computed. Everything is written into a hidden temporary sibling of the output directory, which is
renamed into place only after the manifest is written (k3train.files.atomic_directory): an interrupted prepare
never leaves a directory that looks complete.

Exit status (docs/errors.md): 0 done, 2 bad input (missing, empty or undecodable inputs, a bad tokenizer or option,
an existing --output), 1 a failure during the work (a write that failed: a full disk); either way one line on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from k3train.data.manifest import FORMAT_VERSION, MANIFEST_NAME, SPLITS, fingerprint, token_dtype
from k3train.data.sources import (
    VAL_FRACTION_TOLERANCE,
    PrepareError,
    check_tables,
    document_sizes,
    expand_inputs,
    iter_pieces,
    plan_split,
    split_by_plan,
)
from k3train.data.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer
from k3train.files import atomic_directory
from k3train.runtime.cpu import usable_cpus

CHUNK_CHARS = 1 << 18
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB per uint16 shard
DEFAULT_VAL_FRACTION = 0.05

Chunk = tuple[str, list[tuple[str, bool]]]  # (split, pieces)


def encode_chunk(tokenizer: Tokenizer, pieces: Sequence[tuple[str, bool]]) -> np.ndarray:
    """Tokenize pieces, appending eod_id after each document's last piece; returns the shard dtype."""
    eod = np.array([tokenizer.eod_id], dtype=np.int64)
    arrays = tokenizer.encode_batch([text for text, _ in pieces])
    parts = [a for arr, (_, last) in zip(arrays, pieces, strict=True) for a in ((arr, eod) if last else (arr,))]
    tokens = np.concatenate(parts)
    if tokens.size and int(tokens.max()) >= tokenizer.vocab_size:
        raise PrepareError(
            f"{tokenizer!r} produced token id {int(tokens.max())} >= its vocab_size {tokenizer.vocab_size}; "
            f"the tokenizer file is inconsistent, fix or replace it"
        )
    return tokens.astype(token_dtype(tokenizer.vocab_size))


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    # One process per core already: a Rust thread pool inside each worker would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = tokenizer


def _encode_in_worker(pieces: list[tuple[str, bool]]) -> np.ndarray:
    assert _worker_tokenizer is not None, "_init_worker did not run"
    return encode_chunk(_worker_tokenizer, pieces)


def encode_chunks(chunks: Iterable[Chunk], tokenizer: Tokenizer, workers: int) -> Iterator[tuple[str, np.ndarray]]:
    """(split, tokens) for each chunk, in input order; workers > 1 tokenizes in that many processes."""
    if workers <= 1:
        for split, pieces in chunks:
            yield split, encode_chunk(tokenizer, pieces)
        return
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending: deque = deque()
        for split, pieces in chunks:
            pending.append((split, pool.apply_async(_encode_in_worker, (pieces,))))
            if len(pending) >= 2 * workers:
                split, result = pending.popleft()
                yield split, result.get()
        while pending:
            split, result = pending.popleft()
            yield split, result.get()


def chunk_by_split(stream: Iterable[tuple[str, str, bool]], chunk_chars: int) -> Iterator[Chunk]:
    """Group (split, text, last) pieces into per-split chunks of about chunk_chars characters."""
    buffers: dict[str, list[tuple[str, bool]]] = {s: [] for s in SPLITS}
    sizes = dict.fromkeys(SPLITS, 0)
    for split, text, last in stream:
        buffers[split].append((text, last))
        sizes[split] += len(text)
        if sizes[split] >= chunk_chars:
            yield split, buffers[split]
            buffers[split], sizes[split] = [], 0
    yield from ((s, b) for s, b in buffers.items() if b)


class SplitWriter:
    """Appends one split's tokens to <split>_NNNNNN.bin shards of at most shard_tokens, hashing as it goes."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.num_tokens = self.num_documents = 0
        self.max_token_id = -1
        self._sha = hashlib.sha256()
        self._file: BinaryIO | None = None

    def write(self, tokens: np.ndarray) -> None:
        if not tokens.size:
            return
        self._sha.update(tokens.tobytes())
        self.max_token_id = max(self.max_token_id, int(tokens.max()))
        self.num_tokens += tokens.size
        while tokens.size:
            if self._file is None:
                name = f"{self.split}_{len(self.shards):06d}.bin"
                self.shards.append({"file": name, "num_tokens": 0})
                self._file = open(self.directory / name, "wb")
            shard = self.shards[-1]
            take = min(tokens.size, self.shard_tokens - shard["num_tokens"])
            self._file.write(tokens[:take].tobytes())
            shard["num_tokens"] += take
            tokens = tokens[take:]
            if shard["num_tokens"] == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._file is not None
        self._file.close()  # fsynced with the whole directory by atomic_directory
        self._file = None

    def close(self) -> dict[str, Any]:
        """The split's manifest entry."""
        if self._file is not None:
            self._close_shard()
        return {
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "max_token_id": self.max_token_id,
            "sha256": self._sha.hexdigest(),
            "shards": self.shards,
        }


def _check_output(output: Path, overwrite: bool) -> None:
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return
    if not overwrite:
        raise FileExistsError(
            f"{output} already exists; choose another output, or replace it (prepare's --overwrite, overwrite=True)"
        )
    if not (output / MANIFEST_NAME).is_file():
        raise FileExistsError(
            f"{output} exists and is not a prepared dataset (no {MANIFEST_NAME}); refusing to replace it even with "
            f"--overwrite; remove it yourself or choose another output"
        )


def write_dataset(
    stream: Iterable[tuple[str, str, bool]],
    output: str | Path,
    tokenizer: Tokenizer,
    *,
    source: dict[str, Any],
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 1,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize (split, text, last) pieces into a prepared dataset at output; returns its manifest.

    source is recorded in the manifest (where the text came from); it is not part of the fingerprint."""
    output = Path(output)
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    _check_output(output, overwrite)
    # Re-checked before the swap: what appeared at output meanwhile must still be a dataset we may replace.
    with atomic_directory(output, may_replace=lambda existing: _check_output(existing, overwrite)) as tmp:
        dtype = token_dtype(tokenizer.vocab_size)
        writers = {s: SplitWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}

        def counted(chunks: Iterable[Chunk]) -> Iterator[Chunk]:
            for split, pieces in chunks:
                writers[split].num_documents += sum(last for _, last in pieces)
                yield split, pieces

        for split, tokens in encode_chunks(counted(chunk_by_split(stream, CHUNK_CHARS)), tokenizer, workers):
            writers[split].write(tokens)
        splits = {s: w.close() for s, w in writers.items()}
        for name, entry in splits.items():
            if entry["num_tokens"] == 0:
                raise PrepareError(_empty_split_message(name, source))
        manifest = {
            "format_version": FORMAT_VERSION,
            "tokenizer": tokenizer.identity(),
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.str,
            "fingerprint": fingerprint(tokenizer.identity(), splits),
            "splits": splits,
            "source": source,
        }
        for file in tokenizer.files():  # a BPE tokenizer's own (tokenizer.json; tiktoken.model and its config)
            shutil.copyfile(file, tmp / file.name)
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")  # written last, fsynced by the swap
    return manifest


def _empty_split_message(split: str, source: dict[str, Any]) -> str:
    if split == "val" and not source.get("val_inputs"):
        return (
            f"the val split is empty: the inputs hold too little text for val_fraction "
            f"{source.get('val_fraction')}; add documents, raise --val-fraction, or pass --val-inputs"
        )
    inputs = source.get("val_inputs" if split == "val" else "inputs")
    return f"the {split} split is empty: {inputs} contain no text (empty input); pass files with text in them"


def prepare_dataset(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    val_fraction: float | None = None,
    val_inputs: Sequence[str | Path] = (),
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Prepare text files into a dataset at output (the Python form of the CLI); returns the manifest.

    val comes from val_inputs when given, else from val_fraction (default DEFAULT_VAL_FRACTION) of the text,
    chosen by sources.plan_split after a pre-pass that measures every document. workers defaults to every usable
    core (1 for the byte tokenizer)."""
    tokenizer = tokenizer or load_tokenizer("byte")
    if val_inputs and val_fraction is not None:
        raise PrepareError("give either val_fraction (--val-fraction) or val_inputs (--val-inputs), not both")
    if val_fraction is None and not val_inputs:
        val_fraction = DEFAULT_VAL_FRACTION
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise PrepareError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    files = expand_inputs(inputs)
    val_files = expand_inputs(val_inputs) if val_inputs else []
    if both := sorted(set(files) & set(val_files)):
        raise PrepareError(f"{both[0]} is in both the inputs and the val inputs; a file belongs to one split")
    check_tables(files + val_files, text_field)  # .parquet/.arrow: datasets installed, the text column there
    # Byte "tokenization" is a memcpy that costs less than shipping the text to another process.
    workers = workers or (1 if isinstance(tokenizer, ByteTokenizer) else usable_cpus()[0])
    bar = tqdm(
        total=sum(f.stat().st_size for f in files + val_files),
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not progress or not sys.stderr.isatty(),
    )

    def pieces(paths: list[Path], on_read=bar.update) -> Iterator[tuple[str, bool]]:
        return itertools.chain.from_iterable(iter_pieces(p, text_field, on_read) for p in paths)

    if val_files:
        stream = itertools.chain(
            (("train", t, last) for t, last in pieces(files)), (("val", t, last) for t, last in pieces(val_files))
        )
        cut = None
    else:
        sizes = document_sizes(pieces(files, on_read=None))  # reads the inputs once more, without tokenizing
        heads = plan_split(sizes, val_fraction)
        stream = split_by_plan(pieces(files), heads)
        cut = sum(0 < head < size for head, size in zip(heads, sizes, strict=True))
    source = {
        "inputs": [str(f) for f in files],
        "val_inputs": [str(f) for f in val_files],
        "val_fraction": val_fraction,
        "documents_cut": cut,  # split head -> train, tail -> val (too few documents to hold val_fraction whole)
        "text_field": text_field,
    }
    with bar:
        return write_dataset(
            stream, output, tokenizer, source=source, shard_tokens=shard_tokens, workers=workers, overwrite=overwrite
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m k3train.prepare",
        description="Tokenize text files (.txt, .jsonl, and their .gz; .parquet and .arrow through Hugging Face "
        "datasets, local files only) into a prepared k3train dataset.",
    )
    p.add_argument("inputs", nargs="+", help="files, folders (searched recursively) or globs")
    p.add_argument("--output", "-o", required=True, help="dataset directory to create")
    p.add_argument("--tokenizer", default="byte", help='"byte" or a local tokenizer.json (default: %(default)s)')
    p.add_argument("--eod-token", help='end-of-document token of a tokenizer.json, e.g. "<|endoftext|>"')
    split = p.add_mutually_exclusive_group()
    split.add_argument(
        "--val-fraction",
        type=float,
        help=f"share of the text held out as val (default {DEFAULT_VAL_FRACTION}): whole documents, or the tails "
        "of documents cut in two when there are too few to hold the share",
    )
    split.add_argument("--val-inputs", nargs="+", default=[], help="files, folders or globs for the val split")
    p.add_argument(
        "--text-field",
        default="text",
        help="JSON field of a .jsonl line, or column of a .parquet/.arrow row, holding a document's text "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file (default: %(default)s)"
    )
    p.add_argument("--workers", type=int, help="tokenizer processes (default: every usable core; 1 for byte)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared dataset at --output")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar or summary")
    return p


def _val_summary(manifest: dict[str, Any]) -> str:
    source, splits = manifest["source"], manifest["splits"]
    val = splits["val"]["num_tokens"]
    share = val / (val + splits["train"]["num_tokens"])
    if source.get("val_fraction") is None:
        return f"val: {val:,} tokens from --val-inputs ({share:.2%} of all tokens)"
    how = (
        f"{source['documents_cut']:,} large documents cut in two (head -> train, tail -> val): whole documents "
        f"would have missed it by more than {VAL_FRACTION_TOLERANCE:.0%} of it"
        if source["documents_cut"]
        else "whole documents"
    )
    return f"val: {val:,} tokens = {share:.2%} of the tokens (asked {source['val_fraction']:.2%}); {how}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        manifest = prepare_dataset(
            args.inputs,
            args.output,
            tokenizer=load_tokenizer(args.tokenizer, args.eod_token),
            val_fraction=args.val_fraction,
            val_inputs=args.val_inputs,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            workers=args.workers,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except (PrepareError, ValueError, FileExistsError, FileNotFoundError) as e:  # bad input: fix the command
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the work failed (a full disk): nothing is left at --output
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        splits = manifest["splits"]
        counts = ", ".join(
            f"{s} {splits[s]['num_tokens']:,} tokens ({splits[s]['num_documents']:,} docs)" for s in SPLITS
        )
        print(
            f"prepared {args.output}: {counts}; vocab_size {manifest['vocab_size']}, "
            f"fingerprint {manifest['fingerprint'][:16]}, {time.perf_counter() - start:.1f} s"
        )
        print(_val_summary(manifest))
    return 0
