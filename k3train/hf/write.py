"""Write a model as a Hugging Face directory through its family's adapter (hf/adapter.py): config.json, sharded
safetensors, the tokenizer's files, and for a layout transformers does not know the adapter's code for
`trust_remote_code=True` (its remote_code files, which config.json's auto_map names).

The adapter picks the layout from the model (Kimi K3's, k3train/models/k3/hf_config.py: kimi_linear, which
transformers' KimiLinearForCausalLM loads, for a model in Kimi Linear's form, kimi_k3, the released Kimi K3's names
and config, for one with K3's components). Weights are written in `dtype` (fp32 or bf16), except those the adapter
keeps in fp32 whatever the checkpoint's dtype (its keep_fp32, as the family's references keep them). Routed experts
are written unquantized.

The tokenizer travels so that transformers' AutoTokenizer loads it from the directory: a BPE tokenizer's own
tokenizer.json, or for k3train's byte tokenizer (ids 0..255 the UTF-8 bytes, 256 end of document) a byte-level
tokenizer.json built here with the `tokenizers` library, whose ids are ByteTokenizer.encode's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from k3train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer
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
    for source in adapter.remote_code(layout):
        shutil.copyfile(source, out / source.name)
    write_tokenizer(tokenizer, out)
    return layout


# In tokenizer_config.json of an export whose tokenizer.json is byte_level_tokenizer's.
BYTE_TOKENIZER_MARK = "k3train_tokenizer"


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json, what AutoTokenizer.from_pretrained(out)
    reads: a BPE tokenizer's own file, or the byte tokenizer's as byte_level_tokenizer builds it; the end-of-document
    token is eos_token."""
    if isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        eos_token = tokenizer.eod_token
    elif isinstance(tokenizer, ByteTokenizer):
        byte_level_tokenizer(tokenizer).save(str(out / "tokenizer.json"))
        eos_token = tokenizer.eod_text
    else:
        raise TypeError(f"no Hugging Face tokenizer files for {tokenizer!r}")
    settings = {"eos_token": eos_token, "tokenizer_class": "PreTrainedTokenizerFast"}
    if isinstance(tokenizer, ByteTokenizer):  # read back as k3train's byte tokenizer (inference/loading.py), whose
        settings[BYTE_TOKENIZER_MARK] = "byte"  # identity a run's data names, not as a BPE file of the same ids
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos_token}, indent=2) + "\n")


def byte_level_tokenizer(tokenizer: ByteTokenizer):
    """A `tokenizers` Tokenizer with ByteTokenizer's ids: byte b is id b, spelt as byte-level BPE spells bytes (a
    printable character per byte, byte_level_alphabet), with no merges, so every byte stays its own token; the
    end-of-document token is the special token eod_text at eod_id. Decoding joins the bytes and reads them as UTF-8,
    as ByteTokenizer.decode does."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HF

    vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
    hf = HF(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(tokenizer.eod_text, special=True)])
    if hf.token_to_id(tokenizer.eod_text) != tokenizer.eod_id:
        raise AssertionError(f"{tokenizer.eod_text} is id {hf.token_to_id(tokenizer.eod_text)}, not {tokenizer.eod_id}")
    return hf


def byte_level_alphabet() -> list[str]:
    """The character byte-level BPE writes for each byte 0..255: the byte's own Latin-1 character where that is
    printable and not a space, otherwise the next unused character from U+0100 on, in byte order (the mapping
    `tokenizers`' ByteLevel pre-tokenizer and decoder use)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


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
