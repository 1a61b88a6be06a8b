"""Documents packed into one row: the `document_ids` convention the models take, and the forms kernels want.

document_ids [B, T] int64: the document each position belongs to within its row, non-decreasing along the row and
changing exactly where a new document starts (the loader numbers them 0, 1, 2, ... from position 0, a new one after
each end-of-document token: k3train/data/loader.py). None means no row has a boundary inside it: every layer then
runs its unmasked path, bitwise as without document masking, and builds no mask.

A row's first document may be the tail of one that began in an earlier row: it is treated as starting at position
0, as the row itself is. Only inside a row do documents need telling apart.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
