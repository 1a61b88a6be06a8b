"""Saved weights as a fill source (k3train/models/common/init.py): each rank reads only the regions of the tensors
it holds, never the whole model (train.init_from).

    weights_by_slice(source, model)   the source for `model` (built on the meta device), after checking that the
                                      saved model is the same architecture; what it reads by slice:
        a Hugging Face directory      safetensors' slices of each tensor (the released K3's MXFP4 experts: the rows
                                      asked for, decoded; a stacked [E, out, in] weight expert by expert)
        an export directory           model.safetensors' slices
        a checkpoint file (.pt)       memory-mapped (torch.load(mmap=True, weights_only=True)): the pages a region
                                      touches are read
        a sharded checkpoint (.dcp)   torch.distributed.checkpoint's reads of the saved chunks a region overlaps
                                      (dcp.load with a planner asking for that region alone, in this process)

A rank's peak is then its shard plus the largest single region being read (an expert's rows decoded from MXFP4 in
fp32; from a .dcp, also the saved chunks it overlaps, each one saving rank's shard, which DCP's reader reads whole).
The values are those a one-process load copies in, bit for bit: the same stored numbers, cast once to the
parameter's dtype by the copy, the MXFP4 decode exact in fp32 (hf/mxfp4.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from k3train.checkpoint.checkpointer import CheckpointError, load_checkpoint
from k3train.checkpoint.dcp import SafeFileSystemReader
from k3train.hf import HFFormatError
from k3train.hf.adapter import HFAdapter
from k3train.hf.mxfp4 import decode_mxfp4
from k3train.hf.read import PACKED, SCALE, check_names, check_quantization, hf_model_type, mxfp4_weight, read_config
from k3train.hf.shards import ShardedSafetensors
from k3train.inference.loading import (
    EXPORT_CONFIG,
    EXPORT_WEIGHTS,
    HF_ADAPTERS,
    MODEL_TARGETS,
    build_model,
    checkpoint_file,
)
from k3train.models.common.init import Region


def weights_by_slice(source: str, model: nn.Module):
    """The weights at `source` as a fill source for `model` (on the meta device); ValueError, naming the first field
    that differs, when they are not the same architecture."""
    path = Path(source).expanduser()
    if hf_model_type(path) in HF_ADAPTERS:
        weights = HFSlices(path, HF_ADAPTERS[hf_model_type(path)])
    elif (path / EXPORT_CONFIG).is_file():
        weights = ExportSlices(path)
    else:
        file = checkpoint_file(path)
        weights = ShardedCheckpointSlices(file) if file.is_dir() else CheckpointSlices(file)
    check_same_architecture(model, weights.model, source)
    return weights


def check_same_architecture(model: nn.Module, saved: nn.Module, source: str) -> None:
    mine, theirs = (getattr(m.config, "architecture", None) for m in (model, saved))
    if mine is None or theirs is None:
        raise ValueError(f"train.init_from={source}: only KimiK3 models start from other weights")
    mine, theirs = mine(), theirs()
    for field in sorted(set(mine) | set(theirs)):
        if mine.get(field) != theirs.get(field):
            raise ValueError(
                f"train.init_from={source}: its model has {field}={theirs.get(field)!r}, this run's "
                f"{mine.get(field)!r}; pick the model config it was trained with (model=... or model.{field}=...)"
            )


def _check_shape(name: str, stored: list[int], shape: tuple[int, ...], where: Path) -> None:
    if tuple(stored) != tuple(shape):
        raise HFFormatError(f"{where}: {name} has shape {list(stored)}; this run's model needs {list(shape)}")


class HFSlices:
    """A Hugging Face directory, read region by region (module docstring). `model`: the saved model built on the meta
    device from its config.json."""

    def __init__(self, path: Path, adapter: HFAdapter) -> None:
        config = read_config(path)
        self.path, self.adapter = path, adapter
        self.layout, fields = adapter.from_hf_config(config)
        check_quantization(config, self.layout)
        with torch.device("meta"):
            self.model = adapter.build(fields)
        self.reader = ShardedSafetensors(path)
        plan = adapter.hf_names(self.model, self.layout)
        skipped = check_names(self.reader.keys(), plan, adapter, self.model, self.layout)
        self.slots = {}  # (model name, expert or None) -> (its Slot, {"plain" | "packed" | "scale": file key})
        for key in self.reader.keys():
            if key in skipped:
                continue
            name = adapter.canonical(key, plan)
            part = "packed" if name.endswith(PACKED) else "scale" if name.endswith(SCALE) else "plain"
            base = mxfp4_weight(name) if part != "plain" else name
            slot = plan[base]
            self.slots.setdefault((slot.name, slot.expert), (slot, base, {}))[2][part] = key

    def __call__(self, name: str, shape: tuple[int, ...], region: Region) -> torch.Tensor:
        if (name, None) in self.slots:
            return self._read(name, None, shape, region)
        experts = range(region[0].start, region[0].stop)  # a stacked [E, ...] weight: one stored tensor an expert
        parts = [self._read(name, e, shape[1:], region[1:]) for e in experts]
        return torch.stack(parts) if parts else torch.empty([0, *(s.stop - s.start for s in region[1:])])

    def _read(self, name: str, expert: int | None, shape: tuple[int, ...], region: Region) -> torch.Tensor:
        slot, hf_name, keys = self.slots[(name, expert)]
        if "packed" in keys:  # MXFP4 [out, in]: the rows asked for, decoded, then their columns
            rows = region[0]
            packed, scale = (self._slice(keys[k], (rows,)) for k in ("packed", "scale"))
            return decode_mxfp4(packed, scale, dtype=torch.float32)[(slice(None), *region[1:])]
        key = keys["plain"]
        with self.reader.open_for(key) as f:
            stored = f.get_slice(key)
            if tuple(stored.get_shape()) != tuple(shape):  # transformed on the way in (the released A_log): whole
                target = torch.empty(shape, device="meta")
                whole = self.adapter.from_hf(slot, hf_name, f.get_tensor(key), target, self.layout)
                _check_shape(hf_name, list(whole.shape), shape, self.path)
                return whole[region]
            return stored[region]

    def _slice(self, key: str, region: Region) -> torch.Tensor:
        with self.reader.open_for(key) as f:
            return f.get_slice(key)[region]


class ExportSlices:
    """A k3train export (config.json and model.safetensors), read region by region."""

    def __init__(self, path: Path) -> None:
        config = json.loads((path / EXPORT_CONFIG).read_text())
        self.file = path / EXPORT_WEIGHTS
        if not self.file.is_file():
            raise CheckpointError(f"{path} has {EXPORT_CONFIG} but no {EXPORT_WEIGHTS}: export the run again")
        with torch.device("meta"):
            self.model = build_model(config["_target_"], config["model"], torch.device("meta"))

    def __call__(self, name: str, shape: tuple[int, ...], region: Region) -> torch.Tensor:
        with safe_open(self.file, framework="pt") as f:
            stored = f.get_slice(name)
            _check_shape(name, stored.get_shape(), shape, self.file)
            return stored[region]


def _saved_model(file: Path, meta: dict) -> nn.Module:
    """The model a checkpoint's meta describes, on the meta device."""
    fields = dict(meta["model_config"])
    target = MODEL_TARGETS.get(fields.get("model_type"))
    if target is None:
        raise CheckpointError(f"{file}: model_type={fields.get('model_type')!r} is not one of {sorted(MODEL_TARGETS)}")
    with torch.device("meta"):
        return build_model(target, fields, torch.device("meta"))


