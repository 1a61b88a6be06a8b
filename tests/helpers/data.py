"""Tiny corpora and datasets: the data tests' (test_data_*.py), test_generate_export.py's and conftest.py's."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from k3train.data import prepare_dataset

# Mixed lengths and non-ASCII text, so byte streams and shard cuts land mid-character and mid-document.
DOCS = [f"document {i}: " + "héllo wörld ✓ " * (i % 7) + "the cat sat down." * (1 + i % 3) for i in range(40)]
VAL_DOCS = ["held out text one ✓", "held out text two, a little longer than the first."]


def write_jsonl(path: Path, docs: Sequence[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def byte_stream(docs: Sequence[str]) -> np.ndarray:
    """What the byte tokenizer must produce for docs: UTF-8 bytes, 256 after each document."""
    parts = [np.append(np.frombuffer(d.encode(), np.uint8).astype(np.int64), 256) for d in docs]
    return np.concatenate(parts)


def make_dataset(tmp_path: Path, shard_tokens: int = 97, name: str = "ds", **kwargs) -> Path:
    """DOCS as train and VAL_DOCS as val, byte-tokenized into many small shards."""
    train = write_jsonl(tmp_path / f"{name}-train.jsonl", DOCS)
    val = write_jsonl(tmp_path / f"{name}-val.jsonl", VAL_DOCS)
    out = tmp_path / name
    prepare_dataset([train], out, val_inputs=[val], shard_tokens=shard_tokens, workers=1, **kwargs)
    return out


def train_tiny_bpe(path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE trained in a few ms on DOCS, saved as tokenizer.json with <|endoftext|> added."""
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
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(path))
    return path
