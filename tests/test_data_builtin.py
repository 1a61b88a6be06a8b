import contextlib
import multiprocessing as mp
from pathlib import Path

import hydra.utils
import numpy as np
import pytest
from omegaconf import OmegaConf

import k3train.data.builtin as builtin
import k3train.data.prepare as prepare_mod
from k3train.data import HFTokenizer, TokenData, prepare_builtin
from k3train.data.manifest import MANIFEST_NAME

from helpers.data import train_tiny_bpe

CONF = Path(__file__).resolve().parents[1] / "conf" / "data"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3TRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_builtin_prepares_once_into_the_cache(cache, monkeypatch):
    data = TokenData.builtin()
    assert data.path.parent == cache and data.path.name.startswith("builtin-")
    docs = builtin.builtin_documents()
    text_bytes = sum(len(d.encode()) for d in docs)
    assert data.vocab_size == 257 and data.train.num_tokens + data.val.num_tokens == text_bytes + len(docs)
    assert 0.04 < data.val.num_tokens / (data.train.num_tokens + data.val.num_tokens) < 0.12
    first = data.train.read(0, 200).astype(np.int64)
    assert bytes(first[: len(docs[0].encode()[:100])].tolist()) == docs[0].encode()[:100]  # sorted-key order
    data.loaders(8, 1024)  # the default geometry fits both splits

    def no_prepare(*args, **kwargs):
        raise AssertionError("the cached corpus was prepared again")

    monkeypatch.setattr(builtin, "write_dataset", no_prepare)
    again = TokenData.builtin()
    assert again.path == data.path and again.train.fingerprint == data.train.fingerprint


def test_cache_key_follows_the_tokenizer_and_the_recipe(cache, tmp_path, monkeypatch):
    byte_path = builtin.builtin_path()
    tok = HFTokenizer(train_tiny_bpe(tmp_path / "tokenizer.json"), "<|endoftext|>")
    assert builtin.builtin_path(tokenizer=tok) != byte_path
    assert builtin.builtin_path(cache_dir=tmp_path / "elsewhere").parent == tmp_path / "elsewhere"
    monkeypatch.setattr(builtin, "FORMAT_VERSION", 2)
    assert builtin.builtin_path() != byte_path
    monkeypatch.setattr(builtin, "FORMAT_VERSION", 1)
    monkeypatch.setattr(builtin, "BUILTIN_VAL_FRACTION", 0.1)
    assert builtin.builtin_path() != byte_path


def test_losing_a_prepare_race_opens_the_winners_copy(cache, monkeypatch):
    """Simulate the race exactly: another process commits between our finished copy and our rename."""
    real_atomic_directory = prepare_mod.atomic_directory
    calls = []

    @contextlib.contextmanager
    def rival_commits_first(path, **kwargs):
        calls.append(path)
        with real_atomic_directory(path, **kwargs) as tmp:
            yield tmp
            if len(calls) == 1:
                prepare_builtin()  # the rival prepares and commits first (the nested call's commit is the real one)

    monkeypatch.setattr(prepare_mod, "atomic_directory", rival_commits_first)
    path = prepare_builtin()
    assert len(calls) == 2 and (path / MANIFEST_NAME).is_file()
    assert [p.name for p in cache.iterdir()] == [path.name]  # the loser's temporary copy is gone
    TokenData(path)


def _prepare_in_child(barrier):
    barrier.wait()
    prepare_builtin()


def test_concurrent_first_uses_both_succeed(cache):
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_prepare_in_child, args=(barrier,)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    (only,) = cache.iterdir()
    assert only == builtin.builtin_path() and TokenData(only).train.num_tokens > 400_000


def test_hydra_data_configs_instantiate(cache, tmp_path):
    data = hydra.utils.instantiate(OmegaConf.load(CONF / "builtin.yaml"))
    assert isinstance(data, TokenData) and data.path.parent == cache
    conf = OmegaConf.load(CONF / "prepared.yaml")
    assert OmegaConf.is_missing(conf, "path")
    conf.path = str(data.path)
    assert hydra.utils.instantiate(conf).train.fingerprint == data.train.fingerprint
