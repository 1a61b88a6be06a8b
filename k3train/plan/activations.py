"""What a KimiK3 forward keeps for its backward, per layer and per micro-batch, from the model's shapes.

Bytes per token of the tensors autograd saves (each storage once), written out from the code of k3train/models/
(k3/model.py, kda/layer.py, kda/chunk.py, k3/mla.py, k3/moe/, common/norm.py, k3/attn_res.py, common/loss.py).
Notation: d model width; KDA H heads of K (W = H K), chunk C, projection width P = 3W + K + (W full-rank gate | K
low-rank) + H; MLA h heads, q/k width q = nope + rope, v width v, latents r_kv, r_q; MoE n experts, top k, expert
width f, routed width r (the latent, else d), shared width s = n_shared f, dense width f_d. Sizes: f = 4 bytes (fp32
always), a = the activation dtype (2 under a bf16/fp16 autocast, else 4), i = 8 (int64). Under autocast a matmul
saves its own cast of its input, so an input read by m projections is saved m times in a; in fp32 the same tensor
once.

  every layer  attention residuals on: 4d f (the two mix sources h and s, the two mix outputs; 3d at layer 0, which
               has no attention mix) + 3 f per mix source
               (scores, rsqrt, probabilities) + 2 f (rstds); off: 2d f + 2 f
               the mixer's and the FFN's normalised inputs: fp32 1 x d each; autocast m x d a, the MoE's router
               also d f (it runs in fp32)
  KDA (chunk)  a: P (the fused projection's output) + H (beta) + 2W (output gate, o_proj input)
               f: 3W (conv pre-activation) + 2W + 2H (normalised q, k) + 2W (forget gate) + H + W (o's norm's rstd
                  and output) + [7W + H + 3 H C + H K^2 / C + W] x (padded T / T)  (chunk_kda's q, k, v, G, w, u,
                  v_new; beta; A_qk, P, M; the chunk-start states; its output o, a view of the padded chunks)
  KDA (fla)    the chunk_kda part replaced by FLA's own saves, estimated (not measured here): the conv output 3W f,
               g W f, beta H f, two [C]-wide matrices per head 2 H C f
  MLA          a: q h (q storage) + k h q + v (a padded copy on CPU when q != v, else the kv_b output's h (nope + v))
                  + out h max(q, v) (CPU) or h v + o, gate and o_proj input 3 h v (gated; 1 h v without the gate)
               f: lse h + the kv latent: fp32 (r_kv + rope) + 1 + r_kv; autocast 2 r_kv + 1 f and r_kv a (the query
                  latent alike when q_lora_rank is set)
  MoE          f: n (scores) + 1 + k (weights); i: 3k (choices, slot order, token of slot)
               a: 2kr (the experts' input and output slots) + 2kf (gate, up) + k (gate weights)
               latent: r f + 1 f + r a; shared: 3s a (SiTU) or 4s a (SwiGLU)
  dense FFN    3 f_d a (SiTU) or 4 f_d a (SwiGLU)
  the root     the last layer's output and the final norm's input (attention residuals: 2d f + 3 f per source;
               else d f) + 1 f + 8 (token ids) + d a (the loss's gradient for the hidden states) and, per model,
               V d a (the LM head's gradient, computed in the forward by k3train/models/common/loss.py)

Context parallelism (parallel.cp; k3train/models/common/context_parallel.py): a rank holds T_l = seq_len / cp positions
of its B rows and its layers keep the above for them, except what the split adds (ContextSlice: slice r of cp, its
MLA keys S = (r + 1) T_l positions, the last rank's S = seq_len the most):
  KDA          f: the identity pass's chunk_kda saves, as the main pass's (value width K = V) 7W + H + 3 H C +
                  H K^2 / C, padded; o becomes a sum of its own (W f), beside the identity pass's Q (fp32: its padded
                  output, W f padded; autocast: the einsum's cast, W a, the padded output then unsaved); the short
                  conv's window, the previous rank's conv_size - 1 inputs then the slice's (3W a; and per row
                  (conv_size - 1) 3W (a + f) more window and pre-activation)
               per row: the entering state S_in H K V a (cast for the einsum under autocast); past the first rank,
                  composing r slices' summaries (S = M_j S + F_j from S = 0) keeps, fp32: r states H K V f and, from
                  r = 2 (the first matmul's S needs no gradient), the gathered summaries cp H K (K + V) f; autocast:
                  r casts of S and r - 1 of M_j, (2r - 1) H K K a
  MLA          per key position instead of per query: the kv latent, k, v (and their CPU padding); plus the mask
               SDPA keeps, [B or 1, T_l, S] in a (its bool mask converted to the query's dtype; B rows with document
               masking, one shared without)

Document masking (data.document_masking): selective checkpointing keeps the ids as its checkpoint's input (8 a
token); MLA on a GPU attends with the [B, T, T] block-causal mask, kept as above (on a CPU it attends by tiles of
documents, whose masks depend on the documents' lengths: not counted).

Checkpointing (train.activation_checkpointing; k3train/models/k3/model.py): "block" keeps a layer's input (d f) and,
for a MoE, its routing (k i) until the backward recomputes the rest; "selective" keeps the common part, the MoE's
router, gate weights and shared expert, and the inputs of what it recomputes (the mixer, the routed experts, the
dense FFN: d f each). The backward recomputes one layer at a time: its whole activations come back transiently.

Weight copies (per layer, not per token): under autocast every matmul weight is cast to a and the cast is kept
until the layer's backward; torch's autocast caches the cast of a leaf weight until the forward ends, checkpointed
or not (measured: a checkpointed stack of Linear layers held its bf16 casts until autocast exited), while the KDA
fused projection (a torch.cat of six weights) and the routed experts (cast inside GroupedSwiGLU, the local E / ep
of them) are copies only the saving op keeps. In fp32 the fused projection and convolution weights are kept as
concatenated fp32 copies. Under FSDP2's MixedPrecisionPolicy (precision bf16 / fp16 over dp_shard > 1 ranks:
k3train/train/precision.py's fsdp_policy) the weights a unit gathers are already bf16, so autocast casts none of them
and keeps no copy (half_weights: no leaf copy, saved or cached; the matmuls save the gathered weight itself, which
FSDP2 frees after the forward and gathers again for the backward); the routed experts' cast goes too where FSDP2
gathers them (half_experts: expert_shard > 1; with expert_shard 1 FSDP2 ignores them and they stay fp32); KDA's
concatenations are still made, in bf16. Not counted: tensors of a few values per layer, the autograd graph itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

F32, I64 = 4, 8


@dataclass(frozen=True)
class ContextSlice:
    """One rank's part of rows split over `size` ranks (parallel.cp): slice `rank` of each row, whose MLA keys are
    every position up to its last, (rank + 1) slices."""

    size: int
    rank: int

    @classmethod
    def last(cls, size: int) -> ContextSlice:
        """The last rank of a group: its queries see every position of the row, so it keeps the most."""
        return cls(size, size - 1)

    @property
    def key_slices(self) -> int:
        return self.rank + 1


@dataclass(frozen=True)
class LayerActivations:
    saved: float  # bytes kept from the layer's forward until its backward (this micro-batch's tokens)
    full: float  # what it keeps without checkpointing: the recompute's size, and the size of its backward's gradients
    copies_saved: float  # weight copies kept until the layer's backward
    copies_cached: float  # weight copies autocast holds until the forward ends (and no longer)


def mix_sources(c, layer: int) -> tuple[int, int]:
    """How many sources the attention-residual mixes of `layer` read: (before the mixer, before the FFN); 0: none."""
    S = c.attn_res_block_size
    before = 0 if layer == 0 else (layer - 1) // S + 1  # layers 0, S, 2S, ... below this one started a block
    attn = before + 1 if before else 0
    return attn, before + (1 if layer % S == 0 else 0) + 1


def output_sources(c) -> int:
    return (c.n_layers - 1) // c.attn_res_block_size + 2


def layer_activations(
    c,
    layer: int,
    tokens: int,
    seq_len: int,
    mode: str,
    act: int,
    device_type: str,
    local_experts: int,
    context: ContextSlice | None = None,
    documents: bool = False,
    half_weights: bool = False,
    half_experts: bool = False,
) -> LayerActivations:
    """The bytes layer `layer` keeps for `tokens` tokens (batch x seq_len) under checkpointing `mode`, activation
    bytes `act` (2 or 4), on `device_type` ("cpu" pads MLA's narrower heads), holding `local_experts` experts.
    With `context`, the rows are split over ranks and seq_len is this rank's slice of them; `documents`: document
    masking on; half_weights / half_experts: FSDP2 gathers the weights / the routed experts in bf16 (the module
    docstring's weight copies)."""
    autocast = act < F32
    moe = c.is_moe_layer(layer)
    if _kind(c, layer) == "mla":
        mixer = _mla_keys(c, tokens, seq_len, act, device_type, context, documents)
    elif context is None:
        mixer = tokens * _kda(c, seq_len, act)
    else:
        mixer = _kda_split(c, tokens, seq_len, act, context)
    full = mixer + tokens * (
        _common(c, layer)
        + _mixer_inputs(c, layer, act, autocast, "none")
        + _ffn_inputs(c, layer, act, autocast, "none")
        + (_moe(c, act) if moe else _glu(c, c.dense_ffn_dim, act))
    )
    if mode == "none":
        saved = full
    elif mode == "block":
        saved = tokens * (c.d_model * F32 + (c.experts_per_token * I64 if moe else 0))
    elif mode == "selective":
        ffn = _moe_selective(c, act) if moe else 0.0
        saved = tokens * (
            _common(c, layer)
            + _mixer_inputs(c, layer, act, autocast, mode)
            + _ffn_inputs(c, layer, act, autocast, mode)
            + ffn
            + (I64 if documents else 0)  # the mixer's checkpoint keeps the ids it is called with
        )
    else:
        raise ValueError(f"activation checkpointing {mode!r} must be none, block or selective")
    saved_copies, cached_copies = _weight_copies(c, layer, act, mode, local_experts, half_weights, half_experts)
    return LayerActivations(saved, full, saved_copies, cached_copies)


def root_activations(c, tokens: int, act: int, first: bool = True, last: bool = True) -> float:
    """What the model outside its layers keeps: the final mix and norm's inputs, the token ids, and the loss's
    gradients (grad_hidden per token, the LM head's fp32 gradient per model). A pipeline stage keeps the token ids
    when it holds the embedding (first) and the rest when it holds the head and loss (last)."""
    ids = tokens * I64 if first else 0
    if not last:
        return ids
    d = c.d_model
    if c.attn_res_block_size is None:
        per_token = d * F32
    else:
        per_token = 2 * d * F32 + 3 * output_sources(c) * F32
    per_token += F32 + d * act
    return ids + tokens * per_token + c.vocab_size * d * act  # the LM head's gradient, in the matmul dtype


def _kind(c, layer: int) -> str:
    return c.layer_pattern[layer]


def _common(c, layer: int) -> float:
    d = c.d_model
    if c.attn_res_block_size is None:
        return 2 * d * F32 + 2 * F32
    attn, mlp = mix_sources(c, layer)
    mixed = 4 if attn else 3  # layer 0 has no attention mix: its norm reads the embedding itself
    return mixed * d * F32 + 2 * F32 + 3 * (attn + mlp) * F32


def _mixer_inputs(c, layer: int, act: int, autocast: bool, mode: str) -> float:
    """The mixer's normalised input as its projections keep it."""
    d = c.d_model
    if not autocast or mode == "selective":  # the norm's output itself (under selective: the checkpoint's input)
        return d * F32
    if _kind(c, layer) == "kda":
        return d * act  # one fused projection
    readers = 2 + (1 if c.mla_output_gate else 0)  # q (q_proj or q_a_proj), kv_a_proj, g_proj
    return readers * d * act


def _ffn_inputs(c, layer: int, act: int, autocast: bool, mode: str) -> float:
    d = c.d_model
    if not autocast:
        return d * F32
    if not c.is_moe_layer(layer):
        return d * F32 if mode == "selective" else 2 * d * act  # w_gate and w_up cast it each
    readers = (2 if c.n_shared_experts else 0) + (1 if c.expert_latent_dim and mode != "selective" else 0)
    return d * F32 + readers * d * act  # the router reads it in fp32


def _kda(c, seq_len: int, act: int) -> float:
    H, K, C = c.kda_n_heads, c.kda_head_dim, c.kda_chunk_size
    W = H * K
    projection = 3 * W + K + (W if c.kda_output_gate == "full_rank" else K) + H
    per_token = (projection + H + 2 * W) * act
    per_token += (3 * W + 2 * W + 2 * H + 2 * W + H + W) * F32
    if c.kda_implementation == "chunk":  # its output o is a view of the padded chunks
        per_token += (_chunk_saved(c) + W) * F32 * _padded(c, seq_len)
    elif c.kda_implementation == "fla":
        per_token += (3 * W + W + H + 2 * H * C + W) * F32
    else:  # the per-step reference: autograd keeps every step's state
        per_token += (H * K * K + 5 * W + W) * F32
    return per_token


def _chunk_saved(c) -> float:
    """Per position, in fp32 elements: what one chunk_kda pass saves (q, k, v, G, w, u, v_new; beta; A_qk, P, M;
    the chunk-start states), padded positions included; its output not."""
    H, K, C = c.kda_n_heads, c.kda_head_dim, c.kda_chunk_size
    return 7 * H * K + H + 3 * H * C + H * K * K / C


def _padded(c, seq_len: int) -> float:
    C = c.kda_chunk_size
    return math.ceil(seq_len / C) * C / seq_len


def cp_kda_refusal(implementation: str) -> str:
    """Why the plan cannot size KDA under cp with `implementation` (not "chunk")."""
    if implementation == "fla":
        return (
            "the plan cannot size KDA under parallel.cp with model.kda_implementation=fla yet: training runs it "
            "(FLA's chunk_kda for both passes per slice), but what FLA's kernels save for those two passes under cp "
            "is not modelled (the plan sizes model.kda_implementation=chunk under cp)"
        )
    return (
        f"parallel.cp splits KDA with a chunked kernel: model.kda_implementation={implementation!r} does not run "
        "under cp (set model.kda_implementation=chunk, or fla, which the plan cannot size under cp yet)"
    )


def _kda_split(c, tokens: int, seq_len: int, act: int, context: ContextSlice) -> float:
    """KDA's bytes on a rank holding `seq_len` positions of tokens / seq_len rows split over ranks
    (k3train/models/kda/context_parallel.py; the module docstring's list)."""
    if c.kda_implementation != "chunk":
        raise ValueError(cp_kda_refusal(c.kda_implementation))
    H, K, n = c.kda_n_heads, c.kda_head_dim, c.kda_conv_size - 1
    W, rows, padded = H * K, tokens / seq_len, _padded(c, seq_len)
    autocast = act < F32
    base = _kda(c, seq_len, act) - W * F32 * padded  # without o, a view of the padded output here
    per_token = base + _chunk_saved(c) * F32 * padded  # the identity pass
    per_token += W * F32 + (W * act if autocast else W * F32 * padded)  # o; Q (its cast, or the padded output)
    per_token += 3 * W * act  # the short conv's window
    per_row = n * 3 * W * (act + F32)  # the window's and the pre-activation's tail rows
    per_row += H * K * K * act  # S_in (V = K)
    r = context.rank
    if r:  # composing the slices before this one: S = M_j S + F_j from S = 0, r matmuls
        if autocast:  # their casts of S, and of M_j where S needs a gradient (j > 0)
            per_row += (2 * r - 1) * H * K * K * act
        else:  # the states S, and the gathered summaries once S needs a gradient (from j = 1)
            per_row += (r + (2 * context.size if r > 1 else 0)) * H * K * K * F32
    return tokens * per_token + rows * per_row


def _mla_parts(c, act: int, device_type: str) -> tuple[float, float]:
    """MLA's bytes per query and per key position (one rank's own positions are both)."""
    h, q, v = c.mla_n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    r = c.kv_lora_rank
    autocast = act < F32
    per_key = (2 * r + 1) * F32 + r * act if autocast else (r + c.qk_rope_head_dim + 1 + r) * F32
    per_query = 0.0
    if c.q_lora_rank is not None:
        rq = c.q_lora_rank
        per_query += (2 * rq + 1) * F32 + rq * act if autocast else (2 * rq + 1) * F32
    kv_b = h * (c.qk_nope_head_dim + v)
    if device_type == "cpu" and q > v:  # v padded to q's width (k3/mla.py's causal_attention)
        per_query += 2 * h * q * act  # q, the padded output
        per_key += 2 * h * q * act  # k, the padded v
    elif device_type == "cpu" and v > q:  # q and k padded to v's width, v a view of kv_b's output
        per_query += 2 * h * v * act
        per_key += (h * v + kv_b) * act
    else:
        per_query += (h * q + h * v) * act
        per_key += (h * q + kv_b) * act
    per_query += h * F32  # logsumexp
    per_query += (3 if c.mla_output_gate else 1) * h * v * act
    return per_query, per_key


def _mla_keys(
    c, tokens: int, seq_len: int, act: int, device_type: str, context: ContextSlice | None, documents: bool
) -> float:
    """MLA's bytes for `seq_len` queries of each of tokens / seq_len rows: keys and values per key position (under
    cp every position up to the slice's last: k3train/models/k3/mla.py), and the mask SDPA keeps when it gets one
    (converted to the query's dtype): under cp always, [B or 1, T, S]; else with documents on a GPU, [B, T, T]."""
    per_query, per_key = _mla_parts(c, act, device_type)
    rows = tokens / seq_len
    keys = seq_len if context is None else context.key_slices * seq_len
    if context is not None:
        mask_rows = rows if documents else 1
    else:
        mask_rows = rows if documents and device_type != "cpu" else 0
    return tokens * per_query + rows * keys * per_key + mask_rows * seq_len * keys * act


def _glu(c, width: int, act: int) -> float:
    return (3 if c.ffn_activation == "situ" else 4) * width * act


def _moe(c, act: int) -> float:
    n, k, f = c.n_routed_experts, c.experts_per_token, c.expert_ffn_dim
    r = c.expert_latent_dim or c.d_model
    per_token = (n + 1 + k) * F32 + 3 * k * I64
    per_token += (2 * k * r + 2 * k * f + k) * act
    if c.expert_latent_dim:
        per_token += (r + 1) * F32 + r * act
    if c.n_shared_experts:
        per_token += _glu(c, c.n_shared_experts * f, act)
    return per_token


def _moe_selective(c, act: int) -> float:
    """Selective checkpointing's MoE: scores, weights (gathered, then normalised: the routed part's input), choices
    and the shared expert; the routed experts themselves are recomputed."""
    n, k = c.n_routed_experts, c.experts_per_token
    per_token = (n + 1 + 2 * k) * F32 + k * I64
    if c.n_shared_experts:
        per_token += _glu(c, c.n_shared_experts * c.expert_ffn_dim, act)
    return per_token


def _weight_copies(
    c, layer: int, act: int, mode: str, local_experts: int, half_weights: bool = False, half_experts: bool = False
) -> tuple[float, float]:
    """(kept until the layer's backward, held by autocast's cache until the forward ends) in bytes."""
    d = c.d_model
    leaf = 0.0  # nn.Linear weights: autocast casts them through its cache
    own = 0.0  # copies only the op that makes them keeps: KDA's concatenated weights, the routed experts' cast
    own_f32 = 0.0  # the concatenations in fp32 (kept without autocast too)
    conv = 0.0  # KDA's concatenated conv weights: fp32 under autocast too (the conv is elementwise, never cast)
    if _kind(c, layer) == "kda":
        H, K = c.kda_n_heads, c.kda_head_dim
        W = H * K
        projection = 3 * W + K + (W if c.kda_output_gate == "full_rank" else K) + H
        own += d * projection
        conv = 3 * W * c.kda_conv_size
        own_f32 += d * projection + conv
        leaf += K * W + W * d + (K * W if c.kda_output_gate == "low_rank" else 0)  # f_b, o_proj, g_b
        mixer_own = True
    else:
        h, q, v = c.mla_n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        r = c.kv_lora_rank
        query = d * h * q if c.q_lora_rank is None else d * c.q_lora_rank + c.q_lora_rank * h * q
        leaf += query + d * (r + c.qk_rope_head_dim) + r * h * (c.qk_nope_head_dim + v) + h * v * d
        leaf += d * h * v if c.mla_output_gate else 0
        mixer_own = False
    ffn_leaf = 0.0  # the FFN's leaf weights; under selective the shared expert's stay kept, the rest cached only
    shared_leaf = 0.0
    if c.is_moe_layer(layer):
        f, r = c.expert_ffn_dim, c.expert_latent_dim or d
        own_experts = local_experts * 3 * f * r
        ffn_leaf += 2 * d * c.expert_latent_dim if c.expert_latent_dim else 0
        shared_leaf = 3 * d * c.n_shared_experts * f
    else:
        own_experts = 0
        ffn_leaf += 3 * d * c.dense_ffn_dim
    if act == F32:  # no autocast: only the fp32 concatenations, kept where the mixer is not recomputed
        return (own_f32 * F32 if mode == "none" and mixer_own else 0.0), 0.0
    if half_weights:  # gathered in bf16: nothing for autocast to cast (module docstring)
        leaf = ffn_leaf = shared_leaf = 0.0
    if half_experts:
        own_experts = 0
    all_leaf = (leaf + ffn_leaf + shared_leaf) * act
    if mode == "none":
        return all_leaf + (own + own_experts) * act + conv * F32, 0.0
    if mode == "selective":
        return shared_leaf * act, (leaf + ffn_leaf) * act
    return 0.0, all_leaf  # block: everything recomputed, the leaf casts cached until the forward ends
