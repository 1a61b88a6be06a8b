"""`python -m k3train.tokenizer train` (k3train/data/bpe_training.py): a byte-level BPE trained on a corpus
round-trips any text exactly, prepare with it equals what the `tokenizers` library itself encodes from the same
file, and a vocabulary too small for the bytes is refused in one line."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from k3train.data import ShardedTokenDataset, TokenData, prepare_dataset
from k3train.data.tokenizers import load_tokenizer
from k3train.tokenizer import main

from helpers.data import DOCS, VAL_DOCS, write_jsonl

SAMPLES = [
    "the cat sat down.",
    "  leading spaces, trailing spaces  ",
    "héllo wörld ✓ 中文English混合 🎉\ttab\r\nCRLF\n\n",
    "a document that quotes <|endoftext|> literally",
    "",
]


def _train(tmp_path, vocab_size=300, *extra):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    out = tmp_path / "tok" / "tokenizer.json"
    assert main(["train", str(corpus), "--vocab-size", str(vocab_size), "--out", str(out), *extra]) == 0
    return out


def test_a_trained_tokenizer_round_trips_text_exactly(tmp_path):
    out = _train(tmp_path)
    tok = load_tokenizer(out, "<|endoftext|>")
    assert tok.vocab_size == 300 and tok.eod_id == 299  # the merges fill the vocabulary; the special token last
    for text in SAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids.tolist()) == text
        assert tok.eod_id not in ids.tolist()  # quoted, it is text, not a boundary
    merged = tok.encode("the cat sat down.")
    assert len(merged) < len(b"the cat sat down.")  # it learned merges from the corpus


def test_prepare_with_it_equals_the_tokenizers_librarys_own_encoding(tmp_path):
    out = _train(tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", DOCS)
    val = write_jsonl(tmp_path / "val.jsonl", VAL_DOCS)
    tok = load_tokenizer(out, "<|endoftext|>")
    manifest = prepare_dataset([train], tmp_path / "ds", tokenizer=tok, val_inputs=[val], workers=2)
    reference = Tokenizer.from_file(str(out))  # the file as the library reads it, nothing of k3train's
    eod = reference.token_to_id("<|endoftext|>")
    expected = np.concatenate([reference.encode(d, add_special_tokens=False).ids + [eod] for d in DOCS])
    prepared = ShardedTokenDataset(tmp_path / "ds", "train")
    assert np.array_equal(prepared.read(0, prepared.num_tokens).astype(np.int64), expected)
    assert manifest["tokenizer"]["name"] == "huggingface" and manifest["vocab_size"] == 300
    assert TokenData(tmp_path / "ds").tokenizer().identity() == tok.identity()


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    out = tmp_path / "tokenizer.json"
    assert main(["train", str(corpus), "--vocab-size", "200", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot hold byte-level BPE's 256 byte tokens" in err[0] and "257" in err[0]
    assert not out.exists()
    assert main(["train", str(tmp_path / "missing.jsonl"), "--vocab-size", "300", "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    out.write_text(json.dumps({"kept": True}))
    assert main(["train", str(corpus), "--vocab-size", "300", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and json.loads(out.read_text()) == {"kept": True}


def test_the_end_of_document_token_can_be_named(tmp_path):
    out = _train(tmp_path, 280, "--eod-token", "[EOS]")
    tok = load_tokenizer(out, "[EOS]")
    assert tok.eod_id == 279 and tok.decode([tok.eod_id]) == "[EOS]"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        load_tokenizer(out, "<|endoftext|>")
