"""Which parameter is optimised how, and why: an explicit, inspectable partition for Muon + AdamW.

`partition_parameters(model)` walks the model's trainable parameters once and gives each a ParamAssignment
(group, optimizer kind, matrix view, weight decay, reason). The first matching rule wins:

  1. nn.Embedding weights and the LM head      -> adamw_embed (weight decay on, as nanoGPT and Moonlight (arXiv
     2502.16982) decay every matrix): a lookup table's rows are updated independently, so orthogonalising it has
     no meaning.
  2. 1D params, biases, norms, A_log, dt_bias   -> adamw_no_decay: scales and offsets; decaying them towards
     0 changes the function (a norm gain of 0, an infinitely fast KDA decay), not just its size.
  3. conv kernels, KDA gates (f_a/f_b/g_a/g_b/b_proj), MoE router, attention-residual mixing projections
     ([1, d] `*_res_proj`) -> adamw_aux (decay on): small or special-purpose matrices whose rows are not a
     hidden-to-hidden map; Muon's spectral update would distort them (a [1, d] matrix would become its sign).
  4. 3D stacked expert weights [E, out, in]     -> muon_experts, one matrix per expert.
  5. other 2D weights: attention projections (or any weight whose layout has a `head_split`,
     k3train/models/layout.py) -> muon_attention,
     as per-head matrices when annotated and head_wise=True; the rest (dense FFN, shared expert) -> muon_ffn.
Names are matched on whole components of the dotted parameter name ("b_proj" does not match "q_b_proj").
A parameter that fits no rule (4D and up) is an error: add a rule here rather than guessing.
nanoGPT's optimizer groups (every 2D weight decays, embeddings included): https://github.com/karpathy/nanoGPT/blob/3adf61e154c3fe3fca428ad6bc3818b27a3b8291/model.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from k3train.models.layout import parameter_layouts
from k3train.models.protocol import HasParametrizationBase
from k3train.optim import mup
from k3train.optim.muon import HeadSplit, check_head_split

# group -> (optimizer kind, weight decay on)
GROUPS: dict[str, tuple[str, bool]] = {
    "muon_attention": ("muon", True),
    "muon_ffn": ("muon", True),
    "muon_experts": ("muon", True),
    "adamw_embed": ("adamw", True),
    "adamw_aux": ("adamw", True),
    "adamw_no_decay": ("adamw", False),
}
NO_DECAY_NAMES = frozenset({"bias", "A_log", "dt_bias"})
GATE_NAMES = frozenset({"f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj"})
CONV_NAMES = frozenset({"q_conv", "k_conv", "v_conv"})
ROUTER_NAMES = frozenset({"router"})
RESIDUAL_MIX_NAMES = frozenset({"self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj"})
ATTENTION_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"})
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
CONV_TYPES = (nn.Conv1d, nn.Conv2d)


@dataclass(frozen=True)
class ParamAssignment:
    name: str
    shape: tuple[int, ...]
    group: str
    kind: str  # "muon" | "adamw"
    view: str  # "matrix", "heads(4, dim=0)", "experts(8)" for Muon; "elementwise" for AdamW
    weight_decay: bool
    reason: str
    head_split: HeadSplit | None = None  # what the optimizer uses for a "heads" view
    param: nn.Parameter = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    lr_scale: float = 1.0  # this parameter's lr over its group's: 1 but under muP (k3train/optim/mup.py)


def partition_parameters(model: nn.Module, head_wise: bool = True, muon: bool = True) -> list[ParamAssignment]:
    """One ParamAssignment per trainable parameter of `model` (tied weights once, under their first name), each
    with its muP lr factor when the model has a parametrization base (k3train/optim/mup.py): Muon's for the
    hidden matrices, or with muon=False (the AdamW baseline) AdamW's for every parameter."""
    assignments = _partition(model, head_wise)
    bases = _base_assignments(model, head_wise)
    if not bases:
        return assignments
    return [dataclasses.replace(a, lr_scale=mup.lr_scale(a, bases[a.name], muon)) for a in assignments]


