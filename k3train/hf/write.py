"""Write a model as a Hugging Face directory through its family's adapter (hf/adapter.py): config.json, sharded
safetensors, the tokenizer's files.

The adapter picks the layout from the model (Kimi K3's, k3train/models/k3/hf_config.py: kimi_linear, which
transformers' KimiLinearForCausalLM loads, for a model in Kimi Linear's form, kimi_k3, the released Kimi K3's names
and config, for one with K3's components). Weights are written in `dtype` (fp32 or bf16), except those the adapter
keeps in fp32 whatever the checkpoint's dtype (its keep_fp32, as the family's references keep them). Routed experts
are written unquantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from k3train.data.tokenizers import HFTokenizer, Tokenizer
from k3train.hf.adapter import HFAdapter
from k3train.hf.shards import write_shards

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def write_hf(
    adapter: HFAdapter, model: nn.Module, tokenizer: Tokenizer, out: Path, shard_bytes: int, dtype: str = "fp32"
) -> str:
    """Write `model` to the (existing, empty) directory `out`; returns the layout written."""
    layout = adapter.layout(model)
    config = adapter.to_hf_config(model, layout, tokenizer.eod_id, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    keep = adapter.keep_fp32
    tensors = (
        (name, t if name.endswith(keep) or not t.is_floating_point() else t.to(DTYPES[dtype]))
        for name, t in adapter.to_hf(model, layout)
    )
    write_shards(tensors, out, shard_bytes, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(
            json.dumps({"eos_token": tokenizer.eod_token, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2)
            + "\n"
        )
    return layout


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KB' or a byte count -> bytes (decimal units, as transformers' max_shard_size); ValueError
    for anything else, zero included (no shard holds a tensor in no bytes)."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    t = text.strip().upper()
    size = None
    for unit, scale in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            size = int(float(t[: -len(unit)]) * scale)
            break
    if size is None and t.isdigit():
        size = int(t)
    if size is None:
        raise ValueError(f"--shard-size {text!r}: give a size such as 5GB, 500MB or a number of bytes")
    if size <= 0:
        raise ValueError(f"--shard-size {text!r} is no bytes: give a size above zero, such as 5GB or 500MB")
    return size
