"""model.parametrization=mup: the init, forward multipliers and per-tensor learning rates under which a family's best
lr stays where it was found at its base width and depth (why each choice: docs/decisions/mup.md).

A family is one KimiK3 shape at several widths and depths: d_model and the WIDTH_FIELDS (heads at a fixed head
width, latent ranks, FFN and expert widths) scaled together. Which dims of a tensor grow with width is read off the
base model (KimiK3Config.mup_base: the same config at d_model = mup_base_width), as the `mup` package's base shapes
are. Each rule below is relative to the base: at the base width and depth mup is the standard parametrization.

Width, in the spectral form of muP (Yang, Simon & Bernstein, "A Spectral Condition for Feature Learning", arXiv
2310.17813; Tensor Programs V, arXiv 2203.03466): a hidden matrix's init and its update each move its output by
O(1) per coordinate at every width, which asks of a [fan_out, fan_in] matrix
- init std proportional to 1/sqrt(fan_in) * min(1, sqrt(fan_out / fan_in)) (init_scale);
- an update of spectral norm proportional to sqrt(fan_out / fan_in). Muon's orthogonalised update has spectral norm
  1, so Muon's per-view scale becomes rms_match * sqrt(max(A0, B0)) * sqrt((A / A0) / (B / B0)) for a view of shape
  [A, B] whose base is [A0, B0] (heads: as their whole matrix), in place of Moonlight's rms_match * sqrt(max(A, B)).
  AdamW's update has entries of about lr whatever the width, so its matrices take lr * fan_in0 / fan_in. Both are
  the optimizer's (k3train/optim/mup.py), which reads the base through parametrization_base();
- the embedding and vectors (norm gains, biases, A_log, dt_bias) keep their lr and init; the LM head keeps both and
  the logits are multiplied by mup_base_width / d_model (output_multiplier), as the `mup` package's MuReadout.
Depth, as CompleteP (Dey et al., "Don't be lazy: CompleteP enables compute-efficient deep transformers", arXiv
2505.01618) with alpha = 1: each residual branch is multiplied by mup_base_depth / n_layers (branch_multiplier) and
the residual projections' init is set at the base depth; learning rates do not change with depth. With attention
residuals the stream is a softmax mix over depth, already an average, so no branch multiplier (the decision record).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3train.models.k3.config import KimiK3Config


def base_model(model_class: type[nn.Module], config: KimiK3Config) -> nn.Module | None:
    """The family's base (a `model_class` of config.mup_base()) on the meta device, nothing allocated; None under
    standard."""
    if config.parametrization != "mup":
        return None
    with torch.device("meta"):
        return model_class(config.mup_base())


def init_scale(shape: tuple[int, ...], base: tuple[int, ...]) -> float:
    """A matrix's init std over its base's: the spectral condition's 1/sqrt(fan_in) * min(1, sqrt(fan_out/fan_in))
    at `shape` over the same at `base` (both [..., fan_out, fan_in]); 1 for vectors."""
    if len(shape) < 2:
        return 1.0
    (a, b), (a0, b0) = shape[-2:], base[-2:]
    return math.sqrt(b0 / b) * min(1.0, math.sqrt(a / b)) / min(1.0, math.sqrt(a0 / b0))


def output_multiplier(config: KimiK3Config) -> float:
    """The logits' multiplier: mup_base_width / d_model under mup, 1 under standard."""
    return config.mup_base_width / config.d_model if config.parametrization == "mup" else 1.0


def branch_multiplier(config: KimiK3Config) -> float:
    """Each residual branch's multiplier: mup_base_depth / n_layers under mup without attention residuals, else 1."""
    if config.parametrization != "mup" or config.attn_res_block_size is not None:
        return 1.0
    return config.mup_base_depth / config.n_layers


def residual_init_depth(config: KimiK3Config) -> int:
    """The depth the residual projections' init std / sqrt(2 L) takes: the base depth under mup (the branch
    multiplier, or the attention residuals' mix, accounts for depth), the model's own under standard."""
    return config.mup_base_depth if config.parametrization == "mup" else config.n_layers
