"""Tokenizers for prepare: a built-in byte-level one, any local Hugging Face tokenizer.json, and Kimi's released
format (tiktoken ranks: tiktoken_format.py). `python -m k3train.tokenizer train` makes a tokenizer.json.

All expose the same small surface: `vocab_size`, `eod_id` (the end-of-document id appended after every
document), `identity()` (a JSON-able dict recorded in the manifest and hashed into the fingerprint),
`encode_batch(texts) -> list[np.ndarray]`, `decode(ids) -> str` and `files()` (what a prepared dataset keeps to
decode its tokens later).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tokenizers as hf

from k3train.data.tiktoken_format import RANKS_FILE, TiktokenTokenizer


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int

    def identity(self) -> dict[str, Any]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def files(self) -> list[Path]: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is end-of-document. No files, no training, vocab_size 257."""

    vocab_size = 257
    eod_id = 256
    # How decode() renders an end-of-document id, so decoded streams show where documents end.
    eod_text = "<|endoftext|>"

    def identity(self) -> dict[str, Any]:
        return {"name": "byte", "vocab_size": self.vocab_size, "eod_id": self.eod_id}

    def files(self) -> list[Path]:
        return []  # nothing to keep: it is built in

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; a model's invalid UTF-8 becomes U+FFFD rather than an error."""
        out, run = [], bytearray()
        for i in ids:
            if i == self.eod_id:
                out += [run.decode("utf-8", errors="replace"), self.eod_text]
                run = bytearray()
            elif 0 <= i < 256:
                run.append(i)
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary 0..256")
        return "".join(out) + run.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local tokenizer.json (never downloaded).

    eod_token names the vocabulary entry used as end-of-document (e.g. "<|endoftext|>"). Special tokens that
    appear literally in the text are encoded as plain text, so a document quoting "<|endoftext|>" cannot forge a
    document boundary.
    """

    def __init__(self, path: str | Path, eod_token: str | None):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer file {path} does not exist; pass the path of a local tokenizer.json "
                f"(k3train never downloads tokenizers), or --tokenizer byte"
            )
        try:
            self._tok = hf.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any parse failure
            raise ValueError(f"{path} is not a valid tokenizer.json ({e})") from e
        self._tok.encode_special_tokens = True
        # A saved tokenizer may carry truncation/padding settings for model inputs: they would cut or pad documents.
        self._tok.no_truncation()
        self._tok.no_padding()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        specials = sorted(t.content for t in self._tok.get_added_tokens_decoder().values())
        if eod_token is None:
            raise ValueError(
                f"{path}: choose its end-of-document token with --eod-token (eod_token=...); "
                f"its added tokens are {specials}"
            )
        if eod_token not in vocab:
            raise ValueError(
                f"{path}: end-of-document token {eod_token!r} is not in the vocabulary; its added tokens are {specials}"
            )
        self.path = path
        self.eod_token = eod_token
        self.eod_id = vocab[eod_token]
        # Ids need not be dense, so the id range (not the entry count) bounds what an embedding must hold.
        self.vocab_size = max(vocab.values()) + 1
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()

    def identity(self) -> dict[str, Any]:
        return {
            "name": "huggingface",
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod_token": self.eod_token,
            "eod_id": self.eod_id,
        }

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def files(self) -> list[Path]:
        """What a prepared dataset keeps beside its tokens, to decode them later."""
        return [self.path]

    def __reduce__(self) -> tuple:
        # Worker processes rebuild the tokenizer from its file rather than pickling the Rust object.
        return HFTokenizer, (str(self.path), self.eod_token)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, eod_token={self.eod_token!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str | Path = "byte", eod_token: str | None = None) -> Tokenizer:
    """ "byte" for the built-in byte tokenizer, else the path of a tokenizer.json (or a folder holding one), or of
    a tokenizer in Kimi's released format (its tiktoken.model, or a folder holding it: tiktoken_format.py)."""
    if str(spec) == "byte":
        if eod_token is not None:
            raise ValueError("the byte tokenizer's end-of-document id is fixed at 256; drop --eod-token")
        return ByteTokenizer()
    path = Path(spec)
    if path.name == RANKS_FILE or (path.is_dir() and (path / RANKS_FILE).is_file()):
        return TiktokenTokenizer(path, eod_token)
    return HFTokenizer(spec, eod_token)
