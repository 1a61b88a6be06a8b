"""Models for decoding tests: conf/model/NAME.yaml built with a non-zero router bias, and the logits of a prompt
prefilled then decoded token by token (test_generate.py, test_generate_gpu.py)."""

import torch
from hydra.utils import instantiate

from k3train.models.k3 import KimiK3

from helpers.config import model_config

V = 257


def build(name: str, seed: int = 0, **changes) -> KimiK3:
    """conf/model/NAME.yaml with the byte vocabulary, in eval mode, with a non-zero router bias: decoding must
    steer the experts exactly as the full forward does."""
    torch.manual_seed(seed)
    model = instantiate(model_config(name), vocab_size=V, **changes).eval()
    for moe in model.moe_layers().values():
        moe.expert_bias.normal_(std=0.05)
    return model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def incremental_logits(model: KimiK3, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """The prompt tokens[:, :prefill] in one forward, then the rest one token at a time."""
    cache = model.empty_cache(tokens.shape[0], tokens.shape[1])
    steps = [model.forward_cached(tokens[:, :prefill], cache)]
    steps += [model.forward_cached(tokens[:, t : t + 1], cache) for t in range(prefill, tokens.shape[1])]
    return torch.cat(steps, dim=1)
