"""A loader's batches as one rank of a context-parallel group holds them: slice r of cp along the sequence.

The cp ranks of a group read the same rows (the loader's rank is the data-parallel one, k3train/runtime/
parallel_dims.py) and each keeps positions [r T / cp, (r + 1) T / cp) of every row: inputs, targets and document
ids alike. Document ids stay the row's (numbered from the row's start), so a slice can tell whether it begins a
document or continues the previous slice's (k3train/models/kda/context_parallel.py). Everything else, the cursor
and its checkpoint state included, is the loader's: the ranks of a group move through the data together.
"""

from __future__ import annotations

from typing import Any

from k3train.data.loader import Batch


class ContextSlices:
    def __init__(self, loader, rank: int, size: int):
        if loader.seq_len % size:
            raise ValueError(
                f"train.seq_len={loader.seq_len} does not split over parallel.cp={size} ranks: choose a sequence "
                f"length divisible by {size}"
            )
        self.loader, self.rank, self.size = loader, rank, size

    def next_batch(self) -> Batch:
        batch = self.loader.next_batch()
        length = self.loader.seq_len // self.size
        mine = slice(self.rank * length, (self.rank + 1) * length)
        ids = batch.document_ids
        return Batch(batch.inputs[:, mine], batch.targets[:, mine], None if ids is None else ids[:, mine])

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str):  # the cursor, reset, batches_remaining, global_tokens_per_batch: the loader's
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"ContextSlices({self.loader!r}, slice {self.rank} of {self.size})"
