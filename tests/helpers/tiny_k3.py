"""A tiny KimiK3 with every kind of part, and a random batch for it (test_k3_model.py, test_kda_gpu.py)."""

import torch

from k3train.models.k3 import KimiK3

V = 61
# A model small enough for a unit test that still has every kind of part: 3 KDA + 1 MLA, a dense first layer,
# 3 MoE layers with a shared expert. 4 experts top-2 over B*T = 128 tokens: ~64 slots per expert per layer, and
# at seed 0 every expert of every layer gets tokens (the gradient test would name any that did not).
TINY = dict(
    vocab_size=V,
    d_model=32,
    n_layers=4,
    kda_mla_ratio="3:1",
    max_seq_len=64,
    mla_n_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    kda_n_heads=2,
    kda_head_dim=16,
    kda_chunk_size=16,
    n_routed_experts=4,
    experts_per_token=2,
    n_shared_experts=1,
    expert_ffn_dim=16,
    first_k_dense=1,
    dense_ffn_dim=48,
)


def tiny_model(seed: int = 0, **overrides) -> KimiK3:
    torch.manual_seed(seed)
    return KimiK3.from_fields(**{**TINY, **overrides})


def batch(B=4, T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    return x, torch.randint(0, V, (B, T), generator=g)


def model_with_every_weight_random(fields: dict, seed: int = 0) -> KimiK3:
    """Norm weights off 1 and router biases off 0: a test that swapped two of them, or dropped one (an export, a
    reader, the remote code), would see it."""
    torch.manual_seed(seed)
    model = KimiK3.from_fields(**fields)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()
