"""Write a KimiK3 as a Hugging Face directory: config.json, sharded safetensors, the tokenizer's files.

The layout follows the model (hf/config.py): kimi_linear (transformers' KimiLinearForCausalLM loads it) for a model
in Kimi Linear's form, kimi_k3 (the released Kimi K3's names and config) for one with K3's components. Weights are
written in `dtype` (fp32 or bf16), except those both references keep in fp32 whatever the checkpoint's dtype (the
KDA decay parameters and short convolutions, its output norm, the router and its bias: transformers'
`_keep_in_fp32_modules_strict`, Automodel's kimi_k3 state_dict_adapter `_FP32_KEY_PARTS`). Routed experts are
written unquantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from k3train.data.tokenizers import HFTokenizer, Tokenizer
from k3train.hf.config import layout_for, to_hf_config
from k3train.hf.keys import to_hf
from k3train.hf.shards import write_shards
from k3train.models.k3 import KimiK3

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KEEP_FP32 = ("A_log", "dt_bias", "_conv1d.weight", "o_norm.weight", ".gate.weight", "e_score_correction_bias")


def check_exportable(model) -> str:
    """The layout `model` would be written in; ValueError (HFFormatError) naming what no layout can say."""
    if not isinstance(model, KimiK3):
        raise ValueError(f"a {type(model).__name__} has no Hugging Face format: export --format hf writes KimiK3")
    layout = layout_for(model.config)
    to_hf_config(model.config, layout, None, "float32")
    return layout


def write_hf(model: KimiK3, tokenizer: Tokenizer, out: Path, shard_bytes: int, dtype: str = "fp32") -> str:
    """Write `model` to the (existing, empty) directory `out`; returns the layout written."""
    layout = check_exportable(model)
    cfg = model.config
    config = to_hf_config(cfg, layout, tokenizer.eod_id, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    state = model.state_dict()
    tensors = (
        (name, t if name.endswith(KEEP_FP32) or not t.is_floating_point() else t.to(DTYPES[dtype]))
        for name, t in to_hf(state, cfg, layout)
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
    """'5GB', '500MB', '64KB' or a byte count -> bytes (decimal units, as transformers' max_shard_size)."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise ValueError(f"--shard-size {text!r}: give a size such as 5GB, 500MB or a number of bytes")
