"""The FLOPs a step does beyond the model's own (k3train/models/k3/flops.py), on the rank the step waits for: what
checkpointing recomputes, what splitting rows over cp ranks adds, and QK-Clip's max-logit matmuls. estimate.py times
them (its docstring says how each is counted); pipeline.py sizes a stage's recompute from the same count.
"""

from __future__ import annotations

from k3train.plan.spec import RunSpec


def context_flops_per_token(spec: RunSpec, cp: int) -> float:
    """Forward FLOPs per token that splitting rows over cp ranks adds on the last rank of a group (module
    docstring); 0 for cp 1."""
    if cp == 1:
        return 0.0
    c = spec.model
    T, T_l = spec.seq_len, spec.seq_len // cp
    H, K, C = c.kda_n_heads, c.kda_head_dim, c.kda_chunk_size
    state = spec.costs.chunk_state_macs
    kda = H * (2 * state(K, K, C, T_l) / T_l - state(K, K, C, T) / T)  # both passes, at T_l
    kda += H * K * K + (cp - 1) * H * K * K * K / T_l  # Q S_in; composing cp - 1 summaries [K, K] x [K, K] a row
    mla = (cp - 1) * c.kv_lora_rank * c.mla_n_heads * (c.qk_nope_head_dim + c.v_head_dim)  # keys before the slice
    return 2.0 * sum(kda if kind == "kda" else mla for kind in spec.held_kinds())


def qk_clip_flops(spec: RunSpec, cp: int, device_type: str) -> float:
    """FLOPs of QK-Clip's max-logit matmuls in one step on the last rank of a cp group (module docstring)."""
    c = spec.model
    if not spec.qk_clip or "mla" not in spec.held_kinds():
        return 0.0
    side = spec.costs.max_logit_tile(c.mla_n_heads, "cpu" if device_type == "cpu" else "cuda")
    pairs = spec.costs.max_logit_pairs(spec.seq_len // cp, spec.seq_len, side)  # a row's, on the last rank
    per_row = 2.0 * c.mla_n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim) * pairs
    return spec.held_kinds().count("mla") * per_row * spec.batch_size * spec.accumulation


def recompute_flops_per_token(spec: RunSpec, cp: int = 1) -> float:
    """Forward FLOPs per token the backward's recompute adds (on the last rank of a cp group)."""
    if spec.checkpointing != "none":  # the recomputed mixers split their rows again
        return _recompute_flops(spec) + context_flops_per_token(spec, cp)
    return 0.0


def _recompute_flops(spec: RunSpec) -> float:
    c = spec.model
    if spec.checkpointing == "block":
        return spec.flops_per_token["forward"]
    if spec.checkpointing == "selective":
        macs = 0.0
        for i in spec.layer_ids:
            mixer = c.layer_pattern[i]
            mixer_macs = spec.costs.kda_macs if mixer == "kda" else spec.costs.mla_macs
            macs += mixer_macs(c, spec.seq_len)
            if c.is_moe_layer(i):
                r = c.expert_latent_dim or c.d_model
                macs += c.experts_per_token * 3 * r * c.expert_ffn_dim + (
                    2 * c.d_model * r if c.expert_latent_dim else 0
                )
            else:
                macs += 3 * c.d_model * c.dense_ffn_dim
        return 2 * macs
    return 0.0