def _base_assignments(model: nn.Module, head_wise: bool) -> dict[str, ParamAssignment]:
    """The base's assignment of every parameter of each module in `model` that has a parametrization base (the model,
    or each pipeline stage of the ModuleList a pipelined run optimises), under `model`'s names; empty when none has."""
    bases: dict[str, ParamAssignment] = {}
    holders: list[str] = []
    for prefix, module in model.named_modules():
        inside = any(h == "" or prefix.startswith(f"{h}.") for h in holders)
        if inside or not isinstance(module, HasParametrizationBase):
            continue
        holders.append(prefix)
        base = module.parametrization_base()
        for a in _partition(base, head_wise) if base is not None else ():
            bases[f"{prefix}.{a.name}" if prefix else a.name] = a
    return bases


def _partition(model: nn.Module, head_wise: bool) -> list[ParamAssignment]:
    owners = {name: module for name, module in model.named_modules()}
    head_splits = {name: layout.head_split for name, layout in parameter_layouts(model).items()}
    assignments = []
    for name, p in model.named_parameters():  # deduplicates tied parameters
        if not p.requires_grad:
            continue
        owner = owners[name.rpartition(".")[0]]
        group, view, reason, split = _classify(name, p, owner, head_wise, head_splits.get(name))
        kind, decay = GROUPS[group]
        assignments.append(ParamAssignment(name, tuple(p.shape), group, kind, view, decay, reason, split, p))
    return assignments


def _classify(
    name: str, p: nn.Parameter, owner: nn.Module, head_wise: bool, head_split: HeadSplit | None
) -> tuple[str, str, str, HeadSplit | None]:
    """(group, view, reason, head_split) for one parameter, by the rules in the module docstring."""
    parts = set(name.split("."))
    if isinstance(owner, nn.Embedding):
        return "adamw_embed", "elementwise", "embedding table", None
    if "lm_head" in parts:
        return "adamw_embed", "elementwise", "LM head", None
    if p.ndim <= 1 or parts & NO_DECAY_NAMES or isinstance(owner, NORM_TYPES):
        why = sorted(parts & NO_DECAY_NAMES) or (["norm"] if isinstance(owner, NORM_TYPES) else [f"{p.ndim}D"])
        return "adamw_no_decay", "elementwise", f"{why[0]}: scale/offset, no weight decay", None
    if isinstance(owner, CONV_TYPES) or parts & CONV_NAMES:
        return "adamw_aux", "elementwise", "short conv kernel", None
    if parts & GATE_NAMES:
        return "adamw_aux", "elementwise", f"gate projection ({sorted(parts & GATE_NAMES)[0]})", None
    if parts & ROUTER_NAMES:
        return "adamw_aux", "elementwise", "MoE router", None
    if parts & RESIDUAL_MIX_NAMES:
        return "adamw_aux", "elementwise", "attention-residual mixing projection", None
    if p.ndim == 3:
        return "muon_experts", f"experts({p.shape[0]})", "stacked expert weights, one matrix per expert", None
    if p.ndim == 2:
        split = check_head_split(p.shape, head_split, name)
        group = "muon_attention" if split is not None or parts & ATTENTION_NAMES else "muon_ffn"
        if split is not None and head_wise:
            return group, f"heads({split[0]}, dim={split[1]})", "hidden matrix, per-head views", split
        return group, "matrix", "hidden matrix", None
    raise ValueError(
        f"parameter {name} with shape {tuple(p.shape)} fits no rule in k3train/optim/param_groups.py; "
        "add one there (or give it a 2D/3D layout)"
    )


def check_partition(model: nn.Module, param_groups: Sequence[dict[str, Any]]) -> None:
    """Raise ValueError unless every trainable parameter of `model` is in exactly one group (tied weights once).

    `param_groups` are the optimizer's groups (dicts with "name" and "params"); messages name the parameters.
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    seen: dict[int, str] = {}
    problems = []
    for group in param_groups:
        for p in group["params"]:
            label = names.get(id(p), f"<tensor {tuple(p.shape)} not a trainable parameter of the model>")
            if id(p) in seen:
                problems.append(f"{label} is in both {seen[id(p)]!r} and {group['name']!r}")
            elif id(p) not in names:
                problems.append(f"{label} is in group {group['name']!r}")
            seen.setdefault(id(p), group["name"])
    problems += [f"{n} is in no group" for i, n in names.items() if i not in seen]
    if problems:
        raise ValueError(
            "optimizer partition is not complete and disjoint: "
            + "; ".join(problems)
            + " (see the rules in k3train/optim/param_groups.py)"
        )
