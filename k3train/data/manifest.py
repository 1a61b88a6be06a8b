"""The on-disk format of a prepared dataset: one directory holding token shards and a manifest.json.

    <dir>/manifest.json        format_version, tokenizer identity, vocab_size, dtype, fingerprint, splits
    <dir>/train_000000.bin     raw little-endian uint16 (vocab_size <= 65536) or uint32 token ids
    <dir>/val_000000.bin       ...
    <dir>/tokenizer.json       a copy of the Hugging Face tokenizer, when one was used (for decoding)

Each split is one token stream cut into shards; documents inside it end with the tokenizer's end-of-document
id. A directory without manifest.json is never a dataset: prepare writes the manifest last, into a temporary
directory that is renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

# Bump whenever the way prepare turns text into tokens or lays them out changes: the built-in corpus cache is
# keyed by it, so a changed recipe never reuses a stale cache.
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")

_PREPARE_HINT = "create it with `python -m k3train.prepare INPUTS --output DIR` (or use data=builtin)"


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def fingerprint(tokenizer: dict[str, Any], splits: dict[str, dict[str, Any]]) -> str:
    """sha256 over the tokenizer identity and each split's token stream (its sha256 and length).

    The split hashes cover every shard's bytes in order, so the fingerprint pins the exact tokens a cursor points
    into, independent of where the stream was cut into shard files."""
    content = {
        "tokenizer": tokenizer,
        "splits": {name: {"num_tokens": s["num_tokens"], "sha256": s["sha256"]} for name, s in sorted(splits.items())},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def read_manifest(data_dir: Path) -> dict[str, Any]:
    """Load and sanity-check <data_dir>/manifest.json; every failure names the path and the fix."""
    if not data_dir.is_dir():
        raise FileNotFoundError(f"prepared dataset directory {data_dir} does not exist; {_PREPARE_HINT}")
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{data_dir} has no {MANIFEST_NAME}, so it is not a complete prepared dataset (an interrupted prepare "
            f"never writes one); {_PREPARE_HINT}, adding --overwrite to replace an existing dataset"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-run prepare with --overwrite") from e
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {version!r}, this k3train reads version {FORMAT_VERSION}; "
            f"re-run prepare with --overwrite to rewrite the dataset"
        )
    missing = [k for k in ("tokenizer", "vocab_size", "dtype", "fingerprint", "splits") if k not in manifest]
    if missing:
        raise ValueError(f"{path} lacks {missing}; re-run prepare with --overwrite")
    if np.dtype(manifest["dtype"]) != token_dtype(manifest["vocab_size"]):
        raise ValueError(
            f"{path}: dtype {manifest['dtype']} does not match vocab_size {manifest['vocab_size']}; "
            f"re-run prepare with --overwrite"
        )
    return manifest
