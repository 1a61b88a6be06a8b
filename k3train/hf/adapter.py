"""The one seam between the Hugging Face drivers (read.py, write.py) and a model family: an HFAdapter.

The drivers know the format (config.json, sharded safetensors, MXFP4 experts, the tokenizer's files); a family knows
its model (which config.json fields build it, what its tensors are called on the Hub, which stay in fp32). Each
driver is handed the family's adapter and calls nothing of the family but these members, so a second family is a new
adapter (k3train/models/<family>/state_dict_adapter.py, as Kimi K3's) and a line in the table that picks it
(k3train/inference/loading.py's HF_ADAPTERS, by config.json's model_type), with nothing here changed. The layout
names which of a family's Hugging Face forms a checkpoint is in (Kimi K3: kimi_linear or kimi_k3).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """Where a Hugging Face tensor lives in the model: the parameter (or buffer) `name`, its slice `expert` along
    dim 0 of a stacked expert weight (None: the whole tensor)."""

    name: str
    expert: int | None = None


class HFAdapter(Protocol):
    model_types: tuple[str, ...]  # the config.json model_type values it reads
    model_class: type[nn.Module]  # the model it builds and writes
    keep_fp32: tuple[str, ...]  # endings of the Hugging Face names written in fp32 whatever the export's dtype

    # --- writing -----------------------------------------------------------------------------------------------------
    def layout(self, model: nn.Module) -> str:
        """The layout `model` is written in; HFFormatError naming what no layout can say (before anything is
        written)."""
        ...

    def to_hf_config(self, model: nn.Module, layout: str, eos_token_id: int | None, dtype: str) -> dict[str, Any]:
        """config.json for `model` in `layout`, its torch_dtype `dtype` (float32 | bfloat16)."""
        ...

    def to_hf(self, model: nn.Module, layout: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every tensor of the model, in the layout's shapes."""
        ...

    def remote_code(self, layout: str) -> tuple[Path, ...]:
        """Source files written beside the weights for transformers' trust_remote_code (config.json's auto_map
        names them); none for a layout transformers builds itself."""
        ...

    # --- reading -----------------------------------------------------------------------------------------------------
    def from_hf_config(self, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """config.json -> (layout, the fields `build` takes); HFFormatError naming what cannot be built."""
        ...

    def build(self, fields: dict[str, Any]) -> nn.Module:
        """The model from_hf_config's fields describe, on the current default device (meta to size it)."""
        ...

    def hf_names(self, model: nn.Module, layout: str) -> dict[str, Slot]:
        """Every Hugging Face name of the model's tensors in `layout` -> where it lives."""
        ...

    def canonical(self, name: str, plan: dict[str, Slot]) -> str:
        """A checkpoint's name as hf_names spells it (another writer's spelling of the same tensor mapped back)."""
        ...

    def outside_model(self, name: str, layout: str) -> bool:
        """A checkpoint tensor the model does not hold and the read skips (a vision tower beside a text model)."""
        ...

    def may_be_absent(self, name: str, model: nn.Module) -> bool:
        """A tensor of hf_names the checkpoint may leave out (one the model ties to another)."""
        ...

    def from_hf(self, slot: Slot, name: str, tensor: torch.Tensor, target: torch.Tensor, layout: str) -> torch.Tensor:
        """The checkpoint's `tensor` (Hugging Face `name`) in the form `target`, its slot, holds; HFFormatError if it
        is not the layout's. The driver then checks the shape and copies it."""
        ...
