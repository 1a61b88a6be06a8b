"""Input text for prepare: which files, how they become documents, and which split each document joins.

Formats (by file name): .txt is one document per file; .jsonl is one document per line, taken from a
configurable string field; either may be gzip'd (.txt.gz, .jsonl.gz). .parquet and .arrow (Hugging Face `datasets`
files: a hub download's parquet, `save_to_disk`'s or the cache's arrow) are one document per row, from the same
field, read with `datasets.load_dataset` on the local file (optional: `pip install datasets`; never a download).
Empty documents are skipped.

Documents stream as pieces `(text, last)`: a large .txt is read in ~PIECE_CHARS pieces cut at line ends, so no
file is ever held whole; `last` marks the piece that ends a document (where the end-of-document token goes).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import logging
import math
import os
import re
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

TABLE_SUFFIXES = (".parquet", ".arrow")  # read through Hugging Face `datasets`
SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", *TABLE_SUFFIXES)
TABLE_BATCH_ROWS = 1024
# "owner/name" or "hf://datasets/owner/name": what a hub dataset's name looks like when it is no local path
_HUB_NAME = re.compile(r"^(hf://(datasets/)?)?[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
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
        elif _HUB_NAME.match(str(spec)) and not str(spec).endswith(SUFFIXES):
            raise PrepareError(
                f"input {str(spec)!r} is no local file or folder; if it names a Hugging Face hub dataset, prepare "
                f"never downloads: fetch it first (`hf download --repo-type dataset {spec} --local-dir DIR`) and "
                f"pass DIR"
            )
        else:
            raise PrepareError(f"input {path} does not exist; pass files, folders or globs of {', '.join(SUFFIXES)}")
        if not matches:
            raise PrepareError(f"{where} matched no {', '.join(SUFFIXES)} files; check the path or pattern")
        files.update((m.resolve(), None) for m in matches)
    return list(files)


def iter_pieces(path: Path, text_field: str = "text", on_read: Callable[[int], None] | None = None) -> Iterator[Piece]:
    """The documents of one file as pieces; on_read(n) reports n more bytes of the file (as stored) consumed."""
    if path.name.endswith(TABLE_SUFFIXES):
        yield from _table_pieces(path, text_field, on_read)
        return
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


def _import_datasets(path: Path):
    """The `datasets` module, imported offline (its config reads the variables once, at import: _offline covers
    a module imported before); a one-line PrepareError without it."""
    if "datasets" not in sys.modules:
        saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
        os.environ.update(dict.fromkeys(saved, "1"))
        try:
            import datasets  # noqa: F401
        except ImportError:
            pass
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    try:
        import datasets
    except ImportError as e:
        raise PrepareError(
            f"{path}: reading {path.suffix} files needs the Hugging Face datasets package: pip install datasets"
        ) from e
    return datasets


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@contextlib.contextmanager
def _offline(datasets) -> Iterator[None]:
    """datasets' offline mode for the duration (also when imported online before: load_dataset would otherwise
    send the hub a download-count request even for a local file)."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_UPDATE_DOWNLOAD_COUNTS")
    saved = {name: getattr(datasets.config, name) for name in names if hasattr(datasets.config, name)}
    for name in saved:
        setattr(datasets.config, name, name != "HF_UPDATE_DOWNLOAD_COUNTS")
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(datasets.config, name, value)


@contextlib.contextmanager
def _logger_silenced(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load_table(path: Path, field: str, cache_dir: str):
    """The file as a streaming `datasets` dataset of its text column: a packaged builder ("parquet"/"arrow") on
    the local file, so nothing is resolved on the hub or downloaded, and nothing cached outside cache_dir."""
    datasets = _import_datasets(path)
    builder = path.suffix.removeprefix(".")
    try:
        with _offline(datasets), _logger_silenced("datasets"):  # its own "Failed to read schema" line: ours says it
            ds = datasets.load_dataset(
                builder, data_files=[str(path)], split="train", streaming=True, cache_dir=cache_dir
            )
            features = ds.features
    except Exception as e:  # pyarrow's and datasets' own errors for an unreadable file
        raise PrepareError(f"{path}: not a readable {builder} file ({_first_line(e)}); re-create it") from e
    if features is not None:
        if field not in features:
            raise PrepareError(
                f"{path}: no {field!r} column (found {sorted(features)}); choose the text field with --text-field"
            )
        kind = getattr(features[field], "dtype", type(features[field]).__name__)
        if "string" not in str(kind):
            raise PrepareError(f"{path}: column {field!r} is {kind}, not a string")
    return ds.select_columns([field]).with_format("arrow")


def _table_rows(path: Path) -> int:
    """Rows in a .parquet (its footer) or .arrow file (its batches' headers, memory-mapped): for the progress."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.name.endswith(".parquet"):
        return pq.read_metadata(path).num_rows
    with pa.memory_map(str(path)) as source:
        try:
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
        except pa.ArrowInvalid:  # the IPC file format (feather v2), not a stream
            source.seek(0)
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def check_tables(paths: Iterable[Path], field: str) -> None:
    """Refuse, before anything is written, a .parquet/.arrow input that cannot be read (no datasets package, not
    the format, no string column `field`)."""
    tables = [p for p in paths if p.name.endswith(TABLE_SUFFIXES)]
    if tables:
        with tempfile.TemporaryDirectory(prefix="k3train-prepare-") as cache:
            for path in tables:
                _load_table(path, field, cache)


def _table_pieces(path: Path, field: str, on_read: Callable[[int], None] | None) -> Iterator[Piece]:
    size = path.stat().st_size
    reported = row = 0
    with tempfile.TemporaryDirectory(prefix="k3train-prepare-") as cache:
        try:
            total = _table_rows(path) if on_read is not None else 0
            for batch in _load_table(path, field, cache).iter(batch_size=TABLE_BATCH_ROWS):
                for text in batch.column(field).to_pylist():
                    if text is None:
                        raise PrepareError(f"{path}: row {row} (from 0): {field!r} is null, not a string")
                    row += 1
                    if text:
                        yield text, True
                if on_read is not None:
                    done = size if row >= total else size * row // max(total, 1)
                    on_read(done - reported)
                    reported = done
        except PrepareError:
            raise
        except Exception as e:  # a file cut short or corrupt past its header
            raise PrepareError(f"{path}: not a readable {path.suffix[1:]} file ({_first_line(e)}); re-create it") from e
    if on_read is not None and reported < size:
        on_read(size - reported)


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
