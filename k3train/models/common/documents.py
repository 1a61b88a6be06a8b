"""Documents packed into one row: the `document_ids` convention the models take, and the forms kernels want.

document_ids [B, T] int64: the document each position belongs to within its row, non-decreasing along the row and
changing exactly where a new document starts (the loader numbers them 0, 1, 2, ... from position 0, a new one after
each end-of-document token: k3train/data/loader.py). None means no row has a boundary inside it: every layer then
runs its unmasked path, bitwise as without document masking, and builds no mask.

A model's forward turns them into a Documents (below), built once and handed to every layer, which reads the form
it needs from it.

A row's first document may be the tail of one that began in an earlier row: it is treated as starting at position
0, as the row itself is. Only inside a row do documents need telling apart.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from k3train.models.common.context_parallel import ContextParallel


def document_starts(document_ids: Tensor) -> Tensor:
    """[B, T] bool: True where a document starts after position 0 (position 0 is always a row's start)."""
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def same_document(document_ids: Tensor, shift: int) -> Tensor:
    """[B, T - shift, 1] bool: whether position t + shift lies in the same document as position t (a short
    convolution's tap `shift` steps back, for the outputs at shift, shift + 1, ...)."""
    T = document_ids.shape[1]
    return (document_ids[:, shift:] == document_ids[:, : T - shift]).unsqueeze(-1)


def document_lengths(document_ids: Tensor) -> list[list[int]]:
    """Each row's document lengths in order (they sum to T). Reads the ids on the host."""
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in document_ids]


def cu_seqlens(document_ids: Tensor) -> Tensor:
    """The rows flattened into one sequence of B*T positions -> where each document starts in it, then B*T: the
    cumulative sequence lengths [N + 1] (int64) of FlashAttention's and flash-linear-attention's varlen kernels, whose
    batch is that one flattened row. Every row start is a document start."""
    B, T = document_ids.shape
    starts = document_starts(document_ids)
    starts[:, 0] = True
    flat = starts.flatten().nonzero().squeeze(1)
    return torch.cat([flat, flat.new_tensor([B * T])])


def block_causal_mask(document_ids: Tensor) -> Tensor:
    """document_ids [B, T] -> [B, T, T] bool: True where query i may attend key j, i.e. j <= i in the same document."""
    return (document_ids[:, :, None] == document_ids[:, None, :]).tril_()


