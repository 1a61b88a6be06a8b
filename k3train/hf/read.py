"""Read a Hugging Face directory into the model its family's adapter (hf/adapter.py) builds, shard by shard.

Every check runs before the first tensor is read: config.json must build a k3train model (the adapter's
from_hf_config; Kimi K3's: k3train/models/k3/hf_config.py) that fits in the memory of the device it is built on
(sized on the meta device first, so an absurd config.json is refused, not allocated), the quantization (if any)
must be compressed-tensors' mxfp4-pack-quantized, and the checkpoint's names must be exactly the model's (the first
five unexpected or missing are listed). Then each shard is opened in turn and each tensor copied into its place,
so the peak memory is the model plus the open shard (safetensors maps it; its pages count while it is open:
benchmarks/bench_hf_io.py). Keys outside the model (the released K3 is a vision-language model: `vision_tower.*`,
`mm_projector.*`) are skipped, and a line says how many.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k3train.hf import HFFormatError
from k3train.hf.adapter import HFAdapter, Slot
from k3train.hf.mxfp4 import MXFP4_FORMAT, decode_mxfp4
from k3train.hf.shards import ShardedSafetensors

CONFIG = "config.json"
PACKED, SCALE = ".weight_packed", ".weight_scale"


@dataclass
class HFModel:
    model: nn.Module  # in eval mode, on the device asked for
    layout: str  # the adapter's name for the form it was in (Kimi K3: kimi_linear | kimi_k3)
    config: dict[str, Any]  # config.json as read
    skipped: int  # tensors outside the text model, not read


def hf_model_type(path: Path) -> str | None:
    """The model_type config.json in `path` names (None: no config.json object there); a k3train export's config.json
    names none (its _target_ says the class)."""
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def read_hf(
    adapter: HFAdapter, path: str | Path, device: torch.device | str = "cpu", say: Callable[[str], None] = print
) -> HFModel:
    path = Path(path)
    config = read_config(path)
    layout, fields = adapter.from_hf_config(config)
    check_quantization(config, layout)
    _check_fits(adapter, fields, torch.device(device))
    reader = ShardedSafetensors(path)
    with torch.device(device):
        model = adapter.build(fields)
    state = model.state_dict()
    plan = adapter.hf_names(model, layout)
    skipped = check_names(reader.keys(), plan, adapter, model, layout)
    pending: dict[str, torch.Tensor] = {}  # one half of an MXFP4 pair, until its other half is read
    with torch.no_grad():
        for name, tensor in reader.items():
            if name in skipped:
                continue
            name = adapter.canonical(name, plan)
            if name.endswith((PACKED, SCALE)):
                base = mxfp4_weight(name)
                other = base.removesuffix(".weight") + (SCALE if name.endswith(PACKED) else PACKED)
                if other not in pending:
                    pending[name] = tensor
                    continue
                packed, scale = (tensor, pending.pop(other)) if name.endswith(PACKED) else (pending.pop(other), tensor)
                name, tensor = base, decode_mxfp4(packed, scale, dtype=torch.float32)
            _copy_into(state, plan[name], name, tensor, adapter, layout)
    if skipped:
        say(f"skipped {len(skipped)} tensors outside the text model (e.g. {sorted(skipped)[0]})")
    return HFModel(model.eval(), layout, config, len(skipped))


def read_config(path: Path) -> dict[str, Any]:
    """config.json of the Hugging Face directory `path`; HFFormatError when it cannot be read as JSON."""
    try:
        return json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise HFFormatError(f"{path / CONFIG}: cannot read it as JSON ({exc})") from None


def mxfp4_weight(name: str) -> str:
    """The weight an MXFP4 half (`<base>.weight_packed` or `<base>.weight_scale`) decodes to: `<base>.weight`."""
    return name.removesuffix(PACKED).removesuffix(SCALE) + ".weight"


def _check_fits(adapter: HFAdapter, fields: dict[str, Any], device: torch.device) -> None:
    """HFFormatError if the model config.json describes would not fit in the memory of `device` (the model alone;
    the open shard comes on top): built on the meta device, which allocates nothing, and its tensors counted."""
    memory = _memory_bytes(device)
    if memory is None:
        return
    with torch.device("meta"):
        sized = adapter.build(fields)
    parameters = sum(p.numel() for p in sized.parameters())
    needed = sum(t.numel() * t.element_size() for t in (*sized.parameters(), *sized.buffers()))
    if needed > memory:
        where = "this machine" if device.type == "cpu" else str(device)
        raise HFFormatError(
            f"config.json describes a model of {parameters:,} parameters, {needed / 2**30:,.1f} GiB, and "
            f"{where} has {memory / 2**30:,.1f} GiB of memory: check its sizes (vocab_size, hidden_size, the "
            "number of layers and experts)"
        )


def _memory_bytes(device: torch.device) -> int | None:
    """The memory of `device`: a GPU's own, else the machine's physical memory; None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return None


def check_quantization(config: dict[str, Any], layout: str) -> None:
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method")
    formats = {quant.get("format")} | {g.get("format") for g in (quant.get("config_groups") or {}).values()}
    formats.discard(None)
    if method != "compressed-tensors" or not formats <= {MXFP4_FORMAT}:
        raise HFFormatError(
            f"quantization {method!r} with format(s) {sorted(formats)}: k3train reads unquantized weights and "
            f"compressed-tensors' {MXFP4_FORMAT} experts"
        )


def check_names(keys: list[str], plan: dict[str, Slot], adapter: HFAdapter, model: nn.Module, layout: str) -> set[str]:
    """The keys outside the model (to skip); HFFormatError for any other key the model lacks or any the checkpoint
    lacks, listing the first five."""
    skipped = {k for k in keys if adapter.outside_model(k, layout)}
    present, unexpected = set(), []
    for key in keys:
        if key in skipped:
            continue
        key = adapter.canonical(key, plan)
        base = mxfp4_weight(key) if key.endswith((PACKED, SCALE)) else key
        if base in plan:
            present.add(base)
        else:
            unexpected.append(key)
    missing = [k for k in plan if k not in present and not adapter.may_be_absent(k, model)]
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (the first five: {', '.join(sorted(unexpected)[:5])})")
    if missing:
        problems.append(f"{len(missing)} missing (the first five: {', '.join(missing[:5])})")
    if problems:
        raise HFFormatError(
            "the checkpoint's tensors are not the model's that config.json describes: " + "; ".join(problems)
        )
    for key in keys:  # an MXFP4 weight needs both halves
        if key.endswith(PACKED) and key.removesuffix(PACKED) + SCALE not in keys:
            raise HFFormatError(f"{key} has no {key.removesuffix(PACKED) + SCALE} beside it")
    return skipped


def _copy_into(state: dict, slot: Slot, name: str, tensor: torch.Tensor, adapter: HFAdapter, layout: str) -> None:
    target = state[slot.name] if slot.expert is None else state[slot.name][slot.expert]
    tensor = adapter.from_hf(slot, name, tensor, target, layout)
    if tuple(tensor.shape) != tuple(target.shape):
        raise HFFormatError(
            f"{name} has shape {list(tensor.shape)}; the model config.json describes needs {list(target.shape)}"
        )
    target.copy_(tensor)
