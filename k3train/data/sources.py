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
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
PIECE_CHARS = 1 << 18

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


def split_by_fraction(pieces: Iterable[Piece], val_fraction: float) -> Iterator[tuple[str, str, bool]]:
    """Assign whole documents to "train" or "val", deterministically and in one pass.

    A document joins val when val holds less than val_fraction of the characters seen before it. The choice
    depends only on earlier documents, never on this one's size, so val gets about val_fraction of the text
    (not of the document count, which matters when document sizes vary by 100x), spread through the corpus;
    the first document always goes to train."""
    seen = in_val = 0
    split = None
    for text, last in pieces:
        if split is None:
            split = "val" if in_val < val_fraction * seen else "train"
        seen += len(text)
        in_val += len(text) if split == "val" else 0
        yield split, text, last
        if last:
            split = None
