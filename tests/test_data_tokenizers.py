import pickle

import numpy as np
import pytest
import tokenizers

from k3train.data import ByteTokenizer, HFTokenizer, load_tokenizer

from helpers.data import DOCS, train_tiny_bpe

TEXTS = ["", "plain ascii", "héllo wörld ✓ 日本語 🐍", "line\r\nbreaks\n\n\ttabs"]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.tolist() == list(text.encode("utf-8"))
        assert tok.decode(ids.tolist()) == text
    assert tok.decode([104, 105, 256, 111]) == "hi<|endoftext|>o"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character decodes, it does not raise
    with pytest.raises(ValueError, match="outside"):
        tok.decode([257])


def test_load_tokenizer_byte_rejects_eod_token():
    assert load_tokenizer("byte").identity() == {"name": "byte", "vocab_size": 257, "eod_id": 256}
    with pytest.raises(ValueError, match="fixed at 256"):
        load_tokenizer("byte", "<|endoftext|>")


def test_hf_tokenizer_from_tiny_bpe(tmp_path):
    path = train_tiny_bpe(tmp_path / "tokenizer.json")
    tok = HFTokenizer(path, "<|endoftext|>")
    assert tok.vocab_size == 300 and tok.eod_id == 0
    ident = tok.identity()
    assert ident["name"] == "huggingface" and len(ident["sha256"]) == 64 and ident["eod_token"] == "<|endoftext|>"
    for text in TEXTS + DOCS[:3]:
        ids = tok.encode(text)
        assert ids.max(initial=0) < tok.vocab_size
        assert tok.decode(ids.tolist()) == text
    assert len(tok.encode(DOCS[5])) < len(DOCS[5].encode())  # it really merged something
    batch = tok.encode_batch(DOCS[:4])
    assert all(np.array_equal(a, tok.encode(d)) for a, d in zip(batch, DOCS[:4], strict=True))
    # A document quoting the special token must not produce the end-of-document id.
    assert tok.eod_id not in tok.encode("a <|endoftext|> b").tolist()
    # Truncation or padding saved with a tokenizer would cut documents: they are switched off.
    truncating = tokenizers.Tokenizer.from_file(str(path))
    truncating.enable_truncation(max_length=4)
    truncating.save(str(tmp_path / "truncating.json"))
    assert len(HFTokenizer(tmp_path / "truncating.json", "<|endoftext|>").encode(DOCS[5])) > 4
    # Pool workers get a rebuilt copy.
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.identity() == ident and np.array_equal(clone.encode(DOCS[1]), tok.encode(DOCS[1]))


def test_hf_tokenizer_errors(tmp_path):
    path = train_tiny_bpe(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"--eod-token.*\['<\|endoftext\|>'\]"):
        HFTokenizer(path, None)
    with pytest.raises(ValueError, match="'</s>' is not in the vocabulary"):
        HFTokenizer(path, "</s>")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_tokenizer(tmp_path / "missing.json", "<|endoftext|>")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        HFTokenizer(tmp_path / "bad.json", "x")
    assert HFTokenizer(tmp_path, "<|endoftext|>").path == path  # a folder holding tokenizer.json works too
