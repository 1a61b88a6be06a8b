import json

import numpy as np
import pytest
import torch

import k3train.data.dataset as dataset_mod
from k3train.data import EndOfData, HFTokenizer, ShardedTokenDataset, TokenData, TokenDataLoader, prepare_dataset
from k3train.data.manifest import MANIFEST_NAME

from helpers.data import DOCS, byte_stream, make_dataset, train_tiny_bpe, write_jsonl


@pytest.fixture
def data_dir(tmp_path):
    return make_dataset(tmp_path, shard_tokens=97)  # ~30 shards of 97 tokens


@pytest.fixture
def ref():
    return byte_stream(DOCS)


def test_reads_across_shards_equal_the_concatenated_stream(data_dir, ref):
    ds = ShardedTokenDataset(data_dir, "train")
    assert ds.num_tokens == len(ds) == len(ref) and ds.vocab_size == 257 and len(ds._shards) > 20
    rng = np.random.default_rng(0)
    spans = [(0, len(ref)), (96, 2), (97, 97), (90, 300), (len(ref) - 1, 1), (5, 0)]
    spans += [(int(s), int(rng.integers(0, len(ref) - s))) for s in rng.integers(0, len(ref), 50)]
    for start, n in spans:
        assert np.array_equal(ds.read(start, n), ref[start : start + n]), (start, n)
    with pytest.raises(IndexError, match="outside the train split"):
        ds.read(len(ref) - 3, 4)
    assert "split='train'" in repr(ds) and f"num_tokens={len(ref):,}" in repr(ds)


def test_batches_are_shifted_contiguous_and_never_wrap(data_dir, ref):
    B, T = 3, 17
    loader = TokenDataLoader(ShardedTokenDataset(data_dir, "train"), B, T)
    expected_batches = (len(ref) - 1) // (B * T)
    assert loader.batches_remaining() == expected_batches and loader.tokens_per_batch == B * T
    for i in range(expected_batches):
        x, y, document_ids = loader.next_batch()
        assert document_ids is None  # no eod_id: each row is one sequence
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
        c = i * B * T
        assert torch.equal(x.flatten(), torch.from_numpy(ref[c : c + B * T]))
        assert torch.equal(y.flatten(), torch.from_numpy(ref[c + 1 : c + B * T + 1]))
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one within each row
    assert loader.batches_remaining() == 0
    for _ in range(2):  # stays exhausted; it does not wrap to the start
        with pytest.raises(EndOfData, match="never wraps"):
            loader.next_batch()
    loader.reset()
    assert torch.equal(loader.next_batch()[0].flatten(), torch.from_numpy(ref[: B * T]))


def test_last_batch_may_end_on_the_last_token(data_dir, ref):
    ds = ShardedTokenDataset(data_dir, "train")
    loader = TokenDataLoader(ds, 1, len(ref) - 1)
    x, y, _ = loader.next_batch()
    assert y[0, -1].item() == ref[-1] == 256
    with pytest.raises(EndOfData):
        loader.next_batch()
    with pytest.raises(ValueError, match=rf"has {len(ref):,} tokens.*= {len(ref) + 1:,}"):
        TokenDataLoader(ds, 1, len(ref))
    with pytest.raises(ValueError, match=r"needs batch_size\*seq_len\*world_size\+1 = 2\*300\*4\+1"):
        TokenDataLoader(ShardedTokenDataset(data_dir, "val"), 2, 300, rank=1, world_size=4)


def test_restored_cursor_continues_identically_in_a_fresh_loader(data_dir):
    loader = TokenDataLoader(ShardedTokenDataset(data_dir, "train"), 2, 33)
    for _ in range(5):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))  # JSON-able, survives a checkpoint
    expected = [loader.next_batch() for _ in range(4)]
    fresh = TokenDataLoader(ShardedTokenDataset(data_dir, "train"), 2, 33)
    fresh.load_state_dict(state)
    assert fresh.cursor == 5 * 66 and fresh.batches_remaining() == loader.batches_remaining() + 4
    for x, y, _ in expected:
        fx, fy, _ = fresh.next_batch()
        assert torch.equal(fx, x) and torch.equal(fy, y)


