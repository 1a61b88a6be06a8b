"""Kimi's released tokenizer format (k3train/data/tiktoken_format.py), on a small tokenizer of that format made
here: tiktoken.model (base64 token, rank) and tokenizer_config.json's special tokens after the ranks. The reader
encodes a sample as the `tiktoken` library does from the same files, its pattern splits as Kimi's does (Han runs
apart from the letters around them), prepare keeps the files and decodes back, and damaged files are refused."""

import base64
import json

import numpy as np
import pytest

from k3train.data import ShardedTokenDataset, TokenData, prepare_dataset
from k3train.data.tiktoken_format import PATTERN, RESERVED_SPECIAL_TOKENS, TiktokenTokenizer
from k3train.data.tokenizers import load_tokenizer

from helpers.data import DOCS, VAL_DOCS, write_jsonl

tiktoken = pytest.importorskip("tiktoken", reason="the tiktoken library reads Kimi's format (the kimi extra)")
from tiktoken.load import load_tiktoken_bpe  # noqa: E402

MERGES = [b"th", b"he", b"the", b" t", b" the", b"at", b"cat", b" cat", b"in", b"ing", "中文".encode(), b"do", b"wn"]
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>"}  # offsets past the ranks, as Kimi's tokenizer_config.json names them
SAMPLE = [*DOCS[:5], "中文English混合 and 汉字abc", "the cat isn't thinking; it's 12345 cats\n\n  done", ""]


def make_kimi_format(folder):
    """Every byte its own rank (0..255), then MERGES (each made of two tokens already ranked), then the names."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([b]) for b in range(256)] + MERGES
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    decoder = {str(len(tokens) + k): {"content": name, "special": True} for k, name in NAMED.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    return folder


def reference(folder):
    """tiktoken's own Encoding from the same files (its own parser of tiktoken.model)."""
    ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    specials = {name: len(ranks) + k for k, name in NAMED.items()}
    return tiktoken.Encoding(name="reference", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_the_reader_encodes_as_tiktoken_does(tmp_path):
    folder = make_kimi_format(tmp_path / "kimi")
    tok = load_tokenizer(folder, "[EOS]")
    assert isinstance(tok, TiktokenTokenizer)
    base = 256 + len(MERGES)
    assert tok.vocab_size == base + RESERVED_SPECIAL_TOKENS and tok.eod_id == base + 1
    ref = reference(folder)
    for text in SAMPLE:
        assert tok.encode(text).tolist() == ref.encode_ordinary(text), text
        assert tok.decode(tok.encode(text).tolist()) == text
    assert [ids.tolist() for ids in tok.encode_batch(SAMPLE)] == ref.encode_ordinary_batch(SAMPLE)
    assert tok.decode([tok.eod_id, base + 100]) == "[EOS]<|reserved_token_" + str(base + 100) + "|>"
    quoted = tok.encode("a quoted [EOS] is text").tolist()
    assert tok.eod_id not in quoted  # a document cannot forge a boundary


def test_the_pattern_splits_as_kimis_does():
    """Kimi's pattern puts Han runs in pre-tokens of their own, and groups digits by up to three: what its Han
    branch and the Han subtracted from its letter branches do (the splits llama.cpp's Kimi K2 support checks)."""
    import regex

    split = regex.compile(PATTERN, flags=regex.V1).findall
    assert split("中文English混合") == ["中文", "English", "混合"]
    assert split("汉字abc") == ["汉字", "abc"]
    assert split("北京市 Pascal") == ["北京市", " Pascal"]
    assert split("1234567") == ["123", "456", "7"]
    assert split("it's") == ["it's"]


def test_prepare_keeps_the_files_and_decodes_back(tmp_path):
    folder = make_kimi_format(tmp_path / "kimi")
    tok = load_tokenizer(folder / "tiktoken.model", "[EOS]")
    train = write_jsonl(tmp_path / "train.jsonl", DOCS)
    val = write_jsonl(tmp_path / "val.jsonl", VAL_DOCS)
    manifest = prepare_dataset([train], tmp_path / "ds", tokenizer=tok, val_inputs=[val], workers=2)
    assert manifest["tokenizer"] == tok.identity() and manifest["tokenizer"]["name"] == "tiktoken"
    ref = reference(folder)
    expected = np.concatenate([ref.encode_ordinary(d) + [tok.eod_id] for d in DOCS])
    prepared = ShardedTokenDataset(tmp_path / "ds", "train")
    assert np.array_equal(prepared.read(0, prepared.num_tokens).astype(np.int64), expected)
    assert (tmp_path / "ds" / "tiktoken.model").is_file() and (tmp_path / "ds" / "tokenizer_config.json").is_file()
    val_tokens = ShardedTokenDataset(tmp_path / "ds", "val")
    decoded = TokenData(tmp_path / "ds").tokenizer().decode(val_tokens.read(0, val_tokens.num_tokens).tolist())
    assert decoded == "".join(d + "[EOS]" for d in VAL_DOCS)


def test_damaged_or_incomplete_files_are_refused(tmp_path):
    folder = make_kimi_format(tmp_path / "kimi")
    with pytest.raises(ValueError, match=r"choose its end-of-document token.*\[EOS\]"):
        TiktokenTokenizer(folder, None)
    with pytest.raises(ValueError, match="'<|endoftext|>' is not one of its special tokens"):
        TiktokenTokenizer(folder, "<|endoftext|>")
    with open(folder / "tiktoken.model", "a") as f:
        f.write("not-base64!! x\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:\d+ is not a '<base64 token> <rank>' line"):
        TiktokenTokenizer(folder, "[EOS]")
    make_kimi_format(folder)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json does not exist"):
        TiktokenTokenizer(folder, "[EOS]")
