"""`python -m k3train.tokenizer train INPUTS... --vocab-size N --out tokenizer.json`: a byte-level BPE tokenizer of
your own, trained on a corpus (k3train/data/bpe_training.py), which `python -m k3train.prepare --tokenizer
tokenizer.json --eod-token '<|endoftext|>'` then uses.

INPUTS are what prepare reads (.txt, .jsonl and their .gz, .parquet and .arrow files, folders, globs; `--text-field`
for .jsonl and tables). An existing OUT is never overwritten. Exit status (docs/errors.md): 0 done, 2 bad input (a
vocabulary too small for the 256 bytes and the end-of-document token, missing or unreadable inputs, an existing
OUT), 1 writing OUT failed (a full disk: nothing is left under its name).
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before anything loads torch (runtime/bootstrap.py)

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from k3train.data.bpe_training import EOD_TOKEN, train_byte_bpe
from k3train.data.sources import PrepareError, expand_inputs, iter_pieces
from k3train.files import write_atomic


def corpus_texts(inputs: Sequence[str], text_field: str) -> Iterator[str]:
    for path in expand_inputs(inputs):
        for text, _ in iter_pieces(path, text_field):
            yield text


def train(inputs: Sequence[str], vocab_size: int, out: Path, eod_token: str = EOD_TOKEN, text_field: str = "text"):
    """Train on `inputs` and write `out` atomically; returns the tokenizer."""
    if out.exists():
        raise FileExistsError(f"{out} already exists: pass another --out, or remove it first")
    files = expand_inputs(inputs)  # bad inputs refused before any training
    tokenizer = train_byte_bpe(corpus_texts([str(f) for f in files], text_field), vocab_size, eod_token)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda f: f.write(tokenizer.to_str(pretty=True).encode("utf-8")))
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3train.tokenizer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    training = commands.add_parser("train", help="train a byte-level BPE tokenizer on a corpus")
    training.add_argument("inputs", nargs="+", help="files, folders or globs, as prepare reads them")
    training.add_argument("--vocab-size", type=int, required=True, help="ids in all, the end-of-document token's too")
    training.add_argument("--out", type=Path, required=True, help="the tokenizer.json to write (a new file)")
    training.add_argument("--eod-token", default=EOD_TOKEN, help=f"the end-of-document token (default {EOD_TOKEN})")
    training.add_argument("--text-field", default="text", help="the field of a .jsonl line or a table row")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        tokenizer = train(args.inputs, args.vocab_size, args.out, args.eod_token, args.text_field)
    except (PrepareError, ValueError, FileExistsError) as exc:  # bad input: fix the command
        print(f"tokenizer: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # writing failed (a full disk): nothing is left at --out
        print(f"tokenizer: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.out}: {tokenizer.get_vocab_size(with_added_tokens=True):,} ids (end of document "
        f"{args.eod_token!r} = {tokenizer.token_to_id(args.eod_token)}), {time.perf_counter() - start:.1f} s; "
        f"prepare with --tokenizer {args.out} --eod-token '{args.eod_token}'"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