class Documents:
    """A batch's documents in every form a layer reads, made once per forward and handed to every layer.

    The model's forward builds one from document_ids (KimiK3.forward, DenseTransformer.forward) and passes it down
    instead of the raw ids, so that what a layer would otherwise rebuild for itself is made by the first layer that
    asks and read by the rest (torchtitan's models build their attention masks once per step the same way,
    get_attention_masks; a host read (.tolist(), nonzero) happens once per forward, not once per layer, and a GPU
    forward builds one [B, T, T] mask, not one per attention layer):
    https://github.com/pytorch/torchtitan/blob/0012170a0708b751408e6085f970082ecd678d2b/torchtitan/models/attention.py

    - `ids` [B, T]: the document_ids themselves (this rank's slice under context parallelism);
    - `starts` [B, T] bool (document_starts), `same_document(shift)` (a short conv's taps);
    - `cu_seqlens` [N + 1] int64 and `documents_per_row` [B], `count` N: FLA's varlen form (no host read for N);
    - `lengths`: each row's document lengths, read on the host once (MLA's CPU tiles);
    - `block_causal_mask` [B, T, T] bool, built on first use and kept;
    - under context parallelism (`context_parallel`, the group): `rank_ids`, every rank's ids gathered once here
      (a collective, so every rank builds its Documents at the same point: the model's forward), and from them the
      keys' ids up to this rank's last position (`key_ids`, MLA), the ids of a conv window reaching into the
      previous rank (`window`, KDA's short convs) and whether each slice continues the previous one's last
      document (`slice_continues`, KDA's state passing);
    - `cached(key, make)`: a layer's own form of them (MLA's tiles, its visible keys under cp), made once.

    Everything is kept for the forward's life and its backward (a recompute under activation checkpointing reads the
    same object), and never changes: the forms are exactly those each layer made before, so results are bit for bit
    the same. A layer given raw ids (called alone, as the tests and benchmarks do) builds its own (Documents.of).
    """

    def __init__(self, ids: Tensor, context_parallel: ContextParallel | None = None) -> None:
        self.ids = ids
        self.context_parallel = context_parallel
        self._cache: dict = {}
        # every rank's ids, in rank order (the exchange that the layers made each for themselves)
        self.rank_ids: list[Tensor] | None = None if context_parallel is None else context_parallel.gather(ids)

    @classmethod
    def of(
        cls, documents: Documents | Tensor | None, context_parallel: ContextParallel | None = None
    ) -> Documents | None:
        """What a layer reads: None stays None (no boundaries), a Documents built for this context-parallel group is
        used as it is, raw document_ids (or one built for another group) become a Documents here."""
        if documents is None:
            return None
        if isinstance(documents, Documents):
            if documents.context_parallel is context_parallel:
                return documents
            documents = documents.ids
        return cls(documents, context_parallel)

    @classmethod
    def local(cls, documents: Documents | Tensor | None) -> Documents | None:
        """What a kernel reads (this rank's forms only: ids, starts, cu_seqlens, masks): a Documents as it is,
        whatever its group, raw document_ids as a Documents without one, None as None."""
        if documents is None or isinstance(documents, Documents):
            return documents
        return cls(documents)

    def cached(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """make() the first time `key` is asked for, the same object after."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def starts(self) -> Tensor:
        """[B, T] bool: document_starts(ids)."""
        return self.cached("starts", lambda: document_starts(self.ids))

    def same_document(self, shift: int, dtype: torch.dtype = torch.bool) -> Tensor:
        """same_document(ids, shift) [B, T - shift, 1], in `dtype` (0 or 1)."""
        return self.cached(("same_document", shift, dtype), lambda: same_document(self.ids, shift).to(dtype))

    @property
    def cu_seqlens(self) -> Tensor:
        """cu_seqlens(ids): the varlen kernels' [N + 1] int64 (nonzero: a host sync on a GPU, once)."""
        return self.cached("cu_seqlens", lambda: cu_seqlens(self.ids))

    @property
    def count(self) -> int:
        """N, the documents in the batch (every row's first included), from cu_seqlens' shape: no host read."""
        return self.cu_seqlens.shape[0] - 1

    @property
    def documents_per_row(self) -> Tensor:
        """[B] int64: each row's documents (its starts after position 0, plus its first)."""
        return self.cached("documents_per_row", lambda: self.starts.sum(dim=1) + 1)

    @property
    def lengths(self) -> list[list[int]]:
        """document_lengths(ids), from one host read of cu_seqlens for the whole batch."""
        return self.cached("lengths", self._lengths)

    def _lengths(self) -> list[list[int]]:
        B, T = self.ids.shape
        bounds = self.cu_seqlens.tolist()  # every row start is among them, so no document spans two rows
        rows: list[list[int]] = [[] for _ in range(B)]
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            rows[start // T].append(stop - start)
        return rows

    @property
    def block_causal_mask(self) -> Tensor:
        """block_causal_mask(ids) [B, T, T] bool, made once."""
        return self.cached("block_causal_mask", lambda: block_causal_mask(self.ids))

    # ---- context parallelism: what the other ranks' ids say ---------------------------------------------------
    def _rank_ids(self) -> list[Tensor]:
        if self.rank_ids is None:
            raise ValueError("this Documents has no context-parallel group: only a split sequence has other ranks")
        return self.rank_ids

    @property
    def key_ids(self) -> Tensor:
        """[B, (rank + 1) T]: the ids of every position up to this rank's last (the keys MLA attends to); `ids`
        without context parallelism."""
        cp = self.context_parallel
        if cp is None:
            return self.ids
        return self.cached("key_ids", lambda: torch.cat(self._rank_ids()[: cp.rank + 1], dim=1))

    def window(self, n: int) -> Documents:
        """A Documents (no group) over the previous rank's last n positions then this rank's: a short conv's window
        under context parallelism, whose first n positions are the previous rank's inputs (the first rank's: zeros,
        here ids 0, as ContextParallel.previous_tail gives them)."""
        return self.cached(("window", n), lambda: Documents(torch.cat([self._previous_tail(n), self.ids], dim=1)))

    def _previous_tail(self, n: int) -> Tensor:
        cp, tails = self.context_parallel, [ids[:, ids.shape[1] - n :] for ids in self._rank_ids()]
        return tails[cp.rank - 1] if cp.rank > 0 else tails[-1] * 0

    def slice_continues(self) -> list[Tensor]:
        """Per rank's slice, [B] float: 1 where its first position continues the document of the previous slice's
        last position, 0 where a document starts there (the first slice: 0, a row's start)."""

        def make() -> list[Tensor]:
            ids = self._rank_ids()
            first = torch.zeros(self.ids.shape[0], device=self.ids.device)
            return [first] + [(ids[j][:, 0] == ids[j - 1][:, -1]).float() for j in range(1, len(ids))]

        return self.cached("slice_continues", make)
