"""FLOPs per token from a model's config (k3train/models/k3/flops.py) against torch.utils.flop_counter."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from config_helpers import model_config
from hydra.utils import instantiate
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from k3train.models.k3 import mla
from k3train.models.protocol import CountsFlops

pytestmark = pytest.mark.usefixtures("one_thread")
aten = torch.ops.aten


def counted_flops_per_token(model, B: int, T: int) -> dict[str, float]:
    """torch's own count of one forward and one backward pass, per token.

    It counts matmuls and attention only (KDA's short convolutions are multiply-adds it does not see: under 0.1%
    of the total). Attention runs unpadded on the math backend here: the counter has no formula for torch's fused
    CPU kernel, and the zero columns causal_attention adds for that kernel are not the model's work.
    """
    x, y = (
        torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(s)) for s in (0, 1)
    )
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), mock.patch.object(mla, "causal_attention", unpadded_attention):
        with counter:
            _, loss = model(x, targets=y)
        forward = counter.get_total_flops()
        with counter:
            loss.backward()
    return {"forward": forward / (B * T), "training": (forward + counter.get_total_flops()) / (B * T)}


def unpadded_attention(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


@pytest.mark.parametrize(
    "name, vocab, B, T, kda",
    [
        ("k3_tiny", 257, 2, 256, "chunk"),
        ("k3_tiny", 257, 1, 100, "chunk"),  # a tail chunk padded
        ("k3_tiny", 257, 1, 48, "recurrent"),
        ("k3_small", 4096, 1, 256, "chunk"),
    ],
)
def test_flops_per_token_matches_torch_flop_counter(name, vocab, B, T, kda):
    torch.manual_seed(0)
    model = instantiate(model_config(name), vocab_size=vocab, kda_implementation=kda).train()
    assert isinstance(model, CountsFlops)
    formula = model.flops_per_token(T)
    counted = counted_flops_per_token(model, B, T)
    for kind in ("forward", "training"):
        assert formula[kind] == pytest.approx(counted[kind], rel=0.10), (kind, formula, counted)


def test_only_attention_grows_with_seq_len():
    """MLA's attention term grows linearly in T; everything else per token stays (KDA's chunk work per token is
    the same at any whole number of chunks)."""
    cfg = instantiate(model_config("k3_tiny"), vocab_size=257).config
    from k3train.models.k3.flops import flops_per_token, mla_macs

    short, long = flops_per_token(cfg, 256)["forward"], flops_per_token(cfg, 512)["forward"]
    n_mla = cfg.layer_pattern.count("mla")
    assert long - short == pytest.approx(2 * n_mla * (mla_macs(cfg, 512) - mla_macs(cfg, 256)))
