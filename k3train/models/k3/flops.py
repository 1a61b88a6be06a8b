"""FLOPs per token of a KimiK3 model, from its config: what MFU divides by.

Counted: every matmul a token takes part in (2 FLOPs per multiply-add), the depthwise convolutions of KDA, KDA's
chunked state work as k3train/models/kda/chunk.py does it (or the per-step recurrence), MLA attention over the
whole sequence, the MoE router and the experts a token actually uses (top-k of the routed ones plus the shared
ones), and the LM head. Not counted: norms, activations (SiTU's included), softmax, routing sorts, the
attention-residual mixes (2 d multiply-adds per source per mix, elementwise) and other elementwise work (a few
percent at these sizes), and QK-Clip's max-logit measurement (the framework's work, not the model's).

Conventions, as PaLM (Chowdhery et al. 2022, arXiv 2204.02311, appendix B) and torchtitan's MFU count them:
- attention is counted over all T x T query-key pairs, causal or not (torch.utils.flop_counter counts it so too);
- training = 3 x forward: the backward pass computes a gradient for each matmul's input and its weight.
torchtitan's count and its MFU, and torch's FLOP counter (tests/test_flops.py checks this count against it):
https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/models/utils.py
https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/components/metrics.py
https://github.com/pytorch/pytorch/blob/cf30153c4c131c8164ee7798e5022d810682e2cb/torch/utils/flop_counter.py
"""

from __future__ import annotations

from k3train.models.k3.config import KimiK3Config


def flops_per_token(config: KimiK3Config, seq_len: int) -> dict[str, float]:
    """{"forward", "training"}: FLOPs per token of a [*, seq_len] batch (training = forward + backward)."""
    c = config
    macs = c.d_model * c.vocab_size  # LM head
    for i, mixer in enumerate(c.layer_pattern):
        macs += kda_macs(c, seq_len) if mixer == "kda" else mla_macs(c, seq_len)
        macs += moe_macs(c) if c.is_moe_layer(i) else 3 * c.d_model * c.dense_ffn_dim
    forward = 2.0 * macs
    return {"forward": forward, "training": 3.0 * forward}


def mla_macs(c: KimiK3Config, seq_len: int) -> float:
    """Per token: the projections (g_proj too when mla_output_gate is on), then q.k over seq_len keys and p.v over
    seq_len values, per head. The gate's sigmoid and product are elementwise: not counted."""
    H, dqk, dv, r, d = c.mla_n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank, c.d_model
    q = d * H * dqk if c.q_lora_rank is None else d * c.q_lora_rank + c.q_lora_rank * H * dqk
    projections = q + d * (r + c.qk_rope_head_dim) + r * H * (c.qk_nope_head_dim + dv) + H * dv * d
    if c.mla_output_gate:
        projections += d * H * dv
    return projections + seq_len * H * (dqk + dv)


def kda_macs(c: KimiK3Config, seq_len: int) -> float:
    """Per token: the projections, the short convolutions, and the recurrence (chunked or per step).

    The output gate's logits: g_a_proj then g_b_proj (d K + K width) for kda_output_gate="low_rank", one g_proj
    (d width) for "full_rank"."""
    d, H, K = c.d_model, c.kda_n_heads, c.kda_head_dim
    width = H * K  # key and value widths (KimiK3 has one value head per key head)
    output_gate = d * width if c.kda_output_gate == "full_rank" else d * K + K * width
    projections = 3 * d * width + d * K + K * width + d * H + output_gate + width * d
    conv = c.kda_conv_size * 3 * width
    if c.kda_implementation == "recurrent":
        state = H * 3 * K * K  # per step: k.S, the rank-1 update, q.S
    else:  # "chunk", and FLA's chunk kernel, which does the same work in Triton
        state = H * chunk_state_macs(K, K, c.kda_chunk_size, seq_len) / seq_len
    return projections + conv + state


def chunk_state_macs(K: int, V: int, C: int, seq_len: int) -> float:
    """Multiply-adds of chunk_kda for one head over one sequence (the tail padded to whole chunks)."""
    per_chunk = 0
    half = 1
    while half < C:  # A_qk and P over the strict lower triangle's pairs, as the doubling levels pair them (the
        # factored diagonal blocks also compute their masked upper halves: work not counted)
        blocks = C // (2 * half)
        per_chunk += blocks * 2 * half * half * K  # the q.k and k.k quadrants
        half *= 2
    per_chunk += C**3 // 6  # (I + A_kk)^-1 of a unit lower-triangular C x C matrix
    per_chunk += C * C * (K + V)  # [w | u] = (I + A_kk)^-1 [k | v]
    per_chunk += 3 * C * K * V  # w S, k_out^T v', and q_in S
    per_chunk += C * C * V  # A_qk v'
    n_chunks = -(-seq_len // C)
    return n_chunks * per_chunk


def moe_macs(c: KimiK3Config) -> float:
    """Per token: the router over every routed expert (at d), then the gated FFN (3 matmuls; SwiGLU or SiTU-GLU
    alike) in the k chosen and the shared ones. A latent MoE (expert_latent_dim = r) runs the routed experts at
    width r and adds its two projections, latent_down d -> r and latent_up r -> d: 2 d r; the shared ones stay at
    d (k3train/models/k3/moe/)."""
    d, f = c.d_model, c.expert_ffn_dim
    routed_width = d if c.expert_latent_dim is None else c.expert_latent_dim
    latent = 0 if c.expert_latent_dim is None else 2 * d * c.expert_latent_dim
    return d * c.n_routed_experts + c.experts_per_token * 3 * routed_width * f + c.n_shared_experts * 3 * d * f + latent