def test_load_state_dict_names_every_mismatch(data_dir, tmp_path):
    data = TokenData(data_dir)
    train, val = data.loaders(2, 8)
    state = train.state_dict()
    with pytest.raises(ValueError) as err:
        TokenDataLoader(data.train, 4, 16, world_size=2).load_state_dict(state)
    for part in ("saved 2 x 1 = 2 rows, this loader has 4 x 2 = 8", "seq_len: saved 8"):
        assert part in str(err.value)
    with pytest.raises(ValueError, match="split: saved 'train', this loader has 'val'"):
        val.load_state_dict(state)
    other = TokenData(_uppercase_dataset(tmp_path))
    with pytest.raises(ValueError, match="fingerprint: saved"):
        other.loaders(2, 8)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="cursor: saved 10000000"):
        train.load_state_dict({**state, "cursor": 10_000_000})
    with pytest.raises(ValueError, match=r"lacks \['fingerprint'\]"):
        train.load_state_dict({k: v for k, v in state.items() if k != "fingerprint"})
    assert train.cursor == 0  # nothing was half-restored


def _uppercase_dataset(tmp_path):
    src = write_jsonl(tmp_path / "other.jsonl", [d.upper() for d in DOCS])
    prepare_dataset([src], tmp_path / "other", val_fraction=0.3, workers=1)
    return tmp_path / "other"


def test_data_parallel_ranks_together_equal_one_big_batch(data_dir):
    data = TokenData(data_dir)
    W, B, T = 3, 2, 19
    ranks = [TokenDataLoader(data.train, B, T, rank=r, world_size=W) for r in range(W)]
    single = TokenDataLoader(data.train, W * B, T)
    steps = single.batches_remaining()
    assert steps > 3 and all(r.batches_remaining() == steps for r in ranks)
    for _ in range(steps):
        x, y, _ = single.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    for r in ranks:  # every rank ends at the same step, so no rank waits on a collective forever
        with pytest.raises(EndOfData):
            r.next_batch()
    assert ranks[0].state_dict() == ranks[2].state_dict()
    ranks[1].load_state_dict(ranks[0].state_dict())  # rank 0's saved state restores any rank
    with pytest.raises(ValueError, match="rank must be in 0..2"):
        TokenDataLoader(data.train, B, T, rank=3, world_size=W)


def test_truncated_or_missing_shard_is_detected(data_dir):
    shard = data_dir / "train_000003.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"train_000003.bin is 192 bytes but manifest.json records 97 uint16"):
        TokenData(data_dir)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="train_000003.bin listed in manifest.json is missing"):
        ShardedTokenDataset(data_dir, "train")
    ShardedTokenDataset(data_dir, "val")  # the other split is untouched


def test_out_of_vocab_ids_and_modified_shards_are_detected(data_dir):
    manifest = json.loads((data_dir / MANIFEST_NAME).read_text())
    shard = data_dir / manifest["splits"]["val"]["shards"][0]["file"]
    original = shard.read_bytes()
    shard.write_bytes(np.array([300], "<u2").tobytes() + original[2:])
    with pytest.raises(ValueError, match=r"val_000000.bin holds token id 300 >= vocab_size 257"):
        TokenData(data_dir)
    shard.write_bytes(np.array([7], "<u2").tobytes() + original[2:])  # a valid id, but not what was prepared
    TokenData(data_dir)  # the cheap checks pass...
    with pytest.raises(ValueError, match="do not hash to the sha256"):
        TokenData(data_dir, verify=True)  # ...the full re-hash does not
    shard.write_bytes(original)
    manifest["splits"]["train"]["max_token_id"] = 257
    (data_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="train split holds token id 257 >= vocab_size 257"):
        TokenData(data_dir)


@pytest.fixture
def large_shard_dir(tmp_path):
    """One train shard of ~285k byte tokens: far more than the 64Ki tokens the id check once sampled."""
    (tmp_path / "big.txt").write_text("the cat sat on the mat.\n" * 12_500)
    val = write_jsonl(tmp_path / "val.jsonl", DOCS)
    prepare_dataset([tmp_path / "big.txt"], tmp_path / "big", val_inputs=[val], workers=1)
    return tmp_path / "big"


