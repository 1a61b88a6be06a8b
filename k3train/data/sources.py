"""Input text for prepare: which files, how they become documents, and which split each document joins.

Formats (by file name): .txt is one document per file; .jsonl is one document per line, taken from a
configurable string field; either may be gzip'd (.txt.gz, .jsonl.gz). Empty documents are skipped.

Documents stream as pieces `(text, last)`: a large .txt is read in ~PIECE_CHARS pieces cut at line ends, so no
file is ever held whole; `last` marks the piece that ends a document (where the end-of-document token goes).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
PIECE_CHARS = 1 << 18
VAL_FRACTION_TOLERANCE = 0.1  # relative: val_fraction 0.05 holds to within 0.045-0.055 of the text

Piece = tuple[str, bool]


class PrepareError(ValueError):
    """Bad input for prepare; the message names the file and the fix."""


def _supported(path: Path) -> bool:
    return path.is_file() and path.name.endswith(SUFFIXES)


def expand_inputs(specs: Sequence[str | Path]) -> list[Path]:
    """Files, folders (searched recursively) and globs -> a sorted, de-duplicated file list per spec."""
    files: dict[Path, None] = {}  # insertion-ordered set
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            matches = sorted(p for p in path.rglob("*") if _supported(p))
            where = f"folder {path}"
        elif path.is_file():
            if not _supported(path):
                raise PrepareError(f"{path}: unsupported file type; prepare reads {', '.join(SUFFIXES)}")
            matches, where = [path], ""
        elif glob.has_magic(str(spec)):
            matches = sorted(p for p in map(Path, glob.glob(str(spec), recursive=True)) if _supported(p))
            where = f"glob {str(spec)!r}"
        else:
            raise PrepareError(f"input {path} does not exist; pass files, folders or globs of {', '.join(SUFFIXES)}")
        if not matches:
            raise PrepareError(f"{where} matched no {', '.join(SUFFIXES)} files; check the path or pattern")
        files.update((m.resolve(), None) for m in matches)
    return list(files)


def iter_pieces(path: Path, text_field: str = "text", on_read: Callable[[int], None] | None = None) -> Iterator[Piece]:
    """The documents of one file as pieces; on_read(n) reports n more bytes of the file (as stored) consumed."""
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
        text = io.TextIOWrapper(stream, encoding="utf-8", newline="")  # newline="": keep the text's own newlines
        is_jsonl = path.name.removesuffix(".gz").endswith(".jsonl")
        read = _jsonl_pieces(text, path, text_field) if is_jsonl else _txt_pieces(text)
        done = 0
        try:
            for piece in read:
                if on_read is not None:
                    on_read(raw.tell() - done)
                    done = raw.tell()
                yield piece
        except UnicodeDecodeError as e:
            raise PrepareError(f"{path}: not UTF-8 text ({e}); convert it, e.g. `iconv -t UTF-8`") from e
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise PrepareError(f"{path}: corrupt or truncated gzip data ({e}); re-create the file") from e


def _txt_pieces(text: io.TextIOBase) -> Iterator[Piece]:
    piece = text.read(PIECE_CHARS)
    while piece:
        piece += text.readline()  # end pieces at a line end so a subword tokenizer rarely sees a cut word
        following = text.read(PIECE_CHARS)
        yield piece, not following
        piece = following


def _jsonl_pieces(text: io.TextIOBase, path: Path, field: str) -> Iterator[Piece]:
    for lineno, line in enumerate(text, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PrepareError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from e
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise PrepareError(
                f"{path}:{lineno}: no {field!r} field (found {keys}); choose the text field with --text-field"
            )
        if not isinstance(record[field], str):
            raise PrepareError(f"{path}:{lineno}: field {field!r} is {type(record[field]).__name__}, not a string")
        if record[field]:
            yield record[field], True


def document_sizes(pieces: Iterable[Piece]) -> list[int]:
    """Characters per document: the pre-pass that lets plan_split hold a val fraction of the whole text."""
    sizes, size = [], 0
    for text, last in pieces:
        size += len(text)
        if last:
            sizes.append(size)
            size = 0
    return sizes


def plan_split(sizes: Sequence[int], val_fraction: float, *, whole_documents: bool = False) -> list[int]:
    """Per document, how many of its leading characters go to train; the rest (its tail) goes to val.

    Whole documents first: a document joins val when val holds less than val_fraction of the characters seen
    before it (the first document always goes to train), so val is spread through the corpus and its share is
    of the text, not of the document count. When that misses val_fraction by more than VAL_FRACTION_TOLERANCE
    of it (too few documents, or a few that dwarf the rest; unless whole_documents), every document larger than
    that tolerance's share of the val text is cut instead: its head to train and just enough of its tail to val
    to put val back on val_fraction of the text seen so far."""
    total = sum(sizes)
    slack = VAL_FRACTION_TOLERANCE * val_fraction * total
    for cut_above in (math.inf,) if whole_documents else (math.inf, slack):
        heads, seen, in_val = [], 0, 0
        for size in sizes:
            if size > cut_above:
                head = size - min(max(math.floor(val_fraction * (seen + size) - in_val), 0), size)
            else:
                head = 0 if in_val < val_fraction * seen else size
            heads.append(head)
            seen, in_val = seen + size, in_val + size - head
        if abs(in_val - val_fraction * total) <= slack:
            break
    return heads


def split_by_plan(pieces: Iterable[Piece], heads: Iterable[int]) -> Iterator[tuple[str, str, bool]]:
    """(split, text, last) pieces: each document's first heads[i] characters to train, the rest to val. A cut
    document ends in both splits (each part gets its own end of document)."""
    plan = iter(heads)
    head = pos = None
    for text, last in pieces:
        if head is None:
            head, pos = next(plan), 0
        cut = min(max(head - pos, 0), len(text))
        if cut:
            yield "train", text[:cut], last or pos + cut == head
        if cut < len(text):
            yield "val", text[cut:], last
        pos += len(text)
        if last:
            head = None
