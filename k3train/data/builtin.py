"""The built-in corpus: CPython's own `pydoc_data.topics` (~465 KB of English reference text, in every install).
https://github.com/python/cpython/blob/main/Lib/pydoc_data/topics.py

Its 79 documents are taken in sorted-key order, split whole by sources.plan_split at BUILTIN_VAL_FRACTION, and
prepared on first use into <cache>/builtin-<key>, where cache is $K3TRAIN_CACHE or ~/.cache/k3train and key
hashes the corpus text, the tokenizer identity, the prepare format version and the split recipe: a new Python's
topics, another tokenizer or a changed recipe gets its own directory, never a stale one.

Concurrent first uses (a Hydra sweep) are safe: each process prepares into its own temporary directory and the
first rename wins; a loser discards its copy and opens the winner's, which holds the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from k3train.data.manifest import FORMAT_VERSION, MANIFEST_NAME
from k3train.data.prepare import write_dataset
from k3train.data.sources import plan_split, split_by_plan
from k3train.data.tokenizers import ByteTokenizer, Tokenizer
from k3train.runtime.paths import cache_root

BUILTIN_VAL_FRACTION = 0.05


def builtin_documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def builtin_path(cache_dir: str | Path | None = None, tokenizer: Tokenizer | None = None) -> Path:
    """Where the built-in corpus prepared with this tokenizer lives (whether or not it exists yet)."""
    tokenizer = tokenizer or ByteTokenizer()
    recipe = {
        "corpus_sha256": hashlib.sha256("\0".join(builtin_documents()).encode()).hexdigest(),
        "tokenizer": tokenizer.identity(),
        "format_version": FORMAT_VERSION,
        "val_fraction": BUILTIN_VAL_FRACTION,
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root(cache_dir) / f"builtin-{key}"


def prepare_builtin(cache_dir: str | Path | None = None, tokenizer: Tokenizer | None = None) -> Path:
    """The prepared built-in corpus directory, preparing it first if the cache lacks it."""
    tokenizer = tokenizer or ByteTokenizer()
    path = builtin_path(cache_dir, tokenizer)
    if (path / MANIFEST_NAME).is_file():
        return path
    documents = builtin_documents()
    # Whole documents (its 79 documents give val 8.8% of the text): cutting documents would change the built-in
    # data under every run and checkpoint made with it.
    heads = plan_split([len(d) for d in documents], BUILTIN_VAL_FRACTION, whole_documents=True)
    stream = split_by_plan(((doc, True) for doc in documents), heads)
    source = {"corpus": "pydoc_data.topics", "val_fraction": BUILTIN_VAL_FRACTION}
    try:
        # In-process (workers=1): the corpus takes well under a second, and forking inside a training process
        # (threads, CUDA, Hydra) is best avoided.
        write_dataset(stream, path, tokenizer, source=source, workers=1)
    except FileExistsError as e:
        if not (path / MANIFEST_NAME).is_file():
            raise FileExistsError(f"{path} exists but is not a prepared dataset; delete it and retry") from e
    return path
