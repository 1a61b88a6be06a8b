"""Opening prepared data: ShardedTokenDataset (one split as one token stream) and TokenData (train + val).

Opening is strict: the manifest is read, every shard's file size is checked against its token count, and every
token id is checked against vocab_size (the manifest's recorded maximum, then a max over each whole shard, read in
CHECK_CHUNK_TOKENS pieces so memory stays bounded; an id past the vocabulary would otherwise end a run hours in,
at the step that reads it). That reads the whole split once (its cost per GiB: docs/decisions/data-id-check.md).
verify=True additionally re-hashes every shard against the manifest's sha256.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from pathlib import Path
from typing import Any

import numpy as np

from k3train.data.builtin import prepare_builtin
from k3train.data.loader import TokenDataLoader
from k3train.data.manifest import FORMAT_VERSION, MANIFEST_NAME, read_manifest
from k3train.data.tiktoken_format import RANKS_FILE, TiktokenTokenizer
from k3train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

CHECK_CHUNK_TOKENS = 1 << 24  # 32 MiB of uint16 per read of the id check
_REPREPARE = "re-run `python -m k3train.prepare ... --overwrite` to rebuild the dataset"


class ShardedTokenDataset:
    """One split of a prepared dataset: its shards memory-mapped and read as one contiguous stream."""

    def __init__(self, data_dir: str | Path, split: str, *, verify: bool = False):
        self.path = Path(data_dir)
        manifest = read_manifest(self.path)
        if split not in manifest["splits"]:
            raise ValueError(
                f"{self.path / MANIFEST_NAME} has no split {split!r} (it has {sorted(manifest['splits'])})"
            )
        self.split = split
        self.vocab_size: int = manifest["vocab_size"]
        self.fingerprint: str = manifest["fingerprint"]
        self.tokenizer_identity: dict[str, Any] = manifest["tokenizer"]
        self.dtype = np.dtype(manifest["dtype"])
        self._entry = manifest["splits"][split]
        self._shards = [self._open_shard(s["file"], s["num_tokens"]) for s in self._entry["shards"]]
        self._starts = np.cumsum([0] + [len(s) for s in self._shards]).tolist()  # start offset of each shard
        self.num_tokens: int = self._starts[-1]
        if self.num_tokens != self._entry["num_tokens"]:
            raise ValueError(
                f"{self.path / MANIFEST_NAME}: the {split} shards hold {self.num_tokens} tokens but the split records "
                f"{self._entry['num_tokens']}; {_REPREPARE}"
            )
        self._check_ids()
        if verify:
            self.verify()

    def _open_shard(self, name: str, num_tokens: int) -> np.ndarray:
        path = self.path / name
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} listed in {MANIFEST_NAME} is missing; {_REPREPARE}")
        size, expected = path.stat().st_size, num_tokens * self.dtype.itemsize
        if size != expected:
            raise ValueError(
                f"shard {path} is {size:,} bytes but {MANIFEST_NAME} records {num_tokens:,} {self.dtype.name} tokens "
                f"= {expected:,} bytes (truncated or modified after prepare); {_REPREPARE}"
            )
        if num_tokens == 0:
            return np.empty(0, self.dtype)  # np.memmap cannot map an empty file
        # A plain ndarray view of the map: slicing it skips np.memmap's per-slice bookkeeping.
        return np.asarray(np.memmap(path, dtype=self.dtype, mode="r"))

    def _check_ids(self) -> None:
        recorded = self._entry.get("max_token_id", -1)
        if recorded >= self.vocab_size:
            raise ValueError(
                f"{self.path / MANIFEST_NAME}: the {self.split} split holds token id {recorded} >= vocab_size "
                f"{self.vocab_size}; {_REPREPARE}"
            )
        for spec, shard, shard_start in zip(self._entry["shards"], self._shards, self._starts, strict=False):
            for start in range(0, len(shard), CHECK_CHUNK_TOKENS):
                chunk = shard[start : start + CHECK_CHUNK_TOKENS]
                if int(chunk.max()) >= self.vocab_size:
                    offset = start + int(np.argmax(chunk >= self.vocab_size))
                    raise ValueError(
                        f"shard {self.path / spec['file']} holds token id {int(shard[offset])} >= vocab_size "
                        f"{self.vocab_size} at token offset {offset:,} (token {shard_start + offset:,} of the "
                        f"{self.split} split); the shard does not match its manifest (written by another tokenizer, "
                        f"or modified after prepare): {_REPREPARE} with the right --tokenizer"
                    )

    def verify(self) -> None:
        """Re-hash every shard (reads the whole split) and compare with the manifest's sha256."""
        sha = hashlib.sha256()
        for shard in self._shards:
            sha.update(shard.tobytes())
        if sha.hexdigest() != self._entry["sha256"]:
            raise ValueError(
                f"the {self.split} shards of {self.path} do not hash to the sha256 in {MANIFEST_NAME} "
                f"(modified after prepare); {_REPREPARE}"
            )

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start+n) of the split, in the shard dtype; a view when they lie in one shard."""
        if start < 0 or n < 0 or start + n > self.num_tokens:
            raise IndexError(f"read({start}, {n}) is outside the {self.split} split's {self.num_tokens} tokens")
        if n == 0:
            return np.empty(0, self.dtype)
        i = bisect_right(self._starts, start) - 1  # the shard holding token `start` (empty shards are skipped)
        offset = start - self._starts[i]
        if offset + n <= len(self._shards[i]):
            return self._shards[i][offset : offset + n]
        parts = []
        while n > 0:  # the read crosses into following shards
            piece = self._shards[i][offset : offset + n]
            parts.append(piece)
            n -= len(piece)
            i, offset = i + 1, 0
        return np.concatenate(parts)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"ShardedTokenDataset({str(self.path)!r}, split={self.split!r}, num_tokens={self.num_tokens:,}, "
            f"shards={len(self._shards)}, vocab_size={self.vocab_size}, dtype={self.dtype.name}, "
            f"fingerprint={self.fingerprint[:12]})"
        )


class TokenData:
    """The train and val splits a run uses, opened together and checked to share one tokenizer.

    val comes from the same directory unless val_path names another prepared dataset (e.g. a standard held-out
    set), which must then have been prepared with the same tokenizer.

    document_masking (data.document_masking): the loaders hand each batch its document boundaries (the tokens after
    the tokenizer's end-of-document id start new documents; loader.py), so a model that takes them attends within
    each document only. Off: every row is one sequence, documents reading into each other as before."""

    def __init__(
        self, path: str | Path, val_path: str | Path | None = None, verify: bool = False, document_masking: bool = True
    ):
        self.path = Path(path)
        self.document_masking = document_masking
        self.train = ShardedTokenDataset(self.path, "train", verify=verify)
        self.val = ShardedTokenDataset(val_path or self.path, "val", verify=verify)
        if self.train.tokenizer_identity != self.val.tokenizer_identity:
            which = "vocab_size" if self.train.vocab_size != self.val.vocab_size else "tokenizer"
            raise ValueError(
                f"train and val were prepared with different tokenizers ({which}: "
                f"{self.train.path / MANIFEST_NAME} has {self.train.tokenizer_identity}, "
                f"{self.val.path / MANIFEST_NAME} has {self.val.tokenizer_identity}); "
                f"prepare both with the same --tokenizer"
            )
        self.vocab_size = self.train.vocab_size

    @classmethod
    def builtin(
        cls,
        cache_dir: str | None = None,
        tokenizer: str = "byte",
        eod_token: str | None = None,
        document_masking: bool = True,
    ) -> TokenData:
        """The built-in pydoc_data.topics corpus, prepared into the cache on first use (see builtin.py)."""
        return cls(prepare_builtin(cache_dir, load_tokenizer(tokenizer, eod_token)), document_masking=document_masking)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint pins and run.json records; JSON-able."""
        return {
            "format_version": FORMAT_VERSION,
            "fingerprint": self.train.fingerprint,
            "val_fingerprint": self.val.fingerprint,
            "tokenizer": self.train.tokenizer_identity,
            "vocab_size": self.vocab_size,
            "dtype": self.train.dtype.name,
            "tokens": {"train": self.train.num_tokens, "val": self.val.num_tokens},
        }

    @property
    def eod_id(self) -> int:
        """The end-of-document id every document of both splits ends with (one tokenizer: checked when opened)."""
        return self.train.tokenizer_identity["eod_id"]

    def loaders(
        self, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1
    ) -> tuple[TokenDataLoader, TokenDataLoader]:
        """Independent (train, val) loaders, each with its own cursor; with document masking both hand out the
        boundaries, so evaluation masks as training does."""
        eod_id = self.eod_id if self.document_masking else None
        return (
            TokenDataLoader(self.train, batch_size, seq_len, rank, world_size, eod_id=eod_id),
            TokenDataLoader(self.val, batch_size, seq_len, rank, world_size, eod_id=eod_id),
        )

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the data was prepared with, for decoding ids back to text."""
        identity = self.train.tokenizer_identity
        if identity["name"] == "byte":
            return ByteTokenizer()
        if identity["name"] == "tiktoken":
            tok = TiktokenTokenizer(self.path / RANKS_FILE, identity["eod_token"])
        else:
            tok = HFTokenizer(self.path / "tokenizer.json", identity["eod_token"])
        if tok.identity() != identity:
            raise ValueError(f"{tok.path} does not match the manifest's tokenizer; {_REPREPARE}")
        return tok

    def __repr__(self) -> str:
        return (
            f"TokenData({str(self.path)!r}, vocab_size={self.vocab_size}, train={self.train.num_tokens:,} tokens, "
            f"val={self.val.num_tokens:,} tokens, fingerprint={self.train.fingerprint[:12]}, "
            f"document_masking={self.document_masking})"
        )