def poke(shard, offset: int, token_id: int) -> None:
    with open(shard, "r+b") as f:
        f.seek(2 * offset)
        f.write(np.array([token_id], "<u2").tobytes())


@pytest.mark.parametrize("chunk_tokens", [None, 1000])  # the default chunk, and many chunks per shard
def test_an_out_of_vocab_id_anywhere_in_a_shard_is_refused_at_open(large_shard_dir, monkeypatch, chunk_tokens):
    if chunk_tokens:
        monkeypatch.setattr(dataset_mod, "CHECK_CHUNK_TOKENS", chunk_tokens)
    assert ShardedTokenDataset(large_shard_dir, "train").num_tokens > 200_000
    poke(large_shard_dir / "train_000000.bin", 200_123, 300)
    poke(large_shard_dir / "train_000000.bin", 250_000, 400)  # only the first bad id is named
    with pytest.raises(
        ValueError,
        match=r"train_000000.bin holds token id 300 >= vocab_size 257 at token offset "
        r"200,123 .*--overwrite.*right --tokenizer",
    ):
        TokenData(large_shard_dir)


@pytest.mark.slow
def test_cli_refuses_an_out_of_vocab_shard_in_one_line(large_shard_dir, run_cli, tmp_path):
    poke(large_shard_dir / "train_000000.bin", 200_123, 300)
    run_dir = tmp_path / "run"
    proc = run_cli(
        "model=smoke_test_lm",
        "data=prepared",
        f"data.path={large_shard_dir}",
        "train.max_steps=1",
        "train.batch_size=2",
        "train.seq_len=32",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert "train_000000.bin holds token id 300 >= vocab_size 257 at token offset 200,123" in proc.stderr
    assert not any((run_dir / name).exists() for name in ("last.pt", "run.json", "metrics.jsonl"))


def test_bad_manifests(tmp_path, data_dir):
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist.*k3train.prepare"):
        TokenData(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no manifest.json"):
        TokenData(tmp_path / "empty")
    manifest = json.loads((data_dir / MANIFEST_NAME).read_text())
    (data_dir / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version 99, this k3train reads version 1"):
        TokenData(data_dir)
    (data_dir / MANIFEST_NAME).write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        TokenData(data_dir)


def test_splits_with_different_tokenizers_are_refused(data_dir, tmp_path):
    tok = HFTokenizer(train_tiny_bpe(tmp_path / "tokenizer.json"), "<|endoftext|>")
    src = write_jsonl(tmp_path / "bpe.jsonl", DOCS)
    prepare_dataset([src], tmp_path / "bpe", tokenizer=tok, val_fraction=0.3, workers=1)
    with pytest.raises(ValueError, match=r"different tokenizers \(vocab_size:.*same --tokenizer"):
        TokenData(data_dir, val_path=tmp_path / "bpe")
    mixed = TokenData(data_dir, val_path=data_dir)
    ident = mixed.identity()
    assert json.loads(json.dumps(ident)) == ident
    assert ident["tokens"] == {"train": mixed.train.num_tokens, "val": mixed.val.num_tokens}
    assert ident["vocab_size"] == 257 and ident["fingerprint"] == ident["val_fingerprint"] == mixed.train.fingerprint
    assert "vocab_size=257" in repr(mixed)


def test_a_state_restores_into_another_split_of_the_same_global_batch(data_dir):
    """Two ranks at batch 2 wrote it; one process at batch 4 continues with exactly the rows they would have read."""
    data = TokenData(data_dir)
    ranks = [TokenDataLoader(data.train, 2, 8, rank=r, world_size=2) for r in range(2)]
    for loader in ranks:
        loader.next_batch()
    single = TokenDataLoader(data.train, 4, 8)
    single.load_state_dict(ranks[0].state_dict())
    x, y, _ = single.next_batch()
    parts = [loader.next_batch() for loader in ranks]
    assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
