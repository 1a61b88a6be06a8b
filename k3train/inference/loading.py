"""Open what training or export left behind: a run directory, a checkpoint file or an exported model directory,
or a Hugging Face Kimi Linear / Kimi K3 directory.

A checkpoint carries its model config (meta.model_config) and weights; the run directory around it says which
model class built it (.hydra/config.yaml) and which data and tokenizer it trained on (.hydra/config.yaml and
run.json). An export (k3train/export.py) keeps the same facts in config.json beside model.safetensors. A Hugging
Face directory (k3train/hf/read.py, through the adapter HF_ADAPTERS names for its config.json's model_type) has its
config.json, safetensors shards and, for a BPE tokenizer, tokenizer.json; without one, a 257-entry vocabulary is
k3train's byte tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from k3train.checkpoint.checkpointer import SHARDED_STORE, load_checkpoint
from k3train.checkpoint.latest import newest_checkpoint
from k3train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer
from k3train.hf.adapter import HFAdapter
from k3train.hf.read import hf_model_type, read_hf
from k3train.hf.write import BYTE_TOKENIZER_MARK
from k3train.models.k3.state_dict_adapter import HF_ADAPTER as KIMI_K3_HF
from k3train.models.kda.fla import require_fla
from k3train.observe.run_manifest import read_run_json

EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
# The class of a model whose run directory is gone, by its config's model_type.
MODEL_TARGETS = {
    "kimi_k3": "k3train.models.k3.KimiK3.from_fields",
    "smoke_test_lm": "k3train.models.smoke.SmokeTestLM.from_fields",
    "dense_transformer": "k3train.models.dense.DenseTransformer.from_fields",
}
# The Hugging Face formats k3train reads and writes, by config.json's model_type: the family adapter of each
# (k3train/hf/adapter.py). A family with a Hugging Face format adds its adapter here.
HF_ADAPTERS: dict[str, HFAdapter] = {"kimi_linear": KIMI_K3_HF, "kimi_k3": KIMI_K3_HF}


class SourceError(ValueError):
    """A path that is not a usable run directory, checkpoint or export."""


@dataclass
class Loaded:
    model: nn.Module  # in eval mode
    tokenizer: Tokenizer
    model_target: str  # the Hydra _target_ that builds the model from its config's fields
    data: dict | None  # the data config node it trained on (None if unknown), for evaluate
    seq_len: int | None  # the sequence length it trained at (None if unknown)
    path: Path  # the checkpoint file or the export directory: results are written beside it
    step: int | None  # the training step its weights are from


def load(source: str | Path, device: torch.device | str = "cpu") -> Loaded:
    """A run directory (its last.pt), a checkpoint file, or an export directory -> the model in eval mode."""
    path, device = Path(source).expanduser(), torch.device(device)
    if is_hf_directory(path):
        loaded = _load_hf(path, device)
    elif (path / EXPORT_CONFIG).is_file():
        loaded = _load_export(path, device)
    else:
        loaded = _load_checkpoint(checkpoint_file(path), device)
    loaded.model.to(device).eval()
    return loaded


def is_hf_directory(path: Path) -> bool:
    """A directory whose config.json names a model_type HF_ADAPTERS reads (a k3train export's names _target_)."""
    return hf_model_type(path) in HF_ADAPTERS


def hf_adapter_for(model: nn.Module) -> HFAdapter:
    """The adapter that writes `model` as a Hugging Face directory; ValueError if its family has none."""
    adapters = list(dict.fromkeys(HF_ADAPTERS.values()))
    for adapter in adapters:
        if isinstance(model, adapter.model_class):
            return adapter
    writes = ", ".join(adapter.model_class.__name__ for adapter in adapters)
    raise ValueError(f"a {type(model).__name__} has no Hugging Face format: export --format hf writes {writes}")


def checkpoint_file(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise SourceError(f"{path} does not exist: give a run directory, a checkpoint (.pt) or an export directory")
    if (path / ".metadata").is_file():
        return path  # a sharded (FSDP2) checkpoint: load_checkpoint gathers its shards whole, in this process
    newest = newest_checkpoint(path)  # last.pt, or a sharded run's last.dcp: the newer, as a resume takes
    if newest is not None:
        return newest
    raise SourceError(
        f"{path} holds no last.pt, last.dcp or {EXPORT_CONFIG}: give a run directory, a checkpoint "
        "(.pt or .dcp) or a directory written by python -m k3train.export"
    )


def _load_checkpoint(path: Path, device: torch.device) -> Loaded:
    payload = load_checkpoint(path)  # weights_only; refuses other formats with a message
    fields = dict(payload["meta"]["model_config"])
    run_dir = path.parent.parent if path.parent.name == SHARDED_STORE else path.parent  # dcp/step_N-*: two up
    hydra_config = _read_yaml(run_dir / ".hydra" / "config.yaml")
    target = (hydra_config or {}).get("model", {}).get("_target_") or MODEL_TARGETS.get(fields.get("model_type"))
    if target is None:
        raise SourceError(
            f"{path}: its run directory has no .hydra/config.yaml naming the model class, and "
            f"model_type={fields.get('model_type')!r} is not one of {sorted(MODEL_TARGETS)}"
        )
    model = build_model(target, fields, device)
    model.to(_weights_dtype(t.dtype for t in payload["model"].values()))  # a precision=fp64 run is read as it trained
    model.load_state_dict(payload["model"])
    manifest = read_run_json(run_dir)
    data = (hydra_config or {}).get("data")
    tokenizer_identity = (manifest or {}).get("data", {}).get("tokenizer")
    return Loaded(
        model,
        _run_tokenizer(tokenizer_identity, data, path),
        target,
        data,
        (hydra_config or {}).get("train", {}).get("seq_len"),
        path,
        payload["meta"].get("step"),
    )


def _load_export(path: Path, device: torch.device) -> Loaded:
    from safetensors import safe_open
    from safetensors.torch import load_model

    config = _read_json(path / EXPORT_CONFIG)
    weights = path / EXPORT_WEIGHTS
    if not weights.is_file():
        raise SourceError(f"{path} has {EXPORT_CONFIG} but no {EXPORT_WEIGHTS}: export the run again")
    model = build_model(config["_target_"], config["model"], device)
    with safe_open(weights, framework="pt") as stored:
        model.to(_weights_dtype(stored.get_slice(name).get_dtype() for name in stored.keys()))
    load_model(model, weights)  # strict; a tied lm_head, stored once, is tied again
    tokenizer = config["tokenizer"]
    if tokenizer["name"] == "byte":
        tok: Tokenizer = ByteTokenizer()
    else:
        tok = HFTokenizer(path / EXPORT_TOKENIZER, tokenizer["eod_token"])
        if tok.identity() != tokenizer:
            raise SourceError(f"{path / EXPORT_TOKENIZER} is not the tokenizer {EXPORT_CONFIG} names: export again")
    return Loaded(model, tok, config["_target_"], config.get("data"), config.get("seq_len"), path, config.get("step"))


def _weights_dtype(dtypes) -> torch.dtype:
    """fp64 where the stored weights are (a precision=fp64 run), else fp32: master weights are one or the other.
    dtypes: torch's, or safetensors' names ("F64")."""
    return torch.float64 if any(d in (torch.float64, "F64") for d in dtypes) else torch.float32


def _load_hf(path: Path, device: torch.device) -> Loaded:
    hf = read_hf(HF_ADAPTERS[hf_model_type(path)], path, device)
    config = hf.config.get("text_config", hf.config)
    vocab_size = hf.model.config.vocab_size
    settings = _read_json(path / "tokenizer_config.json") or {}
    if settings.get(BYTE_TOKENIZER_MARK) == "byte" and vocab_size == ByteTokenizer.vocab_size:
        tok: Tokenizer = ByteTokenizer()  # k3train's export of it: the same ids, and the identity its data names
    elif (path / EXPORT_TOKENIZER).is_file():
        eos = config.get("eos_token_id", hf.config.get("eos_token_id"))
        eod_token = settings.get("eos_token")
        if isinstance(eod_token, dict):  # transformers' AddedToken form
            eod_token = eod_token.get("content")
        if eod_token is None and eos is not None:
            from tokenizers import Tokenizer as BPE

            eod_token = BPE.from_file(str(path / EXPORT_TOKENIZER)).id_to_token(eos)
        tok = HFTokenizer(path / EXPORT_TOKENIZER, eod_token)
    elif vocab_size == ByteTokenizer.vocab_size:
        tok = ByteTokenizer()
    else:
        raise SourceError(
            f"{path} has no {EXPORT_TOKENIZER} and a {vocab_size}-entry vocabulary: put the model's tokenizer.json "
            "beside its config.json (a tiktoken tokenizer converts with transformers' AutoTokenizer.save_pretrained)"
        )
    return Loaded(hf.model, tok, MODEL_TARGETS["kimi_k3"], None, None, path, None)


def build_model(target: str, fields: dict, device: torch.device) -> nn.Module:
    """The model the Hydra `target` builds from its config's fields (weights not yet loaded). KDA layers run on
    FLA's kernels where they can (CUDA with flash-linear-attention installed), else on the pure-PyTorch chunk path:
    the weights are the same either way."""
    if fields.get("model_type") == "kimi_k3":
        fields = {**fields, "kda_implementation": "fla" if device.type == "cuda" and _fla_installed() else "chunk"}
    return instantiate({"_target_": target, **fields})


def _fla_installed() -> bool:
    try:
        require_fla()
    except ImportError:
        return False
    return True


def _run_tokenizer(identity: dict | None, data: dict | None, where: Path) -> Tokenizer:
    """The tokenizer the run's data was prepared with; the byte tokenizer needs no files."""
    if identity is not None and identity.get("name") == "byte":
        return ByteTokenizer()
    if data is None:
        raise SourceError(
            f"{where}: no .hydra/config.yaml beside it says which data (and tokenizer) it trained on; "
            "pass the run directory the checkpoint came from"
        )
    tok = instantiate(data).tokenizer()
    if identity is not None and tok.identity() != identity:
        raise SourceError(
            f"{where}: the run's data now has tokenizer {tok.identity()}, but the run trained with {identity}"
        )
    return tok


def _read_yaml(path: Path) -> dict[str, Any] | None:
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else None


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None
