"""Softmax attention's shared parts: the rotary embedding, causal attention through SDPA, attention within the
documents packed into a row, and the keys a slice of queries sees under context parallelism. MLA
(k3train/models/k3/mla.py) and the dense peer's attention (k3train/models/dense.py) both run on them.

Documents packed into a row (a Documents, documents.py, built once per forward by the model): each position attends
causally within its own document only (block-diagonal causal). How, on a CPU, is document_attention's choice
(docs/decisions/document-masking.md): rows cut into tiles of whole documents, each tile one SDPA call; the tiles and
their masks, like a GPU's [B, T, T] mask, are made by the first attention layer of a forward and read by the others
from the Documents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.common.documents import Documents, block_causal_mask

# document_attention's tiles: consecutive documents are grouped until a tile holds at least this many positions
# (a longer document is a tile alone). Smaller tiles skip more of the masked-out square, larger ones make fewer
# calls, which matters on a busy CPU; measured on k3_small's shapes in docs/decisions/document-masking.md.
MIN_DOCUMENT_TILE = 256


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on the last dim (half-split pairing: channel i rotates with i + dr/2)."""

    def __init__(self, dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.dim, self.max_seq_len, self.theta = dim, max_seq_len, theta
        cos, sin = self._angles()
        # Non-persistent: derived from the config, so not part of a checkpoint.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _angles(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.theta ** (-torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), inv_freq)  # [T_max, dr/2]
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """cos and sin computed again (on the CPU in fp32, as __init__ does), for a module built on the meta device
        and allocated after (k3train/models/common/init.py's materialise)."""
        cos, sin = self._angles()
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """x [B, T, H, dr] -> same shape, x[:, t] rotated as position start + t."""
        T = x.shape[1]
        cos = self.cos[start : start + T, None, :].to(x.dtype)  # [T, 1, dr/2]
        sin = self.sin[start : start + T, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None = None
) -> torch.Tensor:
    """q, k [B, H, T, dk], v [B, H, T, dv] -> [B, H, T, dv]: causal softmax attention, or with `visible` (bool,
    broadcast to [B, H, T, T], True where query i may attend key j) attention over those pairs instead.

    On CPU, torch's fused (flash) kernel needs dk == dv and otherwise falls back to the math path, which
    materialises the T x T weights and is slower (docs/decisions/mla-attention.md). So on CPU with dk != dv the
    narrower side gets zero columns appended: they change no score and no output column, so the result is exact.
    """
    dk, dv = q.shape[-1], v.shape[-1]
    mask = dict(is_causal=True) if visible is None else dict(attn_mask=visible)
    if q.device.type != "cpu" or dk == dv:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **mask)
    if dv < dk:
        return F.scaled_dot_product_attention(q, k, F.pad(v, (0, dk - dv)), scale=scale, **mask)[..., :dv]
    q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **mask)


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    documents: Documents | torch.Tensor,
    min_tile: int = MIN_DOCUMENT_TILE,
) -> torch.Tensor:
    """causal_attention within each document: q, k [B, H, T, dk], v [B, H, T, dv], documents a Documents (or
    document_ids [B, T]), whose mask (a GPU's) or tiles with their masks (a CPU's) are made once and kept there for
    the forward's other attention layers.

    On a CPU each row is cut into tiles of whole consecutive documents holding at least min_tile positions (the last
    may hold fewer); a tile of one document is plain causal attention, one of several gets their block-diagonal
    causal mask. No position attends across a tile, so little outside a document's own block is computed, and short
    documents share a call. Elsewhere (a GPU: not measured here) one call takes the whole [B, T, T] mask, with no host
    sync and no per-tile launches. torchtitan builds the same mask for flex_attention (get_document_mask_mod), which
    has no CPU backward; why tiles, with numbers: docs/decisions/document-masking.md.
    https://github.com/pytorch/torchtitan/blob/0012170a0708b751408e6085f970082ecd678d2b/torchtitan/models/attention.py
    """
    documents = Documents.local(documents)
    if q.device.type != "cpu":
        return causal_attention(q, k, v, scale, documents.block_causal_mask.unsqueeze(1))
    rows = []
    for b, tiles in enumerate(documents.cached(("attention_tiles", min_tile), lambda: _row_tiles(documents, min_tile))):
        outputs = [causal_attention(*(x[b : b + 1, :, i:j] for x in (q, k, v)), scale, mask) for i, j, mask in tiles]
        rows.append(torch.cat(outputs, dim=2))
    return torch.cat(rows, dim=0)


def _row_tiles(documents: Documents, min_tile: int) -> list[list[tuple[int, int, torch.Tensor | None]]]:
    """Per row, document_attention's tiles: (start, stop, the tile's [1, 1, n, n] block-causal mask, or None for a
    tile of one document: plain causal)."""
    rows = []
    for b, lengths in enumerate(documents.lengths):
        rows.append([])
        for start, stop, count in _document_tiles(lengths, min_tile):
            ids = documents.ids[b : b + 1, start:stop]
            rows[-1].append((start, stop, None if count == 1 else block_causal_mask(ids).unsqueeze(1)))
    return rows


def _document_tiles(lengths: list[int], min_tile: int) -> list[tuple[int, int, int]]:
    """A row's documents (their lengths in order) grouped into tiles of at least min_tile positions, a document of
    min_tile or more a tile alone (plain causal): (start, stop, number of documents) of each tile."""
    tiles, start, stop, documents = [], 0, 0, 0
    for length in lengths:
        if documents and length >= min_tile:  # not the tail of a masked tile: its square would mostly be masked out
            tiles.append((start, stop, documents))
            start, documents = stop, 0
        stop, documents = stop + length, documents + 1
        if stop - start >= min_tile:
            tiles.append((start, stop, documents))
            start, documents = stop, 0
    return tiles + [(start, stop, documents)] if documents else tiles


def visible_keys(
    T: int, start: int, document_ids: torch.Tensor | None, key_ids: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[B or 1, T, start + T] bool: which keys the T queries at global positions start.. see, causally by global
    position and, with documents, within their own (document_ids the queries', key_ids the keys')."""
    S = start + T
    visible = (torch.arange(S, device=device)[None, :] <= (start + torch.arange(T, device=device))[:, None])[None]
    if document_ids is not None:
        visible = visible & (document_ids[:, :, None] == key_ids[:, None, :])
    return visible
