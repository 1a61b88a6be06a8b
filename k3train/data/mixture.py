"""Weighted mixtures of prepared datasets: `data=mixture` (conf/data/mixture.yaml, docs/data.md#mixtures).

MixtureData opens several prepared datasets (one tokenizer) as TokenData each and hands out MixtureLoaders, which
draw every global batch's rows from the sources in proportion to the weights.

Which source a row comes from is a function of (seed, global row index) only: a counter-based hash (splitmix64 of
the seed's key plus the row's index) gives each global row a uniform u in [0, 1), and u falls into one source's
share of [0, 1) (its weight over the sum of the active sources'). The draw thus does not depend on how the global
batch is split over data-parallel ranks, nor on anything read before: every rank computes the whole global batch's
draw, takes its rows (rank r of W: rows r*B..(r+1)*B-1, as TokenDataLoader) and advances every source's cursor by
the rows the whole global batch drew from it, so the state is the same on every rank.

Each source is read as TokenDataLoader reads a split: the k-th row a batch draws from a source reads the T+1
tokens at cursor + k*T (inputs the first T, targets the last T), and the source's cursor then advances by T per row
drawn, so the lookahead token of its last row becomes its next row's first input. A single source at weight 1 gives
TokenDataLoader's batches bit for bit. Nothing wraps.

A source used up (it cannot give the rows a batch draws from it): `stop` raises EndOfData naming it; `reweight`
drops it (its unread tail is skipped), renormalises the others' weights and draws that batch again with the same
u's, ending with EndOfData when no source with a positive weight is left. Which sources were dropped, and at which
batch, is in the state.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from k3train.data.dataset import ShardedTokenDataset, TokenData
from k3train.data.loader import Batch, EndOfData, TokenDataLoader, check_geometry, document_ids
from k3train.data.manifest import FORMAT_VERSION, read_manifest
from k3train.data.tokenizers import ByteTokenizer, Tokenizer

ON_EXHAUSTED = ("stop", "reweight")
_MASK64 = (1 << 64) - 1
_SIMULATE_ROWS = 1 << 20  # uniforms drawn per chunk when batches_remaining looks ahead


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_uniforms(seed: int, start: int, n: int) -> np.ndarray:
    """Uniforms in [0, 1) (float64, 53 bits) of global rows start..start+n-1: counter-based, so any row's value is
    the same whichever rows are drawn with it."""
    key = _mix64(np.array([seed & _MASK64], dtype=np.uint64))
    rows = np.arange(start, start + n, dtype=np.uint64) + np.uint64(1)
    z = _mix64(key + rows * np.uint64(0x9E3779B97F4A7C15))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _bounds(weights: np.ndarray, active: np.ndarray) -> np.ndarray:
    """The upper end of each source's share of [0, 1) over the active sources (a dropped or zero-weight source has
    an empty share); the last positive share ends at exactly 1 so every u in [0, 1) lands in one."""
    w = np.where(active, weights, 0.0)
    bounds = np.cumsum(w) / w.sum()
    bounds[int(np.flatnonzero(w > 0)[-1]) :] = 1.0
    return bounds


class MixtureLoader:
    """Global batches whose rows come from several splits in proportion to `weights` (module docstring).

    Its batches are Batch(x, y, document_ids) as TokenDataLoader's; `last_sources` (int64 [B]) says which source
    (an index into `names`) each row of the last batch came from, `sources_of(batch)` that of any batch taken."""

    def __init__(
        self,
        datasets: Sequence[ShardedTokenDataset],
        names: Sequence[str],
        weights: Sequence[float],
        seed: int,
        on_exhausted: str,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        eod_id: int | None = None,
    ):
        check_geometry(batch_size, seq_len, rank, world_size)
        self.datasets, self.names = list(datasets), list(names)
        self.weights = [float(w) for w in weights]
        self._weights = np.array(self.weights, dtype=np.float64)
        self.seed, self.on_exhausted = int(seed), on_exhausted
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.eod_id = eod_id
        self.split = self.datasets[0].split
        self._sizes = np.array([d.num_tokens for d in self.datasets], dtype=np.int64)
        self.last_sources: torch.Tensor | None = None
        self.reset()
        if self.batches_remaining() < 1:
            raise ValueError(
                f"the {self.split} splits of the mixture ({self._describe_sizes()}) cannot fill one global batch of "
                f"{self.global_rows} rows of {seq_len}+1 tokens (on_exhausted={on_exhausted}); lower the batch size "
                f"or sequence length, or prepare more data"
            )

    # ---- geometry -------------------------------------------------------------------------------------------
    @property
    def global_rows(self) -> int:
        return self.world_size * self.batch_size

    # B*T and W*B*T, as TokenDataLoader's (they read only batch_size, seq_len and world_size)
    tokens_per_batch = TokenDataLoader.tokens_per_batch
    global_tokens_per_batch = TokenDataLoader.global_tokens_per_batch

    @property
    def cursor(self) -> int:
        """Tokens taken so far over all sources (batches x W*B*T)."""
        return int(self.cursors.sum())

    # ---- the draw -------------------------------------------------------------------------------------------
    def _fits(self, counts: np.ndarray, cursors: np.ndarray) -> np.ndarray:
        """Per source: whether it can give `counts` more rows from `cursors` (a row needs T+1 tokens, the rows of
        one batch T apart)."""
        return (counts == 0) | (cursors + counts * self.seq_len + 1 <= self._sizes)

    def _draw(self, batch: int, cursors: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(source of each global row, the active set after it, the sources dropped by it) for global batch `batch`
        from this state; EndOfData when it cannot be filled."""
        u = row_uniforms(self.seed, batch * self.global_rows, self.global_rows)
        dropped: list[int] = []
        while True:
            if not (self._weights[active] > 0).any():
                raise EndOfData(
                    f"every source of the {self.split} mixture is used up at batch {batch:,} "
                    f"({self._describe_sizes(cursors)}); the loader never wraps: call reset() to start another pass"
                )
            sources = np.searchsorted(_bounds(self._weights, active), u, side="right")
            counts = np.bincount(sources, minlength=len(self.datasets))
            short = np.flatnonzero(~self._fits(counts, cursors))
            if len(short) == 0:
                return sources, active, dropped
            if self.on_exhausted == "stop":
                s = int(short[0])
                raise EndOfData(
                    f"source {self.names[s]!r} ({self.datasets[s].path}) of the {self.split} mixture is used up at "
                    f"batch {batch:,}: it has {int(self._sizes[s] - cursors[s]):,} unread tokens of "
                    f"{int(self._sizes[s]):,}, the batch draws {int(counts[s])} rows of {self.seq_len}+1 from it "
                    f"(data.on_exhausted=stop; reweight goes on with the other sources)"
                )
            active = active.copy()
            active[short] = False
            dropped += [int(s) for s in short]

    def next_batch(self) -> Batch:
        """This rank's rows of the next global batch; `last_sources` then holds each row's source index."""
        sources, active, dropped = self._draw(self.batches, self.cursors, self.active)
        B, T = self.batch_size, self.seq_len
        # k: each global row's place among the rows of its source in this batch
        k = np.zeros(self.global_rows, dtype=np.int64)
        for s in np.unique(sources):
            rows = np.flatnonzero(sources == s)
            k[rows] = np.arange(len(rows))
        mine = slice(self.rank * B, (self.rank + 1) * B)
        buf = np.empty((B, T + 1), dtype=np.int64)
        for s in np.unique(sources[mine]):
            rows = np.flatnonzero(sources[mine] == s)  # this rank's rows of source s: consecutive rows of its stream
            first, n = int(k[mine][rows[0]]), len(rows)
            start = int(self.cursors[s]) + first * T
            tokens = self.datasets[s].read(start, n * T + 1)
            buf[rows] = np.lib.stride_tricks.sliding_window_view(tokens, T + 1)[::T]  # row i: tokens iT..iT+T
        self.cursors = self.cursors + np.bincount(sources, minlength=len(self.datasets)) * T
        for s in dropped:
            self.dropped[self.names[s]] = self.batches
        self.active = active
        self.batches += 1
        self.last_sources = torch.from_numpy(sources[mine].astype(np.int64))
        rows_of_tokens = torch.from_numpy(buf)
        x, y = (
            rows_of_tokens[:, :-1].contiguous(),
            rows_of_tokens[:, 1:].contiguous(),
        )  # contiguous as the plain loader's
        return Batch(x, y, None if self.eod_id is None else document_ids(x, self.eod_id))

    def sources_of(self, batch: int) -> torch.Tensor:
        """Which source (an index into `names`) each of this rank's rows of global batch `batch` came from, int64
        [B], for any batch already taken (also before a resume: the draw is a function of the seed, the batch and
        the sources dropped by then). With gradient accumulation the micro-batches of one update are batches
        `batches - accum` .. `batches - 1`; `last_sources` is only the last one's."""
        if not isinstance(batch, int) or not 0 <= batch < self.batches:
            raise ValueError(f"batch {batch!r} has not been taken: this loader has taken batches 0..{self.batches - 1}")
        active = np.array([self.dropped.get(n, batch + 1) > batch for n in self.names], dtype=bool)
        u = row_uniforms(self.seed, batch * self.global_rows, self.global_rows)
        sources = np.searchsorted(_bounds(self._weights, active), u, side="right")
        return torch.from_numpy(sources[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])

    def batches_remaining(self) -> int:
        """How many more next_batch calls succeed before EndOfData: the draws ahead simulated once from this state
        (in chunks of batches) and remembered while the loader follows them."""
        if self._end is None:
            self._end = self._simulate_end()
        return max(0, self._end - self.batches)

    def end_message(self) -> str:
        """Why the batches end where batches_remaining says: the EndOfData message of the first batch that cannot be
        filled (which source is used up, at which batch), for a run's end to name it."""
        self.batches_remaining()
        return self._end_message

    def _simulate_end(self) -> int:
        batch, cursors, active = self.batches, self.cursors.copy(), self.active.copy()
        n_sources, rows = len(self.datasets), self.global_rows
        while True:
            if not (self._weights[active] > 0).any():
                self._end_message = f"every source of the {self.split} mixture is used up at batch {batch:,}"
                return batch
            # no more batches than the unread tokens of the active sources could fill
            left = int((self._sizes - cursors)[active].clip(min=0).sum()) // (rows * self.seq_len) + 1
            chunk = min(left, max(1, _SIMULATE_ROWS // rows))
            u = row_uniforms(self.seed, batch * rows, chunk * rows)
            sources = np.searchsorted(_bounds(self._weights, active), u, side="right")
            within = np.repeat(np.arange(chunk) * n_sources, rows)
            counts = np.bincount(within + sources, minlength=chunk * n_sources).reshape(chunk, n_sources)
            before = cursors + np.cumsum(counts, axis=0) * self.seq_len - counts * self.seq_len
            fits = ((counts == 0) | (before + counts * self.seq_len + 1 <= self._sizes)).all(axis=1)
            if fits.all():
                batch += chunk
                cursors = cursors + counts.sum(axis=0) * self.seq_len
                continue
            i = int(np.argmin(fits))  # the first batch this active set cannot fill
            batch, cursors = batch + i, before[i].copy()
            try:
                sources_i, active, _ = self._draw(batch, cursors, active)
            except EndOfData as end:
                self._end_message = str(end)
                return batch
            cursors = cursors + np.bincount(sources_i, minlength=n_sources) * self.seq_len
            batch += 1

    def reset(self) -> None:
        self.cursors = np.zeros(len(self.datasets), dtype=np.int64)
        self.active = np.ones(len(self.datasets), dtype=bool)
        self.dropped: dict[str, int] = {}  # source name -> the batch at which it was dropped (reweight)
        self.batches = 0
        self._end: int | None = None
        self._end_message = ""

    # ---- state ----------------------------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {
            "sources": [{"name": n, "fingerprint": d.fingerprint} for n, d in zip(self.names, self.datasets)],
            "weights": self.weights,
            "seed": self.seed,
            "on_exhausted": self.on_exhausted,
            "split": self.split,
            "seq_len": self.seq_len,
            "document_masking": self.eod_id is not None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Every source's cursor, the batch counter and the dropped sources, with what they are only meaningful
        with; rank-independent and JSON-able (ints, floats, strings)."""
        return {
            **self._identity(),
            "cursor": self.cursor,
            "cursors": {n: int(c) for n, c in zip(self.names, self.cursors)},
            "batches": self.batches,
            "dropped": dict(self.dropped),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursors after checking the state is this mixture's (sources, weights, seed, on_exhausted,
        split, seq_len, masking) at this global batch; ValueError in one line otherwise."""
        what = f"the {self.split} mixture loader"
        missing = sorted({"cursors", "batches", "dropped", "batch_size", "world_size", *self._identity()} - set(state))
        if missing:
            raise ValueError(
                f"cannot restore {what}: the state lacks {missing}; it was not written by MixtureLoader.state_dict() "
                "(a checkpoint of data=prepared or data=builtin resumes only with that data)"
            )
        problems = [
            f"{key}: saved {state[key]!r}, this run has {value!r}"
            for key, value in self._identity().items()
            if state[key] != value
        ]
        saved_rows = state["batch_size"] * state["world_size"]
        if saved_rows != self.global_rows:
            problems.append(
                f"global batch (batch_size x world_size): saved {state['batch_size']} x {state['world_size']} = "
                f"{saved_rows} rows, this loader has {self.batch_size} x {self.world_size} = {self.global_rows}"
            )
        cursors = state["cursors"]
        if not problems:
            for name, size in zip(self.names, self._sizes):
                c = cursors.get(name)
                if not isinstance(c, int) or not 0 <= c <= size:
                    problems.append(f"cursor of {name!r}: saved {c!r}, outside its 0..{int(size)}")
            if set(state["dropped"]) - set(self.names):
                problems.append(f"dropped: {sorted(state['dropped'])} names sources this mixture lacks")
        if problems:
            raise ValueError(
                f"cannot restore {what}, written for another mixture or batch: "
                + "; ".join(problems)
                + " (resume with the data.sources, data.weights, data.seed, data.on_exhausted, seq_len, "
                "data.document_masking and global batch the checkpoint was written with)"
            )
        self.cursors = np.array([cursors[n] for n in self.names], dtype=np.int64)
        self.dropped = {n: int(b) for n, b in state["dropped"].items()}
        self.active = np.array([n not in self.dropped for n in self.names], dtype=bool)
        self.batches = int(state["batches"])
        self._end, self._end_message = None, ""

    def _describe_sizes(self, cursors: np.ndarray | None = None) -> str:
        cursors = np.zeros_like(self._sizes) if cursors is None else cursors
        return ", ".join(f"{n}: {int(c):,}/{int(s):,} tokens read" for n, c, s in zip(self.names, cursors, self._sizes))

    def __repr__(self) -> str:
        return (
            f"MixtureLoader({self.split!r}, {dict(zip(self.names, self.weights))}, batch_size={self.batch_size}, "
            f"seq_len={self.seq_len}, rank={self.rank}, world_size={self.world_size}, eod_id={self.eod_id}, "
            f"batches={self.batches}, {self._describe_sizes(self.cursors)})"
        )


class MixtureData:
    """Several prepared datasets (one tokenizer), each with a weight: the TokenData interface (vocab_size, eod_id,
    identity, loaders, tokenizer) over their mixture, plus val_loaders, one val loader per source.

    sources: [{name, path}, ...]; path a prepared dataset, or null for the built-in corpus (byte tokenizer, prepared
    into cache_dir). weights: one per source, >= 0, summing to a positive number (only their ratios matter).
    val_weights: the val mixture's, in the same form; None: the weights (set it to compare runs of other weights on
    one val set).
    on_exhausted: stop | reweight (module docstring). seed: the draw's (its own, not train.seed: mixture.yaml).
    Every refusal is a ValueError in one line, raised before any source is opened or prepared."""

    def __init__(
        self,
        sources: Sequence[Mapping[str, Any]],
        weights: Sequence[float],
        on_exhausted: Literal["stop", "reweight"] = "stop",
        seed: int = 0,
        document_masking: bool = True,
        cache_dir: str | None = None,
        verify: bool = False,
        val_weights: Sequence[float] | None = None,
    ):
        self.names, paths = _check_sources(sources)
        self.weights = _check_weights(weights, self.names)
        self.val_weights = (
            self.weights if val_weights is None else _check_weights(val_weights, self.names, "val_weights")
        )
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"data.on_exhausted={on_exhausted!r}: choose one of {', '.join(ON_EXHAUSTED)}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"data.seed={seed!r} is not an integer")
        _check_tokenizers(self.names, paths)
        self.on_exhausted, self.seed, self.document_masking = on_exhausted, seed, document_masking
        self.paths = paths
        self.parts: dict[str, TokenData] = {
            name: (
                TokenData.builtin(cache_dir, document_masking=document_masking)
                if path is None
                else TokenData(path, verify=verify, document_masking=document_masking)
            )
            for name, path in zip(self.names, paths)
        }
        self.first = self.parts[self.names[0]]
        self.vocab_size = self.first.vocab_size

    @property
    def eod_id(self) -> int:
        return self.first.eod_id

    def identity(self) -> dict[str, Any]:
        """What a checkpoint pins and run.json records. fingerprint covers the sources' data in order (another
        source refuses a resume); the weights, seed and on_exhausted are checked by the loader's state."""
        parts = [(name, part.identity()) for name, part in self.parts.items()]

        def combined(key: str) -> str:
            content = [[name, ident[key]] for name, ident in parts]
            return hashlib.sha256(json.dumps({"mixture": content}).encode()).hexdigest()

        return {
            "format_version": FORMAT_VERSION,
            "fingerprint": combined("fingerprint"),
            "val_fingerprint": combined("val_fingerprint"),
            "tokenizer": self.first.train.tokenizer_identity,
            "vocab_size": self.vocab_size,
            "dtype": self.first.train.dtype.name,
            "tokens": {split: sum(ident["tokens"][split] for _, ident in parts) for split in ("train", "val")},
            "mixture": {
                "sources": [
                    {"name": name, "path": str(self.parts[name].path), **{k: ident[k] for k in _SOURCE_KEYS}}
                    for name, ident in parts
                ],
                "weights": self.weights,
                "val_weights": self.val_weights,
                "seed": self.seed,
                "on_exhausted": self.on_exhausted,
            },
        }

    def _mixture(self, split: str, batch_size: int, seq_len: int, rank: int, world_size: int) -> MixtureLoader:
        return MixtureLoader(
            [getattr(part, split) for part in self.parts.values()],
            self.names,
            self.weights if split == "train" else self.val_weights,
            self.seed,
            self.on_exhausted,
            batch_size,
            seq_len,
            rank,
            world_size,
            eod_id=self.eod_id if self.document_masking else None,
        )

    def loaders(
        self, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1
    ) -> tuple[MixtureLoader, MixtureLoader]:
        """(train, val): mixtures in the weights' proportions (val: val_weights', the same unless set), with the same
        seed and on_exhausted, each over its split of every source; each with its own cursors."""
        return (
            self._mixture("train", batch_size, seq_len, rank, world_size),
            self._mixture("val", batch_size, seq_len, rank, world_size),
        )

    def val_loaders(
        self, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1
    ) -> dict[str, TokenDataLoader]:
        """{source name: a TokenDataLoader over its val split alone}, for per-source validation."""
        eod_id = self.eod_id if self.document_masking else None
        return {
            name: TokenDataLoader(part.val, batch_size, seq_len, rank, world_size, eod_id=eod_id)
            for name, part in self.parts.items()
        }

    def tokenizer(self) -> Tokenizer:
        """The tokenizer every source was prepared with (the first source's copy)."""
        return self.first.tokenizer()

    def __repr__(self) -> str:
        sources = ", ".join(f"{n}={w:g}" for n, w in zip(self.names, self.weights))
        return (
            f"MixtureData({sources}, on_exhausted={self.on_exhausted}, seed={self.seed}, vocab_size="
            f"{self.vocab_size}, document_masking={self.document_masking})"
        )


_SOURCE_KEYS = ("fingerprint", "val_fingerprint", "tokens")
_SOURCES_HINT = "give data.sources as a list of {name, path} (path null: the built-in corpus)"


def _check_sources(sources: Any) -> tuple[list[str], list[Path | None]]:
    if isinstance(sources, (str, bytes, Mapping)) or not isinstance(sources, Sequence) or not sources:
        raise ValueError(f"data.sources={sources!r} is not a non-empty list of sources; {_SOURCES_HINT}")
    names: list[str] = []
    paths: list[Path | None] = []
    for i, source in enumerate(sources):
        if not isinstance(source, Mapping) or set(source) != {"name", "path"}:
            raise ValueError(f"data.sources[{i}]={source!r} is not a {{name, path}} mapping; {_SOURCES_HINT}")
        name, path = source["name"], source["path"]
        if not isinstance(name, str) or not name or name in names:
            why = "repeats an earlier source's name" if name in names else "is not a non-empty string"
            raise ValueError(f"data.sources[{i}].name={name!r} {why}; give every source its own name")
        if path is not None and not isinstance(path, (str, Path)):
            raise ValueError(f"data.sources[{i}].path={path!r} ({name}) is not a path or null (the built-in corpus)")
        names.append(name)
        paths.append(None if path is None else Path(path))
    return names, paths


def _check_weights(weights: Any, names: list[str], key: str = "weights") -> list[float]:
    if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Sequence):
        raise ValueError(f"data.{key}={weights!r} is not a list of numbers; give one weight per source")
    if len(weights) != len(names):
        raise ValueError(
            f"data.{key} has {len(weights)} entries but data.sources has {len(names)} ({', '.join(names)}); "
            "give one weight per source, in the sources' order"
        )
    values = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"data.{key}[{i}]={w!r} ({names[i]}) is not a finite number")
        if w < 0:
            raise ValueError(f"data.{key}[{i}]={w!r} ({names[i]}) is negative; weights are shares, 0 or more")
        values.append(float(w))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"data.{key}={values} sum to {total:g}; give at least one source a positive weight")
    if not math.isfinite(total):  # the shares would be inf / inf: some sources never drawn
        raise ValueError(
            f"data.{key}={values} sum to more than the largest float; only their ratios matter: give smaller "
            "numbers in the same proportions (e.g. [1, 1])"
        )
    return values


def _check_tokenizers(names: list[str], paths: list[Path | None]) -> None:
    """Every source's tokenizer (its manifest's; the built-in corpus's is the byte tokenizer) is the first's, read
    before any source is opened or the built-in corpus prepared; a missing dataset names its source."""
    identities = []
    for i, (name, path) in enumerate(zip(names, paths)):
        if path is None:
            identities.append(ByteTokenizer().identity())
            continue
        try:
            identities.append(read_manifest(path)["tokenizer"])
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"data.sources[{i}] ({name}): {e}") from None
    for i in range(1, len(names)):
        if identities[i] != identities[0]:
            raise ValueError(
                f"data.sources[{i}] ({_name_of(names, paths, i)}) was prepared with tokenizer {identities[i]}, "
                f"data.sources[0] ({_name_of(names, paths, 0)}) with {identities[0]}; a mixture needs one tokenizer: "
                "prepare every source with the same --tokenizer"
            )


def _name_of(names: list[str], paths: list[Path | None], i: int) -> str:
    return f"{names[i]}: {paths[i] if paths[i] is not None else 'the built-in corpus'}"
