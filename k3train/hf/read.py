"""Read a Hugging Face Kimi Linear or Kimi K3 directory into a KimiK3, shard by shard.

Every check runs before the first tensor is read: config.json must build a k3train model (hf/config.py), the
quantization (if any) must be compressed-tensors' mxfp4-pack-quantized, and the checkpoint's names must be exactly
the model's (the first five unexpected or missing are listed). Then each shard is opened in turn and each tensor
copied into its place, so the peak memory is the model plus the open shard (safetensors maps it; its pages count
while it is open: benchmarks/bench_hf_io.py). Keys outside the
text model (the released K3 is a vision-language model: `vision_tower.*`, `mm_projector.*`) are skipped, and a
line says how many.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3train.hf import HFFormatError
from k3train.hf.config import from_hf_config
from k3train.hf.keys import Slot, a_log_from_hf, canonical, hf_names
from k3train.hf.mxfp4 import MXFP4_FORMAT, decode_mxfp4
from k3train.hf.shards import ShardedSafetensors
from k3train.models.k3 import KimiK3

CONFIG = "config.json"
PACKED, SCALE = ".weight_packed", ".weight_scale"


@dataclass
class HFModel:
    model: KimiK3  # in eval mode, on the device asked for
    layout: str  # kimi_linear | kimi_k3
    config: dict[str, Any]  # config.json as read
    skipped: int  # tensors outside the text model, not read


def is_hf_directory(path: Path) -> bool:
    """A directory whose config.json names a Kimi Linear or Kimi K3 model (a k3train export's names _target_)."""
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in ("kimi_linear", "kimi_k3")


def read_hf(path: str | Path, device: torch.device | str = "cpu", say: Callable[[str], None] = print) -> HFModel:
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise HFFormatError(f"{path / CONFIG}: cannot read it as JSON ({exc})") from None
    layout, fields = from_hf_config(config)
    _check_quantization(config, layout)
    reader = ShardedSafetensors(path)
    with torch.device(device):
        model = KimiK3.from_fields(**fields)
    state = model.state_dict()
    plan = hf_names(model.config, layout, state)
    skipped = _check_names(reader.keys(), plan, layout, model.config.tie_embeddings)
    pending: dict[str, torch.Tensor] = {}  # one half of an MXFP4 pair, until its other half is read
    with torch.no_grad():
        for name, tensor in reader.items():
            if name in skipped:
                continue
            name = canonical(name, plan)
            if name.endswith((PACKED, SCALE)):
                base = name.removesuffix(PACKED).removesuffix(SCALE) + ".weight"
                other = base.removesuffix(".weight") + (SCALE if name.endswith(PACKED) else PACKED)
                if other not in pending:
                    pending[name] = tensor
                    continue
                packed, scale = (tensor, pending.pop(other)) if name.endswith(PACKED) else (pending.pop(other), tensor)
                name, tensor = base, decode_mxfp4(packed, scale, dtype=torch.float32)
            _copy_into(state, plan[name], name, tensor, layout)
    if skipped:
        say(f"skipped {len(skipped)} tensors outside the text model (e.g. {sorted(skipped)[0]})")
    return HFModel(model.eval(), layout, config, len(skipped))


def _check_quantization(config: dict[str, Any], layout: str) -> None:
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


def _check_names(keys: list[str], plan: dict[str, Slot], layout: str, tied: bool) -> set[str]:
    """The keys outside the text model (to skip); HFFormatError for any other key the model lacks or any the
    checkpoint lacks, listing the first five."""
    skipped = {k for k in keys if layout == "kimi_k3" and not k.startswith("language_model.")}
    present, unexpected = set(), []
    for key in keys:
        if key in skipped:
            continue
        key = canonical(key, plan)
        base = key.removesuffix(PACKED).removesuffix(SCALE) + ".weight" if key.endswith((PACKED, SCALE)) else key
        if base in plan:
            present.add(base)
        else:
            unexpected.append(key)
    missing = [k for k in plan if k not in present and not (tied and k.endswith("lm_head.weight"))]
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


def _copy_into(state: dict, slot: Slot, name: str, tensor: torch.Tensor, layout: str) -> None:
    target = state[slot.name] if slot.expert is None else state[slot.name][slot.expert]
    if slot.name.endswith("mixer.A_log"):
        tensor = a_log_from_hf(tensor, target.numel(), layout, name)
    if tuple(tensor.shape) != tuple(target.shape):
        raise HFFormatError(
            f"{name} has shape {list(tensor.shape)}; the model config.json describes needs {list(target.shape)}"
        )
    target.copy_(tensor)