class CheckpointSlices:
    """A k3train checkpoint file, memory-mapped: a region reads the pages it touches."""

    def __init__(self, file: Path) -> None:
        self.file = file
        payload = load_checkpoint(file, mmap=True)
        self.state = payload["model"]
        self.model = _saved_model(file, payload["meta"])

    def __call__(self, name: str, shape: tuple[int, ...], region: Region) -> torch.Tensor:
        stored = self.state[name]
        _check_shape(name, list(stored.shape), shape, self.file)
        return stored[region]


class ShardedCheckpointSlices:
    """A k3train sharded checkpoint (a .dcp directory, checkpoint/dcp.py): the model's sharded tensors read region by
    region through torch.distributed.checkpoint, which reads the saved chunks a region overlaps (whichever ranks and
    layout wrote them) and copies their overlap in; the tensors rank 0 kept whole in extra.pt sliced from there."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        payload = load_checkpoint(directory, keep=lambda key: False)  # checked; a sharded tensor is None, unread
        self.state = payload["model"]
        self.model = _saved_model(directory, payload["meta"])
        self.reader = SafeFileSystemReader(directory)
        self.metadata = self.reader.read_metadata()  # each sharded tensor's key, shape and dtype
        self.reader.read_metadata = lambda *args, **kwargs: self.metadata  # read once, not once a region

    def __call__(self, name: str, shape: tuple[int, ...], region: Region) -> torch.Tensor:
        stored = self.state[name]
        if stored is not None:
            _check_shape(name, list(stored.shape), shape, self.directory)
            return stored[region]
        key = f"model/{name}"  # checkpoint/dcp.py's split_shards: the tree's path
        saved = self.metadata.state_dict_metadata[key]
        _check_shape(name, list(saved.size), shape, self.directory)
        out = torch.empty([s.stop - s.start for s in region], dtype=saved.properties.dtype)
        if out.numel() == 0:  # a rank holding no rows of a short tensor: nothing to read
            return out
        planner = _RegionPlanner(key, [s.start for s in region], out)
        dcp.load({key: out}, storage_reader=self.reader, planner=planner, no_dist=True)
        return out


class _RegionPlanner(DefaultLoadPlanner):
    """DCP's load planner asking for one region of one saved tensor (`out`, at `offsets` in it), as it would for a
    DTensor's local shard there."""

    def __init__(self, key: str, offsets: list[int], out: torch.Tensor) -> None:
        super().__init__()
        self.key, self.offsets, self.out = key, offsets, out

    def create_local_plan(self) -> LoadPlan:
        wanted = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.out.shape)
        md = self.metadata.state_dict_metadata[self.key]
        return LoadPlan(create_read_items_for_chunk_list(self.key, md, [wanted]))

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.out
