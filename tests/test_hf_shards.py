"""Sharded safetensors: write_shards and ShardedSafetensors round-trip tensors of several dtypes over several shards
and as one file, write the index and names transformers writes, stream (one shard in memory), and refuse a checkpoint
whose index names a missing shard or a key its shard lacks; huggingface_hub reads what write_shards writes and the
other way round."""

import contextlib
import json
import os
import re
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3train.hf import HFFormatError
from k3train.hf import shards as shards_module
from k3train.hf.shards import INDEX_FILE, SINGLE_FILE, ShardedSafetensors, write_shards


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(64, 64, generator=g),  # 16384 bytes
        "model.layers.0.norm.weight": torch.randn(128, 32, generator=g).bfloat16(),  # 8192
        "model.layers.0.experts.weight_packed": torch.randint(0, 256, (40, 100), dtype=torch.uint8, generator=g),
        "model.layers.0.experts.weight_scale": torch.randint(0, 256, (40, 8), dtype=torch.uint8, generator=g),
        "model.layers.1.bias": torch.randn(3, 5, generator=g).half(),
        "step": torch.tensor(7, dtype=torch.int64),  # 0-d
        "model.layers.1.mask": torch.rand(50, generator=g) > 0.5,
        "lm_head.weight": torch.randn(32, 100, generator=g),  # 12800
    }


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)


