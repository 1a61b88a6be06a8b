"""Initial weights drawn by counter (k3train/models/common/init.py): any part of a tensor, drawn alone, equals the
same part of the whole tensor drawn at once, bit for bit; a model built on the meta device and materialised equals
the model built whole; and the FSDP2 / expert-parallel shards of 2 gloo ranks hold exactly their slices."""

import functools

import pytest
import torch

from k3train.models.common.init import (
    BLOCK_VALUES,
    Constant,
    InitialWeights,
    Normal,
    Uniform,
    draw,
    materialise,
    runs,
)
from k3train.models.k3 import KimiK3

from helpers.spawn import spawn_ranks
from helpers.tiny_k3 import TINY


def tiny_k3_config():
    return KimiK3.config_class(**TINY)


@pytest.mark.parametrize("shape", [(7,), (3000, 70), (2100, 1), (5, 30, 1000), ()])
@pytest.mark.parametrize("rule", [Normal(0.02), Uniform(1.0, 16.0, torch.log), Constant(1.0)])
def test_any_region_drawn_alone_equals_that_region_of_the_whole(shape, rule):
    whole = draw(rule, 1337, "layers.0.w", shape)
    assert whole.shape == torch.Size(shape)
    if not shape:
        return
    rows = shape[0]
    per = max(1, BLOCK_VALUES // max(1, whole[0].numel()))  # rows a block holds
    # dim-0 shards starting and ending inside, at and across block boundaries; a dim-1 shard (stacked experts);
    # a region cutting every dim
    regions = [
        (slice(a, b), *(slice(0, n) for n in shape[1:]))
        for a, b in [(0, rows), (1, max(rows - 1, 1)), (per - 1, per + 2), (rows - 1, rows)]
        if 0 <= a < b <= rows
    ]
    if len(shape) > 1:
        regions.append((slice(1, rows), slice(shape[1] // 4, shape[1] // 2), *(slice(0, n) for n in shape[2:])))
        regions.append(tuple(slice(n // 3, n - n // 5) for n in shape))
    for region in regions:
        assert torch.equal(draw(rule, 1337, "layers.0.w", shape, region), whole[region]), region


def test_the_runs_of_a_shard_are_what_it_holds():
    assert list(runs((10, 4), (slice(2, 5), slice(0, 4)))) == [(8, 20)]  # whole rows: one run
    assert list(runs((3, 10, 4), (slice(0, 3), slice(5, 10), slice(0, 4)))) == [(20, 40), (60, 80), (100, 120)]
    assert list(runs((3, 10, 4), (slice(1, 2), slice(0, 10), slice(0, 4)))) == [(40, 80)]


def test_the_draw_depends_on_the_seed_and_the_name_only():
    shape = (BLOCK_VALUES // 100 + 3, 100)  # two blocks
    a = draw(Normal(1.0), 1, "x", shape)
    assert torch.equal(a, draw(Normal(1.0), 1, "x", shape))
    assert not torch.equal(a, draw(Normal(1.0), 2, "x", shape))
    assert not torch.equal(a, draw(Normal(1.0), 1, "y", shape))
    assert not torch.equal(a[:100], a[-100:])  # blocks differ from each other
    assert abs(float(a.std()) - 1.0) < 0.01 and abs(float(a.mean())) < 0.01


def test_a_model_built_on_the_meta_device_and_materialised_equals_the_model_built_whole():
    config = tiny_k3_config()
    torch.manual_seed(5)
    whole = KimiK3(config)
    with torch.device("meta"):
        meta = KimiK3(config)
    materialise(meta, torch.device("cpu"), InitialWeights(meta.init_rules(), 5))
    expected, got = whole.state_dict(), meta.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    for (name, a), b in zip(whole.named_buffers(), meta.buffers()):  # non-persistent too (the rotary tables)
        assert torch.equal(a, b), name


def _sharded_slices(layout, rank, world):
    """On each gloo rank: the model built on meta, made expert-parallel and FSDP2-sharded, materialised; each
    parameter's local values against the same region of the whole model one process draws."""
    from k3train.models.common.init import where_held
    from k3train.models.common.parallelize import FullyShard
    from k3train.models.layout import parameter_layouts
    from k3train.runtime.parallel_dims import ParallelDims

    config = tiny_k3_config()
    torch.manual_seed(9)
    whole = KimiK3(config).state_dict()
    with torch.device("meta"):
        model = KimiK3(config)
    ep = 2 if layout == "fsdp_ep" else 1
    dims = ParallelDims.for_strategy("fsdp", world, rank, "cpu", ep, 1, 1, 1)
    model.parallelize(dims, FullyShard())
    materialise(model, torch.device("cpu"), InitialWeights(model.init_rules(), 9))
    layouts, checked = parameter_layouts(model), 0
    for name, p in model.named_parameters():
        shape, region, local = where_held(name, p, layouts)
        assert torch.equal(local, whole[name][region]), name
        checked += local.numel()
    return {"checked": checked}


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_ep"])
def test_each_ranks_shard_holds_exactly_its_slice_of_the_one_process_draw(layout, tmp_path):
    counted = [r["checked"] for r in spawn_ranks(functools.partial(_sharded_slices, layout), tmp_path)]
    total = sum(p.numel() for p in KimiK3(tiny_k3_config()).parameters())
    assert sum(counted) == total  # the two ranks' parts add up to the whole model
