"""TokenDataLoader: contiguous next-token batches from one split, with a resumable cursor.

Each batch reads B*T+1 contiguous tokens at the cursor (across shard boundaries) and returns
    x = buf[:-1].view(B, T),  y = buf[1:].view(B, T)        (int64, CPU)
so y is x shifted by one token and the extra token gives the last position its target. The cursor then advances
by B*T, so the lookahead token becomes the next batch's first input. The stream never wraps: when the next batch
cannot be filled, next_batch raises EndOfData (call reset() to start another pass).

Document masking (eod_id given): the batch also carries `document_ids` [B, T], each position's document within its
row: 0 from position 0, one more after every end-of-document token (the token after an eod_id starts a new
document; the eod itself ends the one before, so its target, the next document's first token, stays in the loss,
as in torchtitan and OLMo-core). It is None when no row has a boundary inside it (or masking is off), so a batch
with nothing to mask costs the model nothing. The same convention as torchtitan's document mask:
https://github.com/pytorch/torchtitan/blob/0012170a0708b751408e6085f970082ecd678d2b/torchtitan/models/attention.py
(get_document_mask_mod), and as FLA's `cu_seqlens` (k3train/models/common/documents.py converts).

Data parallel: with world_size W the global batch is W*B rows; rank r returns rows r*B..(r+1)*B-1 of it, i.e.
the B*T+1 tokens starting at cursor + r*B*T, and every rank's cursor advances by W*B*T. W ranks at batch B thus
see exactly what one process at batch W*B sees, and the cursor (and state_dict) is the same on every rank; a state
restores into any W' and B' with W'*B' = W*B (a resume on another number of processes with the same global batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from k3train.data.dataset import ShardedTokenDataset


class EndOfData(Exception):
    """The split cannot fill another global batch. An Exception (not StopIteration) so it cannot silently end
    a for loop or a generator."""


class Batch(NamedTuple):
    """One batch: inputs and targets int64 [B, T] (targets[b, t] follows inputs[b, t]), and with document masking
    each position's document within its row, int64 [B, T], or None when no row holds a document boundary."""

    inputs: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor | None = None


def check_geometry(batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
    """A loader's shape and place among the ranks, refused in one line when not usable (every loader's check)."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1} for world_size {world_size}, got {rank!r}")


class TokenDataLoader:
    def __init__(
        self,
        dataset: ShardedTokenDataset,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        eod_id: int | None = None,
    ):
        """eod_id: the end-of-document token whose successors start new documents (document masking); None: each
        row is one sequence and batches carry no document_ids."""
        check_geometry(batch_size, seq_len, rank, world_size)
        self.dataset, self.batch_size, self.seq_len = dataset, batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.eod_id = eod_id
        need = self.global_tokens_per_batch + 1
        if dataset.num_tokens < need:
            raise ValueError(
                f"the {dataset.split} split of {dataset.path} has {dataset.num_tokens:,} tokens, but one global batch "
                f"needs batch_size*seq_len*world_size+1 = {batch_size}*{seq_len}*{world_size}+1 = {need:,}; "
                f"lower the batch size or sequence length, or prepare more data"
            )
        self.cursor = 0  # token offset of the next global batch; the same on every rank

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch this loader returns (B*T)."""
        return self.batch_size * self.seq_len

    @property
    def global_tokens_per_batch(self) -> int:
        """Input tokens in one batch summed over all ranks (W*B*T): how far each batch moves the cursor."""
        return self.world_size * self.tokens_per_batch

    def batches_remaining(self) -> int:
        """How many more next_batch calls succeed before EndOfData."""
        return max(0, (self.dataset.num_tokens - 1 - self.cursor) // self.global_tokens_per_batch)

    def next_batch(self) -> Batch:
        """Batch(x, y, document_ids): x, y int64 [B, T], y[b, t] the token after x[b, t]; document_ids as the module
        docstring says (None without eod_id or without a boundary inside any row)."""
        if self.cursor + self.global_tokens_per_batch + 1 > self.dataset.num_tokens:
            raise EndOfData(
                f"the {self.dataset.split} split of {self.dataset.path} is exhausted at token {self.cursor:,} of "
                f"{self.dataset.num_tokens:,} (a global batch needs {self.global_tokens_per_batch + 1:,}); "
                f"the loader never wraps: call reset() to start another pass"
            )
        start = self.cursor + self.rank * self.tokens_per_batch
        buf = torch.from_numpy(self.dataset.read(start, self.tokens_per_batch + 1).astype(np.int64))
        self.cursor += self.global_tokens_per_batch
        x = buf[:-1].view(self.batch_size, self.seq_len)
        y = buf[1:].view(self.batch_size, self.seq_len)
        return Batch(x, y, None if self.eod_id is None else document_ids(x, self.eod_id))

    def reset(self) -> None:
        self.cursor = 0

    def state_dict(self) -> dict[str, Any]:
        """The cursor plus what it is only meaningful with; rank-independent, so any one rank's copy restores all.
        document_masking: whether its batches carry document boundaries, so a resume trains as the run did."""
        return {
            "cursor": self.cursor,
            "fingerprint": self.dataset.fingerprint,
            "split": self.dataset.split,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "document_masking": self.eod_id is not None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor after checking the state belongs to this data and batch geometry."""
        expected = self.state_dict()
        # A state from before document masking existed may resume either way (so a run started then continues
        # under today's default); one that records it must match.
        missing = sorted(set(expected) - set(state) - {"document_masking"})
        if missing:
            raise ValueError(f"loader state lacks {missing}; it was not written by TokenDataLoader.state_dict()")
        problems = [
            f"{key}: saved {state[key]!r}, this loader has {expected[key]!r}"
            for key in ("fingerprint", "split", "seq_len", "document_masking")
            if state.get(key, expected[key]) != expected[key]
        ]
        # The cursor counts global batches, so any split of the same global batch over ranks continues it exactly.
        saved_rows, rows = state["batch_size"] * state["world_size"], self.batch_size * self.world_size
        if saved_rows != rows:
            problems.append(
                f"global batch (batch_size x world_size): saved {state['batch_size']} x "
                f"{state['world_size']} = {saved_rows} rows, this loader has {self.batch_size} x "
                f"{self.world_size} = {rows}"
            )
        cursor = state["cursor"]
        if not isinstance(cursor, int) or not 0 <= cursor <= self.dataset.num_tokens:
            problems.append(f"cursor: saved {cursor!r}, outside this split's 0..{self.dataset.num_tokens}")
        if problems:
            raise ValueError(
                f"cannot restore the {self.dataset.split} loader of {self.dataset.path}: "
                + "; ".join(problems)
                + " (resume with the dataset, seq_len, data.document_masking and global batch the checkpoint was "
                "written with: train.batch_size x the number of processes)"
            )
        self.cursor = cursor

    def __repr__(self) -> str:
        return (
            f"TokenDataLoader({self.dataset.split!r}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"rank={self.rank}, world_size={self.world_size}, eod_id={self.eod_id}, "
            f"cursor={self.cursor:,}/{self.dataset.num_tokens:,})"
        )


def document_ids(x: torch.Tensor, eod_id: int) -> torch.Tensor | None:
    """x [B, T] token ids -> each position's document within its row [B, T] (0 at position 0, +1 after each
    eod_id), or None when no row has an eod_id before its last position (nothing to mask)."""
    ends = x[:, :-1] == eod_id  # an eod at t starts a document at t + 1; one in the last column starts none here
    if not ends.any():
        return None
    ids = torch.zeros_like(x)
    ids[:, 1:] = ends.cumsum(dim=1)
    return ids
