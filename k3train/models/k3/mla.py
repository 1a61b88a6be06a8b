"""Multi-head Latent Attention (DeepSeek-V3's reference MLA), NoPE by default as in Kimi Linear (arXiv 2510.26692).
https://github.com/deepseek-ai/DeepSeek-V3/blob/9b4e9788e4a3a731f7567338ed15d3ec549ce03b/inference/model.py

Per head h the query is [q_nope (dn) | q_rope (dr)]; keys are [k_nope (dn) | k_rope (dr)] where k_nope comes
from a compressed latent c_kv and k_rope is ONE key slice shared by all heads. With `rope=False` (Kimi Linear)
the dr slices are still there, shared and unrotated. Scores use scale (dn + dr) ** -0.5.

QK-Clip support (Kimi K2, arXiv 2507.20534): with `track_max_logit = True` every training-mode forward pass
also measures the per-head max scaled causal logit, a tile at a time (causal_max_logit), and folds it into
`max_logit` (a running max, so all micro-batches of an accumulated update count) until k3train.optim.qk_clip.qk_clip_
reads and clears it.
Eval-mode passes never touch it. `scale_qk_heads_` rescales chosen heads' query/key rows.

Kimi K3's two additions, both off by default (then the layer is Kimi Linear's, bitwise): an output gate
(`output_gate`: the attention output [B, T, H * dv] times sigmoid(g_proj x) before o_proj, in training and in cached
decoding alike) and a separate epsilon for the two latent norms q_a_norm and kv_a_norm (`latent_norm_eps`; K3 uses
1e-6 there and 1e-5 elsewhere). The released K3, read at
https://github.com/NVIDIA-NeMo/Automodel/blob/9a9b020c389454efdc58e6f39b15eedc8280dbff/nemo_automodel/components/models/kimi_k3/model.py
(KimiMLAAttention: g_proj [H * dv, d] without bias, sigmoid, elementwise before o_proj; its latent norms keep
their own 1e-6 default rather than rms_norm_eps).

Documents packed into a row (a Documents, k3train/models/common/documents.py, built once per forward by the model):
each position attends causally within its own document only (block-diagonal causal: document_attention,
k3train/models/common/attention.py, which says how on a CPU), and QK-Clip's max logit counts only those pairs.
Decoding (forward_cached) is one document and unaffected.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from k3train.models.common.attention import RotaryEmbedding, causal_attention, document_attention, visible_keys
from k3train.models.common.context_parallel import ContextParallel
from k3train.models.common.documents import Documents
from k3train.models.common.norm import RMSNorm
from k3train.models.k3.cache import MLACache
from k3train.models.layout import ParamLayout

# causal_max_logit's square tiles: a tile's fp32 logits for every head hold at most this many values, the same
# budget whatever the heads and the sequence (the [H, T, S] logits at K3's 96 heads and 131,072 positions would be
# 6.6 TB). On CPU 64 MiB, the LM head's logits block (k3train/models/common/loss.py): k3_small's [8, 1024, 1024] is one
# tile, one matmul a row as before. On a GPU 256 MiB, a fifth of the LM head's GPU block: at K3's 96 heads an
# 836 x 836 tile, about 40 FLOPs per byte it reads and writes, so the fp32 FLOPs rather than the memory traffic
# should set its time (not measured on a GPU).
MAX_LOGIT_BLOCK_VALUES = 2**24
GPU_MAX_LOGIT_BLOCK_VALUES = 2**26


class MultiHeadLatentAttention(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model], causal MLA (module docstring).

    norm_eps: epsilon of the latent norms unless latent_norm_eps is given (the layer has no other norm).
    output_gate: add g_proj (Linear(d_model, n_heads * v_head_dim), no bias) and multiply the attention output by
    sigmoid(g_proj x) per channel before o_proj; off, the module, its parameters and its outputs are as before.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope: bool = False,
        rope_theta: float = 10000.0,
        max_seq_len: int = 4096,
        norm_eps: float = 1e-6,
        output_gate: bool = False,
        latent_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        latent_eps = norm_eps if latent_norm_eps is None else latent_norm_eps
        self.n_heads, self.dn, self.dr, self.dv = n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = (self.dn + self.dr) ** -0.5
        q_dim = n_heads * (self.dn + self.dr)

        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, eps=latent_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_dim, bias=False)
        self.kv_a_proj = nn.Linear(d_model, kv_lora_rank + self.dr, bias=False)  # -> [c_kv | k_rope]
        self.kv_a_norm = RMSNorm(kv_lora_rank, eps=latent_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, n_heads * (self.dn + self.dv), bias=False)  # -> per head [k_nope | v]
        self.o_proj = nn.Linear(n_heads * self.dv, d_model, bias=False)
        # Built last, so that the other weights draw the same random numbers with the gate on or off.
        self.g_proj = nn.Linear(d_model, n_heads * self.dv, bias=False) if output_gate else None
        self.rotary = RotaryEmbedding(self.dr, max_seq_len, rope_theta) if rope else None

        self.track_max_logit = False
        self.max_logit: torch.Tensor | None = None  # [H] fp32 running max since QK-Clip last read it
        # the ranks the sequence is split over (parallel.cp; k3train/models/common/context_parallel.py), or None
        self.context_parallel: ContextParallel | None = None

    @property
    def q_out_proj(self) -> nn.Linear:
        """The projection whose rows are per head [q_nope | q_rope]: q_proj, or q_b_proj with query compression."""
        return self.q_proj if hasattr(self, "q_proj") else self.q_b_proj

    def param_layouts(self) -> dict[str, ParamLayout]:
        """Muon may orthogonalise these per head (k3train/models/layout.py): rows [H*dh, in] of the query's and
        kv_b's outputs and of the gate (head h's rows gate head h's output channels), columns [out, H*dh] of o."""
        rows = ["q_proj" if hasattr(self, "q_proj") else "q_b_proj", "kv_b_proj"]
        if self.g_proj is not None:
            rows.append("g_proj")
        layouts = {f"{name}.weight": ParamLayout(head_split=(self.n_heads, 0)) for name in rows}
        return {**layouts, "o_proj.weight": ParamLayout(head_split=(self.n_heads, 1))}

    def forward(self, x: torch.Tensor, documents: Documents | torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d], causal; with documents (a Documents, or document_ids [B, T]), causal within each
        document. Split over ranks (context_parallel), x is this rank's slice of the rows and the keys are every
        position up to its last (their document ids: the Documents', gathered once per forward)."""
        B, T, _ = x.shape
        H, dn, dr, dv = self.n_heads, self.dn, self.dr, self.dv
        cp = self.context_parallel
        documents = Documents.of(documents, cp)
        document_ids = None if documents is None else documents.ids
        key_ids = None if documents is None else documents.key_ids
        start = 0 if cp is None else cp.offset(T)
        q = self._query(x).view(B, T, H, dn + dr)
        latent = self.kv_a_proj(x)  # [B, T, r + dr]: [c_kv | k_rope]
        if cp is not None:  # the latent is what moves (kv_lora_rank + dr a position), keys and values are made here
            latent = torch.cat(cp.gather(latent)[: cp.rank + 1], dim=1)  # [B, start + T, r + dr]
        S = latent.shape[1]  # keys: every position up to this rank's last
        c_kv, k_rope = latent.split([self.kv_lora_rank, dr], dim=-1)  # [B, S, r], [B, S, dr]
        kv = self.kv_b_proj(self.kv_a_norm(c_kv)).view(B, S, H, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k_rope = k_rope.unsqueeze(2)  # [B, S, 1, dr]: one rotary key shared by all heads
        if self.rotary is not None:
            q = torch.cat((q[..., :dn], self.rotary(q[..., dn:], start)), dim=-1)
            k_rope = self.rotary(k_rope)
        k = torch.cat((k_nope, k_rope.expand(B, S, H, dr)), dim=-1)  # [B, S, H, dn+dr]

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T or S, D]
        visible = None
        if cp is not None and documents is None:
            visible = visible_keys(T, start, None, None, x.device)
        elif cp is not None:  # the same for every MLA layer of the forward
            visible = documents.cached(
                ("mla_visible_keys", T, start, x.device),
                lambda: visible_keys(T, start, document_ids, key_ids, x.device),
            )
        if self.track_max_logit and self.training:
            # A running max until QK-Clip reads and resets it: gradient-accumulated micro-batches all count.
            with torch.autocast(q.device.type, enabled=False):  # fp16 would overflow past 65504, bf16 round
                step_max = causal_max_logit(q, k, self.scale, document_ids, key_ids)
            self.max_logit = step_max if self.max_logit is None else torch.maximum(self.max_logit, step_max)
        if visible is not None:
            o = causal_attention(q, k, v, self.scale, visible.unsqueeze(1))
        elif documents is None:
            o = causal_attention(q, k, v, self.scale)  # [B, H, T, dv]
        else:
            o = document_attention(q, k, v, self.scale, documents)
        return self._output(o.transpose(1, 2).reshape(B, T, H * dv), x)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [B, T, H * dv] (heads concatenated), x [B, T, d] the layer's input -> o_proj(o), gated when on.

        The gate is per token and per channel, so the full forward and cached decoding share this one step.
        """
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def empty_cache(self, batch: int, capacity: int, device: torch.device, dtype: torch.dtype) -> MLACache:
        return MLACache.empty(batch, capacity, self.kv_lora_rank, self.dr, device, dtype)

    def forward_cached(self, x: torch.Tensor, cache: MLACache) -> torch.Tensor:
        """forward() continued from `cache` (appended in place): x [B, T, d] are the next T positions.

        Attention runs in the latent space: kv_b_proj's key half is absorbed into the query and its value half
        applied after the weighted sum (DeepSeek-V2, arXiv 2405.04434, section 2.1.3; DeepSeek-V3's reference MLA,
        attn_impl "absorb", cited at the top of this file), so per-head keys and values are never built for the
        cached positions. The output gate (when on) needs only the new tokens' x, so it is applied as in forward().
        """
        B, T, _ = x.shape
        H, dn, dr, dv, r = self.n_heads, self.dn, self.dr, self.dv, self.kv_lora_rank
        start = cache.length
        if self.rotary is not None and start + T > self.rotary.cos.shape[0]:
            raise ValueError(
                f"position {start + T - 1} is past the rotary table's {self.rotary.cos.shape[0]} "
                "positions (max_seq_len): decode a shorter context"
            )
        q_nope, q_rope = self._query(x).view(B, T, H, dn + dr).split([dn, dr], dim=-1)
        c_kv, k_rope = self.kv_a_proj(x).split([r, dr], dim=-1)
        if self.rotary is not None:
            q_rope = self.rotary(q_rope, start)
            k_rope = self.rotary(k_rope.unsqueeze(2), start).squeeze(2)
        latent, k_rope = cache.append(self.kv_a_norm(c_kv), k_rope)  # every position so far: [B, S, r], [B, S, dr]

        w_kv = self.kv_b_proj.weight.view(H, dn + dv, r)
        # q_nope . (W_uk c) == (W_uk^T q_nope) . c: the query moves into the latent space once per new token.
        q_latent = torch.einsum("bthd,hdr->bthr", q_nope, w_kv[:, :dn])
        scores = (
            torch.einsum("bthr,bsr->bhts", q_latent, latent) + torch.einsum("bthd,bsd->bhts", q_rope, k_rope)
        ) * self.scale  # [B, H, T, S]
        # New token t sits at position start + t and sees positions 0..start + t.
        visible = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
        # Softmax in at least fp32 (half-precision scores are upcast; fp64 stays fp64, so it matches forward()).
        softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
        weights = scores.masked_fill(~visible, -math.inf).softmax(dim=-1, dtype=softmax_dtype).to(latent.dtype)
        o_latent = torch.einsum("bhts,bsr->bthr", weights, latent)
        o = torch.einsum("bthr,hdr->bthd", o_latent, w_kv[:, dn:])  # the value half of kv_b_proj, applied once
        return self._output(o.reshape(B, T, H * dv), x)

    @torch.no_grad()
    def scale_qk_heads_(self, gamma: torch.Tensor) -> None:
        """QK-Clip's weight update, in place. gamma [H], each in (0, 1]: head h's logits scale by gamma[h].

        Query rows of head h: the dn rows by sqrt(gamma), the dr rows by gamma; k_nope rows of kv_b_proj by
        sqrt(gamma). The shared rotary key (kv_a_proj) and V are untouched, so the rotary part of the logit
        carries the whole gamma on the query side (also for NoPE, where the dr slice is simply unrotated).
        The output gate (g_proj) acts after the softmax and is untouched too.
        """
        H, dn, dr, dv = self.n_heads, self.dn, self.dr, self.dv
        gamma = gamma.to(device=self.kv_b_proj.weight.device, dtype=torch.float32)
        root = gamma.sqrt()
        # One factor per row ([H*(dn+dr)] and [H*(dn+dv)]), so that a weight sharded by rows (FSDP2) scales the
        # rows it holds.
        q_rows = torch.cat([root[:, None].expand(H, dn), gamma[:, None].expand(H, dr)], dim=1).reshape(-1)
        kv_rows = torch.cat([root[:, None].expand(H, dn), torch.ones(H, dv, device=gamma.device)], dim=1).reshape(-1)
        scale_rows_(self.q_out_proj.weight, q_rows)
        scale_rows_(self.kv_b_proj.weight, kv_rows)


@torch.no_grad()
def scale_rows_(weight: torch.Tensor, row_scale: torch.Tensor) -> None:
    """weight [R, C] *= row_scale [R, 1], in place; an FSDP2 weight (a DTensor sharded by rows) scales its own rows."""
    scale = row_scale.to(weight.dtype)[:, None]
    if isinstance(weight, DTensor):
        scale = distribute_tensor(scale, weight.device_mesh, weight.placements, src_data_rank=None)
    weight.mul_(scale)


@torch.no_grad()
def causal_max_logit(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    document_ids: torch.Tensor | None = None,
    key_document_ids: torch.Tensor | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """q [B, H, T, D], k [B, H, S, D] with S >= T: the T queries are the last T of the S positions (S = T, or under
    context parallelism a rank's slice against the keys up to its last position) -> [H] fp32: the max over batch
    and causal pairs (key position <= query position) of scale * q . k, both in fp32; scale > 0. With document_ids
    [B, T] (the queries') over the pairs within one document only (key_document_ids [B, S]: the keys', when S > T),
    which are the logits attention computes: the pairs visible_keys marks.

    A separate matmul because the fused attention kernel never exposes its logits. Computed a batch row and a
    square tile at a time (tile: its side, default max_logit_tile), so that the extra memory is one tile's logits
    for every head, never [H, T, S], and the tiles above the diagonal are skipped. Each mask is made for its tile,
    from positions and document ids, and only where needed: the diagonal tile's causal mask, documents' everywhere.
    The loops follow the shapes alone, so nothing waits on the device.
    """
    B, H, T, _ = q.shape
    S = k.shape[2]
    side = tile or max_logit_tile(H, q.device.type)
    key_ids = document_ids if key_document_ids is None else key_document_ids
    causal = torch.ones(min(side, T), min(side, T), dtype=torch.bool, device=q.device).tril()
    best = torch.full((H,), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(B):
        for i0, i1, keys in max_logit_tiles(T, S, side):
            query = q[b, :, i0:i1].float()
            for j0, j1 in keys:
                logits = query @ k[b, :, j0:j1].float().transpose(-1, -2)  # [H, i1 - i0, j1 - j0]
                pairs = causal[: i1 - i0, : i1 - i0] if j1 == S - T + i1 else None  # the diagonal tile
                if document_ids is not None:
                    same = document_ids[b, i0:i1, None] == key_ids[b, None, j0:j1]
                    pairs = same if pairs is None else pairs & same
                if pairs is not None:
                    logits.masked_fill_(~pairs, -math.inf)
                best = torch.maximum(best, logits.amax(dim=(-1, -2)))
    # Scaled once at the end: rounding is monotonic, so with scale > 0 the max of the rounded products scale * x
    # is the rounded product of the max, bit for bit what scaling every logit first would give.
    return best * scale


def max_logit_tile(n_heads: int, device_type: str) -> int:
    """causal_max_logit's tile side: the most query rows by key columns whose fp32 logits for n_heads heads fit
    the device's block (MAX_LOGIT_BLOCK_VALUES, GPU_MAX_LOGIT_BLOCK_VALUES)."""
    block = MAX_LOGIT_BLOCK_VALUES if device_type == "cpu" else GPU_MAX_LOGIT_BLOCK_VALUES
    return max(1, math.isqrt(block // n_heads))


def max_logit_tiles(T: int, S: int, side: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The tiles causal_max_logit computes for T queries at the last T of S positions: per tile of up to `side`
    query rows [i0, i1), the key spans [j0, j1) it sees, the diagonal one first (keys at the tile's own positions,
    S - T + i0 to S - T + i1), then those before it, `side` keys each, back to key 0."""
    start = S - T
    tiles = []
    for i0 in range(0, T, side):
        i1 = min(i0 + side, T)
        before = [(max(0, j1 - side), j1) for j1 in range(start + i0, 0, -side)]
        tiles.append((i0, i1, [(start + i0, start + i1), *before]))
    return tiles
