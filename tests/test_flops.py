"""FLOPs per token from a model's config (k3train/models/k3/flops.py) against torch.utils.flop_counter."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from k3train.models.k3 import mla
from k3train.models.protocol import CountsFlops

from helpers.config import model_config

pytestmark = pytest.mark.usefixtures("one_thread")
aten = torch.ops.aten


def counted_flops_per_token(model, B: int, T: int) -> dict[str, float]:
    """torch's own count per token of a forward pass ("forward") and of a forward and backward pass ("training").

    It counts matmuls and attention only (KDA's short convolutions are multiply-adds it does not see: under 0.1%
    of the total). Attention runs unpadded on the math backend here: the counter has no formula for torch's fused
    CPU kernel, and the zero columns causal_attention adds for that kernel are not the model's work. The forward
    is counted without autograd: with it, linear_cross_entropy computes the LM head's gradients inside the forward
    call (k3train/models/common/loss.py), backward work that the training count includes either way.
    """
    x, y = (
        torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(s)) for s in (0, 1)
    )
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), mock.patch.object(mla, "causal_attention", unpadded_attention):
        with counter, torch.no_grad():
            model(x, targets=y)
        forward = counter.get_total_flops()
        with counter:
            _, loss = model(x, targets=y)
            loss.backward()
        training = counter.get_total_flops()
    return {"forward": forward / (B * T), "training": training / (B * T)}


def recurrent_outer_products(config) -> dict[str, float]:
    """The per-step recurrence's rank-1 update S += k (beta e)^T, per token: torch's counter sees none of it (an
    einsum it runs as a broadcast product; checked in test_the_counter_misses_the_outer_product), though it is
    K x V multiply-adds per head forward and twice that backward (the gradients of k and of e)."""
    kda_layers = sum(1 for mixer in config.layer_pattern if mixer == "kda")
    forward = 2.0 * config.kda_n_heads * config.kda_head_dim * config.kda_head_dim * kda_layers
    return {"forward": forward, "training": 3.0 * forward}


def test_the_counter_misses_the_outer_product() -> None:
    k, e = torch.randn(2, 4, 16, requires_grad=True), torch.randn(2, 4, 16, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        torch.einsum("bhk,bhv->bhkv", k, e).sum().backward()
    assert counter.get_total_flops() == 0


def unpadded_attention(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


# Kimi K3's components on a tiny model: attention residuals, SiTU-GLU, latent MoE, gated MLA, full-rank KDA gate.
K3_SHAPED = dict(
    attn_res_block_size=2,
    ffn_activation="situ",
    expert_latent_dim=64,
    q_lora_rank=48,
    mla_output_gate=True,
    kda_output_gate="full_rank",
    kda_gate="sigmoid",
)


@pytest.mark.parametrize(
    "name, vocab, B, T, kda, fields",
    [
        ("k3_tiny", 257, 2, 256, "chunk", {}),
        ("k3_tiny", 257, 1, 100, "chunk", {}),  # a tail chunk padded
        ("k3_tiny", 257, 1, 48, "recurrent", {}),
        ("k3_tiny", 257, 2, 256, "chunk", K3_SHAPED),
        pytest.param("k3_small", 4096, 1, 256, "chunk", {}, marks=pytest.mark.slow),  # 6 s: the full run covers it
    ],
    ids=["k3_tiny", "k3_tiny-tail", "k3_tiny-recurrent", "k3_tiny-k3_components", "k3_small"],
)
def test_flops_per_token_matches_torch_flop_counter(name, vocab, B, T, kda, fields):
    torch.manual_seed(0)
    model = instantiate(model_config(name), vocab_size=vocab, kda_implementation=kda, **fields).train()
    assert isinstance(model, CountsFlops)
    formula = model.flops_per_token(T)
    counted = counted_flops_per_token(model, B, T)
    if kda == "recurrent":
        counted = {kind: counted[kind] + flops for kind, flops in recurrent_outer_products(model.config).items()}
    off = {kind: formula[kind] / counted[kind] - 1 for kind in ("forward", "training")}
    # README: "within 2% of torch.utils.flop_counter"
    assert all(abs(x) <= 0.02 for x in off.values()), f"formula/counted - 1: {off}; {formula=}, {counted=}"


def test_only_attention_grows_with_seq_len():
    """MLA's attention term grows linearly in T; everything else per token stays (KDA's chunk work per token is
    the same at any whole number of chunks)."""
    cfg = instantiate(model_config("k3_tiny"), vocab_size=257).config
    from k3train.models.k3.flops import flops_per_token, mla_macs

    short, long = flops_per_token(cfg, 256)["forward"], flops_per_token(cfg, 512)["forward"]
    n_mla = cfg.layer_pattern.count("mla")
    assert long - short == pytest.approx(2 * n_mla * (mla_macs(cfg, 512) - mla_macs(cfg, 256)))
