"""Kimi's released tokenizer format for prepare: tiktoken BPE ranks, Kimi's pre-tokenization pattern and its special
tokens, encoded by the `tiktoken` library (optional: `pip install tiktoken`, the `kimi` extra).

Moonshot's model repositories (Kimi K2, Kimi Linear, Kimi K3) ship the tokenizer as three files, not a
tokenizer.json:
- `tiktoken.model`: one line per token, its bytes in base64 and its rank (its id), e.g. `IQ== 0`;
- `tokenizer_config.json`: `added_tokens_decoder`, {id: {"content": name}} for the special tokens, which follow
  the ranks (ids len(ranks) .. len(ranks) + 255; those it does not name are `<|reserved_token_{id}|>`);
- `tokenization_kimi.py`: code (never run here) that holds the pre-tokenization pattern, PATTERN below.
https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/tokenization_kimi.py (the same pattern and special-
token scheme in Kimi-Linear-48B-A3B-Instruct's and Kimi-K3's).

As HFTokenizer does, special tokens that appear literally in a document are encoded as plain text
(`encode_ordinary`), so a document quoting `<|im_end|>` cannot forge a boundary; the end-of-document id is
appended by prepare.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
RESERVED_SPECIAL_TOKENS = 256  # Kimi's special-token block after the ranks
# tokenization_kimi.py's pat_str, alternative by alternative: Han runs first, then letters with Han subtracted
# (`&&` class intersection, which tiktoken's regex engine supports), numbers in groups of up to 3, punctuation,
# newlines, whitespace.
PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model's {token bytes: rank}; a malformed line is a ValueError naming it."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error) as exc:
                raise ValueError(
                    f"{path}:{number} is not a '<base64 token> <rank>' line ({exc}); is this a tiktoken.model file?"
                ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: its ranks are not 0..{len(ranks) - 1}, each once; the file is damaged")
    return ranks


def read_special_tokens(config: Path, base: int) -> dict[str, int]:
    """Kimi's special tokens: ids base .. base + 255, named by tokenizer_config.json's added_tokens_decoder."""
    try:
        named = json.loads(config.read_text())["added_tokens_decoder"]
        names = {int(i): entry["content"] for i, entry in named.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{config} has no readable added_tokens_decoder ({exc})") from None
    ids = range(base, base + RESERVED_SPECIAL_TOKENS)
    outside = sorted(i for i in names if i not in ids)
    if outside:
        raise ValueError(f"{config} names special tokens at ids {outside[:5]}, outside {base}..{ids[-1]}")
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in ids}


class TiktokenTokenizer:
    """A tokenizer in Kimi's released format (a folder with tiktoken.model and tokenizer_config.json, or the
    tiktoken.model file itself with the config beside it); eod_token names the end-of-document special token
    (Kimi's models end a document with "[EOS]")."""

    def __init__(self, path: str | Path, eod_token: str | None):
        try:
            import tiktoken
        except ImportError:
            raise ValueError(
                "reading a tiktoken.model tokenizer needs the tiktoken library: pip install tiktoken "
                "(or pip install 'k3train[kimi]')"
            ) from None
        path = Path(path)
        ranks_path = path / RANKS_FILE if path.is_dir() else path
        config_path = ranks_path.with_name(CONFIG_FILE)
        for needed in (ranks_path, config_path):
            if not needed.is_file():
                raise FileNotFoundError(
                    f"{needed} does not exist: a tokenizer in Kimi's format is a folder with {RANKS_FILE} and "
                    f"{CONFIG_FILE} (as its model repository ships them)"
                )
        ranks = read_ranks(ranks_path)
        specials = read_special_tokens(config_path, len(ranks))
        if eod_token is None:
            named = [name for name in specials if not name.startswith("<|reserved_token_")]
            raise ValueError(
                f"{path}: choose its end-of-document token with --eod-token (eod_token=...); its special tokens are "
                f"{named}"
            )
        if eod_token not in specials:
            raise ValueError(f"{path}: end-of-document token {eod_token!r} is not one of its special tokens")
        self.path, self.eod_token = ranks_path, eod_token
        self.eod_id = specials[eod_token]
        self.vocab_size = len(ranks) + RESERVED_SPECIAL_TOKENS
        self._encoding = tiktoken.Encoding(
            name=f"k3train:{ranks_path}", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        digest = hashlib.sha256(ranks_path.read_bytes())
        digest.update(config_path.read_bytes())
        self.sha256 = digest.hexdigest()

    def files(self) -> list[Path]:
        """What a prepared dataset keeps beside its tokens, to decode them later."""
        return [self.path, self.path.with_name(CONFIG_FILE)]

    def identity(self) -> dict[str, Any]:
        return {
            "name": "tiktoken",
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod_token": self.eod_token,
            "eod_id": self.eod_id,
        }

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._encoding.encode_ordinary(text), dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self._encoding.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._encoding.decode(list(ids))

    def __reduce__(self) -> tuple:
        # Worker processes rebuild it from its files rather than pickling the Rust object.
        return TiktokenTokenizer, (str(self.path), self.eod_token)

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({str(self.path)!r}, eod_token={self.eod_token!r}, vocab_size={self.vocab_size})"
