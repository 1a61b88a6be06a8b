"""Hydra targets for conf/optim/*.yaml (`_partial_: true`): the Trainer calls `factory(model)`.

Both return ONE torch.optim.Optimizer whose groups carry "name", "kind" and "initial_lr" (= lr); the Trainer's
schedule sets group["lr"] = group["initial_lr"] * factor(step). The partition is checked against the model here,
so a parameter missing from the optimizer (or in two groups) fails at build time, by name. Every numeric setting
is checked here too, naming its key (`optim.lr=nan must be a finite number >= 0`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from k3train.models.layout import expert_group, expert_shards
from k3train.optim.checks import check_adamw_settings, check_muon_settings
from k3train.optim.muon import NS_DTYPES, MuonAdamW
from k3train.optim.param_groups import GROUPS, check_partition, partition_parameters
from k3train.runtime.cpu import native_bf16


def adamw(
    model: nn.Module, *, lr: float, weight_decay: float, betas: Sequence[float], eps: float
) -> torch.optim.Optimizer:
    """The AdamW baseline: groups "decay" and "no_decay", no-decay by the same rules as muon_adamw. Under muP
    (k3train/optim/mup.py) each is split by lr factor, as torch's AdamW takes one lr a group: "decay_x0.25" holds the
    decayed parameters at a quarter of lr, and four times the weight decay, so that the decay a step (lr * wd) is the
    base's, as the mup package's MuAdam does."""
    check_adamw_settings("optim.", lr, weight_decay, betas, eps)
    groups: dict[tuple[str, float], list] = {}
    for a in partition_parameters(model, muon=False):
        groups.setdefault(("decay" if a.weight_decay else "no_decay", a.lr_scale), []).append(a.param)
    param_groups = [
        dict(
            name=name if scale == 1.0 else f"{name}_x{scale:.6g}",
            kind="adamw",
            params=params,
            weight_decay=weight_decay / scale if name == "decay" else 0.0,  # lr * wd a step as at the base
            lr=lr * scale,
            initial_lr=lr * scale,
        )
        for (name, scale), params in sorted(groups.items(), key=lambda item: (item[0][0], -item[0][1]))
    ]
    check_partition(model, param_groups)
    return torch.optim.AdamW(param_groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused_adamw_applies(model))


def fused_adamw_applies(model: nn.Module) -> bool:
    """torch's fused AdamW kernel: one pass over each parameter instead of a dozen elementwise ops. On CPU torch
    does not pick it by default, and the per-op loop it picks is several times slower (why:
    docs/decisions/fused-adamw.md). Plain tensors on CPU or CUDA only: sharded (DTensor) parameters keep torch's
    default."""
    return all(type(p) is nn.Parameter and p.device.type in ("cpu", "cuda") for p in model.parameters())


def muon_adamw(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: Sequence[float],
    eps: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    rms_match: float,
    head_wise: bool,
    orthogonality_check_interval: int,
    ns_dtype: str = "auto",
    process_group: dist.ProcessGroup | None = None,
) -> MuonAdamW:
    """Muon for hidden matrices, AdamW for the rest (see param_groups.py), sharing lr and weight decay
    (Moonlight's RMS matching makes that work); groups in the order of param_groups.GROUPS, empty ones left out."""
    check_adamw_settings("optim.", lr, weight_decay, betas, eps)
    check_muon_settings("optim.", momentum, ns_steps, rms_match, orthogonality_check_interval)
    ns_dtype = resolve_ns_dtype(ns_dtype, next(model.parameters()).device)
    assignments = partition_parameters(model, head_wise=head_wise)
    param_groups = []
    for name, (kind, decay) in GROUPS.items():
        members = [a for a in assignments if a.group == name]
        if not members:
            continue
        group = dict(
            name=name,
            kind=kind,
            params=[a.param for a in members],
            weight_decay=weight_decay if decay else 0.0,
            initial_lr=lr,
        )
        if kind == "muon":
            group["head_splits"] = [a.head_split for a in members]
        if any(a.lr_scale != 1.0 for a in members):  # muP (k3train/optim/mup.py)
            group["lr_scales"] = [a.lr_scale for a in members]
        param_groups.append(group)
    check_partition(model, param_groups)
    return MuonAdamW(
        param_groups,
        lr=lr,
        weight_decay=weight_decay,
        betas=tuple(betas),
        eps=eps,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        rms_match=rms_match,
        orthogonality_check_interval=orthogonality_check_interval,
        ns_dtype=ns_dtype,
        process_group=process_group,
        expert_shards=expert_shards(model),
        expert_group=expert_group(model),
    )


def resolve_ns_dtype(setting: str, device: torch.device) -> str:
    """optim.ns_dtype: auto picks bf16 where the device multiplies bf16 natively (GPUs with bf16, CPUs with
    AVX512-BF16/AMX or Arm BF16) and fp32 elsewhere. Decided from the hardware, not a timing, so every session of a
    run on one machine makes the same choice (a resume stays bitwise)."""
    if setting == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if setting not in NS_DTYPES:
        raise ValueError(f"optim.ns_dtype={setting} must be auto, {' or '.join(NS_DTYPES)}")
    return setting