def test_round_trip_over_several_shards_with_the_index_transformers_writes(tmp_path):
    tensors = sample_tensors()
    names = write_shards(iter(tensors.items()), tmp_path, max_shard_bytes=20_000, metadata={"producer": "k3train"})
    assert len(names) >= 3
    assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    assert sorted(os.listdir(tmp_path)) == sorted([*names, INDEX_FILE])  # no temporary files left

    text = (tmp_path / INDEX_FILE).read_text()
    index = json.loads(text)
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"  # transformers' formatting
    assert index == {
        "metadata": {"total_size": sum(nbytes(t) for t in tensors.values())},
        "weight_map": index["weight_map"],
    }
    assert set(index["weight_map"]) == set(tensors)
    for name in names:  # each file holds what the index says, under the header transformers writes
        with safe_open(str(tmp_path / name), framework="pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == name}
            assert sum(nbytes(f.get_tensor(k)) for k in f.keys()) <= 20_000
            assert f.metadata() == {"format": "pt", "producer": "k3train"}

    ckpt = ShardedSafetensors(tmp_path)
    assert sorted(ckpt.keys()) == sorted(tensors) and len(ckpt) == len(tensors) and "step" in ckpt
    for name, t in tensors.items():
        assert ckpt.shard_of(name) == index["weight_map"][name]
        assert_same(ckpt.get(name), t)
    seen = []
    for name, t in ckpt.items():
        assert_same(t, tensors[name])
        seen.append(name)
    assert sorted(seen) == sorted(tensors)
    assert [ckpt.shard_of(n) for n in seen] == sorted(ckpt.shard_of(n) for n in seen)  # shard by shard, in order
    with pytest.raises(KeyError, match="'nope' is not in the checkpoint"):
        ckpt.get("nope")


def test_everything_in_one_shard_is_a_single_model_safetensors_without_index(tmp_path):
    tensors = sample_tensors()
    assert write_shards(tensors.items(), tmp_path, max_shard_bytes=10**9) == [SINGLE_FILE]
    assert os.listdir(tmp_path) == [SINGLE_FILE]
    with safe_open(str(tmp_path / SINGLE_FILE), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    ckpt = ShardedSafetensors(tmp_path)
    assert {n: ckpt.shard_of(n) for n in tensors} == dict.fromkeys(tensors, SINGLE_FILE)
    got = dict(ckpt.items())
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert_same(got[name], t)


def test_empty_checkpoint_is_one_empty_file(tmp_path):
    assert write_shards(iter(()), tmp_path, max_shard_bytes=100) == [SINGLE_FILE]
    assert ShardedSafetensors(tmp_path).keys() == []


def test_shards_fill_in_order_and_a_tensor_over_the_limit_gets_its_own(tmp_path):
    tensors = {
        "a": torch.zeros(100, dtype=torch.uint8),
        "b": torch.zeros(350, dtype=torch.uint8),
        "big": torch.zeros(5000, dtype=torch.uint8),
        "c": torch.zeros(400, dtype=torch.uint8),
        "d": torch.zeros(400, dtype=torch.uint8),
        "e": torch.zeros(400, dtype=torch.uint8),
    }
    names = write_shards(tensors.items(), tmp_path, max_shard_bytes=1000)
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    groups = [sorted(k for k, v in weight_map.items() if v == name) for name in names]
    assert groups == [["a", "b"], ["big"], ["c", "d"], ["e"]]
    assert (tmp_path / names[1]).stat().st_size > 5000
    assert_same(ShardedSafetensors(tmp_path).get("big"), tensors["big"])


def test_a_missing_shard_is_refused_at_open(tmp_path):
    names = write_shards(sample_tensors().items(), tmp_path, max_shard_bytes=20_000)
    (tmp_path / names[1]).unlink()
    expected = f"{names[1]}, named by model.safetensors.index.json, is missing from {tmp_path}"
    with pytest.raises(HFFormatError, match=re.escape(expected)):
        ShardedSafetensors(tmp_path)


def test_a_key_the_index_puts_in_a_shard_that_lacks_it_is_refused_before_that_shard_is_read(tmp_path):
    tensors = sample_tensors()
    names = write_shards(tensors.items(), tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["ghost.weight"] = names[1]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    ckpt = ShardedSafetensors(tmp_path)  # checked lazily
    message = re.escape(f"ghost.weight, which model.safetensors.index.json puts in {names[1]}, is not in that file")
    first = next(k for k, v in index["weight_map"].items() if v == names[0])
    assert_same(ckpt.get(first), tensors[first])  # the other shards still read
    with pytest.raises(HFFormatError, match=message):
        ckpt.get("ghost.weight")
    second = next(k for k, v in index["weight_map"].items() if v == names[1] and k != "ghost.weight")
    with pytest.raises(HFFormatError, match=message):
        ckpt.get(second)  # a real key of that shard: the shard is wrong, so none of it is returned
    seen = []
    with pytest.raises(HFFormatError, match=message):
        for name, _ in ckpt.items():
            seen.append(name)
    assert seen and all(index["weight_map"][n] == names[0] for n in seen)


def test_a_directory_without_a_checkpoint_says_what_it_looked_for(tmp_path):
    with pytest.raises(HFFormatError, match=f"{re.escape(str(tmp_path))} holds neither {INDEX_FILE} nor {SINGLE_FILE}"):
        ShardedSafetensors(tmp_path)
    with pytest.raises(HFFormatError, match="no such directory"):
        ShardedSafetensors(tmp_path / "absent")


def test_a_malformed_index_is_refused(tmp_path):
    (tmp_path / INDEX_FILE).write_text("{not json")
    with pytest.raises(HFFormatError, match="cannot be read as JSON"):
        ShardedSafetensors(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(HFFormatError, match='no "weight_map"'):
        ShardedSafetensors(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "../model.safetensors"}}))
    with pytest.raises(HFFormatError, match="not a file name in"):
        ShardedSafetensors(tmp_path)


def test_duplicate_names_are_refused_and_leave_nothing_behind(tmp_path):
    pairs = [("a", torch.zeros(600, dtype=torch.uint8)), ("b", torch.zeros(600, dtype=torch.uint8))]
    pairs.append(("a", torch.ones(3)))
    with pytest.raises(ValueError, match="tensor name 'a' appears twice"):
        write_shards(iter(pairs), tmp_path, max_shard_bytes=1000)  # the first shard was written by then
    assert os.listdir(tmp_path) == []


def test_write_streams_holding_one_shard_at_a_time(tmp_path):
    refs: list[weakref.ref] = []
    alive: list[int] = []  # tensors yielded so far that are still alive, before each new one is made
    files_at: list[bool] = []  # whether any shard file (temporary or final) existed, before each new one

    def produce():
        for i in range(10):
            alive.append(sum(r() is not None for r in refs))
            files_at.append(any("safetensors" in name for name in os.listdir(tmp_path)))
            t = torch.full((250,), float(i))  # 1000 bytes
            refs.append(weakref.ref(t))
            yield f"t{i}", t
            del t

    names = write_shards(produce(), tmp_path, max_shard_bytes=2500)  # two tensors a shard
    assert len(names) == 5
    assert files_at.index(True) == 3  # the first shard was on disk once the third tensor had come
    assert max(alive) <= 2  # never more than one shard's tensors held
    ckpt = ShardedSafetensors(tmp_path)
    assert all(torch.equal(t, torch.full((250,), float(n[1:]))) for n, t in ckpt.items())


def test_items_opens_one_shard_at_a_time(tmp_path, monkeypatch):
    write_shards(sample_tensors().items(), tmp_path, max_shard_bytes=20_000)
    ckpt = ShardedSafetensors(tmp_path)
    open_now, most = 0, 0
    real_open = shards_module.safe_open

    @contextlib.contextmanager
    def counting_open(*args, **kwargs):
        nonlocal open_now, most
        with real_open(*args, **kwargs) as f:
            open_now += 1
            most = max(most, open_now)
            try:
                yield f
            finally:
                open_now -= 1

    monkeypatch.setattr(shards_module, "safe_open", counting_open)
    assert len(list(ckpt.items())) == len(sample_tensors())
    assert most == 1 and open_now == 0


def test_a_new_save_removes_the_weight_files_of_an_earlier_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    tensors = sample_tensors()
    write_shards(tensors.items(), tmp_path, max_shard_bytes=10_000)
    write_shards(tensors.items(), tmp_path, max_shard_bytes=10**9)
    assert sorted(os.listdir(tmp_path)) == ["config.json", SINGLE_FILE]
    names = write_shards(tensors.items(), tmp_path, max_shard_bytes=20_000)
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", INDEX_FILE, *names])
    assert sorted(ShardedSafetensors(tmp_path).keys()) == sorted(tensors)


def test_huggingface_hub_reads_what_write_shards_writes_and_the_other_way_round(tmp_path):
    hub = pytest.importorskip("huggingface_hub", reason="huggingface_hub not installed (tokenizers brings it)")
    tensors = {k: v for k, v in sample_tensors().items() if v.ndim > 0}
    # the same files and index as huggingface_hub's own split (no tensor over the limit, where the orders differ)
    ours = tmp_path / "ours"
    names = write_shards(tensors.items(), ours, max_shard_bytes=20_000)
    split = hub.split_torch_state_dict_into_shards(tensors, max_shard_size=20_000)
    assert sorted(split.filename_to_tensors) == names
    assert json.loads((ours / INDEX_FILE).read_text())["weight_map"] == split.tensor_to_filename
    loaded = {}
    for name in names:
        loaded.update(hub.load_state_dict_from_file(ours / name))
    assert loaded.keys() == tensors.keys()
    for name, t in loaded.items():
        assert_same(t, tensors[name])
    # huggingface_hub's writer, our reader
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    hub.save_torch_state_dict(tensors, theirs, max_shard_size=20_000)
    ckpt = ShardedSafetensors(theirs)
    assert sorted(ckpt.keys()) == sorted(tensors)
    for name, t in ckpt.items():
        assert_same(t, tensors[name])
    single = tmp_path / "single"
    single.mkdir()
    save_file(tensors, str(single / SINGLE_FILE))  # safetensors' own writer, one file
    assert sorted(ShardedSafetensors(single).keys()) == sorted(tensors)
