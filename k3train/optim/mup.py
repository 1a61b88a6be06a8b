"""Each parameter's learning-rate factor under muP: the model's shapes against its family's base
(HasParametrizationBase, k3train/models/protocol.py; KimiK3's is k3train/models/k3/mup.py, whose docstring derives
the rules and docs/decisions/mup.md why).

- Muon, per matrix view [A, B] (a head, an expert, or the whole matrix) whose base view is [A0, B0]: Muon's update has
  spectral norm 1 before its scale rms_match * sqrt(max(A, B)) (Moonlight); muP's spectral condition wants it
  proportional to sqrt(fan_out / fan_in), equal to the base's at the base width, so the factor is
  sqrt(max(A0, B0) / max(A, B)) * sqrt((A / A0) / (B / B0)). A square matrix that grows by m gets 1 / sqrt(m); a
  per-head view is scaled as the whole matrix's heads add up (muon_lr_scale): 1 / m for heads at a fixed width.
- AdamW matrices: fan_in0 / fan_in (an AdamW update's entries are about lr at any width, so its spectral norm grows
  with fan_in). The embedding and LM head (the logits carry the model's output multiplier) and vectors: 1.
Yang, Simon & Bernstein, "A Spectral Condition for Feature Learning", arXiv 2310.17813.
"""

from __future__ import annotations

import math

import torch

from k3train.optim.muon import as_matrices


def muon_lr_scale(assignment, base) -> float:
    """Muon's factor for one parameter (module docstring). A matrix, or a stack of experts each applied alone, is
    scaled by its view; heads by the whole matrix, whose spectral norm is about sqrt(H) times a head's: the heads'
    gradients share the layer's input (split by rows) or output (split by columns) directions, so their updates add
    up coherently."""
    view, base_view = view_shape(assignment), view_shape(base)
    undo_moonlight = math.sqrt(max(base_view[-2:]) / max(view[-2:]))
    if assignment.head_split is None:
        (a, b), (a0, b0), heads = view[-2:], base_view[-2:], 1.0
    else:
        (a, b), (a0, b0) = assignment.shape, base.shape
        heads = base.head_split[0] / assignment.head_split[0]
    return undo_moonlight * math.sqrt((a / a0) / (b / b0) * heads)


def adamw_lr_scale(shape: tuple[int, ...], base_shape: tuple[int, ...]) -> float:
    return base_shape[-1] / shape[-1] if len(shape) >= 2 else 1.0


def lr_scale(assignment, base, muon: bool = True) -> float:
    """The factor for one ParamAssignment (k3train/optim/param_groups.py) given its base's of the same name, updated
    by Muon where its kind says so and muon is true, by AdamW otherwise."""
    if muon and assignment.kind == "muon":
        return muon_lr_scale(assignment, base)
    if assignment.group == "adamw_embed":
        return 1.0
    return adamw_lr_scale(assignment.shape, base.shape)


def view_shape(assignment) -> tuple[int, ...]:
    """The shape of the matrices Muon orthogonalises for this parameter ([..., A, B])."""
    return tuple(as_matrices(torch.empty(assignment.shape, device="meta"), assignment.head_split).shape)
