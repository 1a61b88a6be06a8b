"""Token-by-token generation: prefill the prompt once, then decode one token at a time from the model's cache.

A model with `empty_cache(batch, capacity)` and `forward_cached(tokens, cache)` (KimiK3: a fixed-size KDA state
and an MLA latent cache per layer) decodes incrementally; any other model, or `use_cache=False`, recomputes the
full forward over the whole sequence for every new token (the naive way, kept as the reference and baseline).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class Sampler:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 keeps every token)")

    def __call__(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """logits [B, V] -> the next token ids [B]."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -torch.inf)
        if self.top_p < 1:
            # Keep the most likely tokens until their mass reaches top_p (the one that crosses it included).
            sorted_probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
            drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p  # mass before it already enough
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
            logits = logits.masked_fill(drop, -torch.inf)
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# Prompt positions per prefill forward: an MLA layer's scores for a piece are [B, H, piece, context so far], so a
# 16k-token prompt takes 16 forwards of [B, H, 1024, <=16k] scores rather than one [B, H, 16k, 16k] (4 GB).
PREFILL_CHUNK = 1024


def supports_cache(model: nn.Module) -> bool:
    return hasattr(model, "empty_cache") and hasattr(model, "forward_cached")


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    sampler: Sampler,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[Tensor]:
    """prompt [B, T] token ids -> yields each step's new tokens [B], max_new_tokens times. model in eval mode."""
    if prompt.shape[1] < 1:
        raise ValueError("the prompt is empty: give at least one token")
    if use_cache and supports_cache(model):
        cache = model.empty_cache(prompt.shape[0], prompt.shape[1] + max_new_tokens)
        logits = prefill(model, prompt, cache)
        for i in range(max_new_tokens):
            token = sampler(logits[:, -1], generator)
            yield token
            if i + 1 < max_new_tokens:
                logits = model.forward_cached(token[:, None], cache)
    else:
        tokens = prompt
        for _ in range(max_new_tokens):
            token = sampler(model(tokens)[0][:, -1], generator)
            yield token
            tokens = torch.cat((tokens, token[:, None]), dim=1)


def prefill(model: nn.Module, prompt: Tensor, cache: list) -> Tensor:
    """Feed prompt [B, T] into an empty cache, PREFILL_CHUNK positions per forward; returns the last logits."""
    for start in range(0, prompt.shape[1], PREFILL_CHUNK):
        logits = model.forward_cached(prompt[:, start : start + PREFILL_CHUNK], cache)
    return logits
