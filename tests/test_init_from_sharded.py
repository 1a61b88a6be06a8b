"""train.init_from read by slice (k3train/inference/slices.py): a release-shaped Kimi K3 directory (bf16, MXFP4
routed experts, sharded safetensors) read into FSDP2 x ep 2 on 2 gloo ranks, each rank reading only the regions it
holds, equals the one-process load (hf/read.py) bit for bit; the same from a k3train checkpoint file, and from a
sharded checkpoint (.dcp) written by FSDP2 on 2 ranks and read into FSDP2 x ep 2."""

import functools
from pathlib import Path

import pytest
import torch
from test_hf import K3, write_release

from k3train.hf.read import read_hf
from k3train.models.k3 import KimiK3
from k3train.models.k3.state_dict_adapter import HF_ADAPTER

from helpers.spawn import spawn_ranks
from helpers.tiny_k3 import model_with_every_weight_random

pytestmark = pytest.mark.usefixtures("one_thread")


def _read_by_slice(source: str, layout: str, rank: int, world: int) -> dict:
    """On each rank: the run's model on the meta device, FSDP2 (x ep 2) over the 2 ranks, filled from `source` by
    slice; its local parts, where they sit, and the largest and total values the source handed it."""
    from k3train.inference.slices import weights_by_slice
    from k3train.models.common.init import materialise, where_held
    from k3train.models.common.parallelize import FullyShard
    from k3train.models.layout import parameter_layouts
    from k3train.runtime.parallel_dims import ParallelDims

    with torch.device("meta"):
        model = KimiK3.from_fields(**K3)
    ep = 2 if layout == "fsdp_ep" else 1
    model.parallelize(ParallelDims.for_strategy("fsdp", world, rank, "cpu", ep, 1, 1, 1), FullyShard())
    source_fn = weights_by_slice(source, model)
    handed = []

    def counted(name, shape, region):
        t = source_fn(name, shape, region)
        handed.append(t.numel())
        return t

    materialise(model, torch.device("cpu"), counted)
    layouts = parameter_layouts(model)
    parts = {}
    for name, p in model.named_parameters():
        _, region, local = where_held(name, p, layouts)
        parts[name] = ([(s.start, s.stop) for s in region], local.clone())
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return {"parts": parts, "buffers": buffers, "largest": max(handed), "total": sum(handed)}


def assert_the_ranks_hold_the_whole_once(ranks: list[dict], whole: dict, model) -> None:
    """Each rank's parts equal the same regions of `whole` bit for bit, its persistent buffers `whole`'s (the
    balancing bias; the rotary tables are computed), the ranks' parts add up to the model once, and each rank was
    handed its own parts only (and the small whole buffers), never the model."""
    held = 0
    for rank in ranks:
        for name, (region, local) in rank["parts"].items():
            assert torch.equal(local, whole[name][tuple(slice(a, b) for a, b in region)]), name
            held += local.numel()
        for name, buffer in rank["buffers"].items():
            if name in whole:
                assert torch.equal(buffer, whole[name]), name
        buffers = sum(b.numel() for n, b in rank["buffers"].items() if n in whole)
        assert rank["total"] == sum(local.numel() for _, local in rank["parts"].values()) + buffers
    assert held == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_ep"])
def test_a_release_read_by_slice_into_fsdp2_equals_the_one_process_load(tmp_path, layout):
    model = model_with_every_weight_random(K3)
    write_release(model, tmp_path / "release")
    whole = read_hf(HF_ADAPTER, tmp_path / "release", say=lambda _: None).model.state_dict()
    ranks = spawn_ranks(functools.partial(_read_by_slice, str(tmp_path / "release"), layout), tmp_path)
    assert_the_ranks_hold_the_whole_once(ranks, whole, model)
    parameters = sum(p.numel() for p in model.parameters())
    for rank in ranks:  # the largest region read at once is one tensor's share, far below the model
        assert rank["largest"] <= max(t.numel() for t in whole.values()) < parameters / 4


def test_a_checkpoint_file_read_by_slice_equals_its_weights(tmp_path):
    from k3train.checkpoint.checkpointer import FORMAT_VERSION
    from k3train.inference.slices import CheckpointSlices

    model = model_with_every_weight_random(K3)
    meta = {"format_version": FORMAT_VERSION, "model_config": {**K3, "model_type": "kimi_k3"}}
    torch.save({"meta": meta, "model": model.state_dict()}, tmp_path / "last.pt")
    slices = CheckpointSlices(tmp_path / "last.pt")
    for name, t in model.state_dict().items():
        region = tuple(slice(n // 3, n) for n in t.shape)
        assert torch.equal(slices(name, tuple(t.shape), region), t[region]), name


def _save_sharded(directory: str, rank: int, world: int) -> dict:
    """On each rank: the random model, sharded by FSDP2 over the 2 ranks and saved as k3train's sharded checkpoint."""
    from k3train.checkpoint.checkpointer import FORMAT_VERSION
    from k3train.checkpoint.dcp import write_sharded
    from k3train.models.common.parallelize import FullyShard
    from k3train.runtime.parallel_dims import ParallelDims

    model = model_with_every_weight_random(K3)
    model.parallelize(ParallelDims.for_strategy("fsdp", world, rank, "cpu", 1, 1, 1, 1), FullyShard())
    meta = {"format_version": FORMAT_VERSION, "model_config": {**K3, "model_type": "kimi_k3"}}
    write_sharded(Path(directory), {"meta": meta, "model": model.state_dict()}, writer=rank == 0)
    return {}


@pytest.mark.parametrize("ranks, layout", [(1, "fsdp"), (2, "fsdp_ep")])
def test_a_sharded_checkpoint_read_by_slice_in_another_layout_equals_its_weights(tmp_path, ranks, layout):
    """Read in one process, each region spans both saved shards; on FSDP2 x ep 2, an expert's rows are one's part."""
    model = model_with_every_weight_random(K3)
    whole = model.state_dict()
    saved = tmp_path / "last.dcp"
    (tmp_path / "save").mkdir(), (tmp_path / "read").mkdir()
    spawn_ranks(functools.partial(_save_sharded, str(saved)), tmp_path / "save")
    assert (saved / ".metadata").is_file()
    read = spawn_ranks(functools.partial(_read_by_slice, str(saved), layout), tmp_path / "read", nprocs=ranks)
    assert_the_ranks_hold_the_whole_once(read, whole, model)
