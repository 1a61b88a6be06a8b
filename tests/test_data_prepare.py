import gzip
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import k3train.data.prepare as prepare_mod
import k3train.data.sources as sources
from k3train.data import ByteTokenizer, HFTokenizer, PrepareError, ShardedTokenDataset, TokenData, prepare_dataset
from k3train.data.manifest import MANIFEST_NAME

from helpers.data import DOCS, VAL_DOCS, byte_stream, make_dataset, train_tiny_bpe, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokens(path, split):
    ds = ShardedTokenDataset(path, split)
    return ds.read(0, ds.num_tokens).astype(np.int64)


def test_formats_folders_globs_and_gz(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "PIECE_CHARS", 16)  # a .txt document arrives in many pieces, one eod at its end
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text(DOCS[0] + "\nsecond line\n" + DOCS[1])
    with gzip.open(corpus / "sub" / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"body": d}) + "\n\n" for d in DOCS[2:6]))  # blank lines are skipped
    with gzip.open(corpus / "c.txt.gz", "wt") as f:
        f.write(DOCS[6])
    write_jsonl(tmp_path / "x1.jsonl", DOCS[7:9], field="body")
    write_jsonl(tmp_path / "x2.jsonl", [DOCS[9], ""], field="body")  # the empty document is skipped
    (corpus / "notes.md").write_text("not an input")  # unsupported types inside a folder are ignored
    val = write_jsonl(tmp_path / "val.jsonl", VAL_DOCS, field="body")
    manifest = prepare_dataset(
        [corpus, str(tmp_path / "x*.jsonl")],
        tmp_path / "out",
        val_inputs=[val],
        text_field="body",
        shard_tokens=50,
        workers=1,
    )
    # Folder files are sorted by path: a.txt, c.txt.gz, sub/b.jsonl.gz; then the glob's x1, x2.
    expected = [DOCS[0] + "\nsecond line\n" + DOCS[1], DOCS[6], *DOCS[2:6], DOCS[7], DOCS[8], DOCS[9]]
    assert np.array_equal(tokens(tmp_path / "out", "train"), byte_stream(expected))
    assert np.array_equal(tokens(tmp_path / "out", "val"), byte_stream(VAL_DOCS))
    train = manifest["splits"]["train"]
    assert train["num_documents"] == len(expected) and train["max_token_id"] == 256
    assert len(train["shards"]) == -(-train["num_tokens"] // 50)
    assert manifest["dtype"] == "<u2" and manifest["tokenizer"] == ByteTokenizer().identity()


def test_val_fraction_split_is_deterministic_and_complete(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    a = prepare_dataset([src], tmp_path / "a", val_fraction=0.2, workers=1)
    b = prepare_dataset([src], tmp_path / "b", val_fraction=0.2, workers=1)
    assert a["fingerprint"] == b["fingerprint"]
    n_val = a["splits"]["val"]["num_documents"]
    assert a["splits"]["train"]["num_documents"] + n_val == len(DOCS)
    val_tokens, train_tokens = a["splits"]["val"]["num_tokens"], a["splits"]["train"]["num_tokens"]
    assert 0.1 < val_tokens / (val_tokens + train_tokens) < 0.3  # about val_fraction of the text
    # Every document lands in exactly one split, in corpus order.
    val_docs = [d for d in DOCS if d.encode() in bytes(tokens(tmp_path / "a", "val").astype(np.uint8))]
    train_docs = [d for d in DOCS if d not in val_docs]
    assert np.array_equal(tokens(tmp_path / "a", "train"), byte_stream(train_docs))
    assert np.array_equal(tokens(tmp_path / "a", "val"), byte_stream(val_docs))


def documents(path, split):
    """A byte-tokenized split's documents as text (the eod id 256 ends each)."""
    ids = tokens(path, split)
    ends = np.flatnonzero(ids == 256)
    assert len(ends) and ends[-1] == len(ids) - 1
    return [bytes(d[:-1].astype(np.uint8)).decode() for d in np.split(ids, ends + 1)[:-1]]


def test_val_fraction_holds_on_a_handful_of_files(tmp_path, capsys):
    # Five one-document files of very unequal sizes: no choice of whole files comes near 5% (whole files held
    # out 24% of the tokens here), so documents are cut, head to train and tail to val.
    sizes = [52_000, 9_000, 121_000, 6_500, 33_000]
    texts = ["".join(f"file {i} line {j:06d}\n" for j in range(size // 19)) for i, size in enumerate(sizes)]
    for i, text in enumerate(texts):
        (tmp_path / f"f{i}.txt").write_text(text)
    # In process (test_cli runs the real command): main() parses the same arguments and prints the same report.
    argv = [
        *(str(tmp_path / f"f{i}.txt") for i in range(len(texts))),
        "--output",
        str(tmp_path / "out"),
        "--val-fraction",
        "0.05",
    ]
    assert prepare_mod.main(argv) == 0
    splits = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["splits"]
    val, train = splits["val"]["num_tokens"], splits["train"]["num_tokens"]
    assert abs(val / (val + train) - 0.05) < 0.0005, val / (val + train)
    assert f"val: {val:,} tokens = {val / (val + train):.2%} of the tokens (asked 5.00%)" in capsys.readouterr().out
    # Every file's val part is its tail: its train head followed by its val tail gives back the file.
    heads, tails = documents(tmp_path / "out", "train"), documents(tmp_path / "out", "val")
    assert len(heads) == len(texts) and 0 < len(tails) <= len(texts)
    rest = [text.removeprefix(head) for head, text in zip(heads, texts, strict=True)]
    assert all(text.startswith(head) for head, text in zip(heads, texts, strict=True))
    assert [r for r in rest if r] == tails


def test_worker_pool_output_equals_in_process(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "CHUNK_CHARS", 200)  # many chunks, so the pool really interleaves them
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS * 3)
    one = prepare_dataset([src], tmp_path / "one", val_fraction=0.1, workers=1, shard_tokens=300)
    two = prepare_dataset([src], tmp_path / "two", val_fraction=0.1, workers=2, shard_tokens=300)
    assert one["fingerprint"] == two["fingerprint"] and one["splits"] == two["splits"]


def test_bpe_tokenizer_json(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "CHUNK_CHARS", 300)
    tok = HFTokenizer(train_tiny_bpe(tmp_path / "tokenizer.json"), "<|endoftext|>")
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    val = write_jsonl(tmp_path / "val.jsonl", VAL_DOCS)
    manifest = prepare_dataset([src], tmp_path / "bpe", tokenizer=tok, val_inputs=[val], workers=2)
    assert manifest["tokenizer"] == tok.identity() and manifest["vocab_size"] == 300
    expected = np.concatenate([np.append(tok.encode(d), tok.eod_id) for d in DOCS])
    assert np.array_equal(tokens(tmp_path / "bpe", "train"), expected)
    data = TokenData(tmp_path / "bpe")
    assert data.tokenizer().decode(tokens(tmp_path / "bpe", "val").tolist()) == "".join(
        d + "<|endoftext|>" for d in VAL_DOCS
    )


def test_bad_inputs_name_the_file(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    cases = {
        "does not exist": [tmp_path / "missing.txt"],
        "unsupported file type": [tmp_path / "x.csv"],
        "matched no": [str(tmp_path / "nothing*.txt")],
        "good.jsonl:1: no 'body' field": [good],
    }
    (tmp_path / "x.csv").write_text("a,b")
    for message, inputs in cases.items():
        with pytest.raises(PrepareError, match=message):
            prepare_dataset(inputs, tmp_path / "out", text_field="body", workers=1)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(PrepareError, match=r"bad.jsonl:2: not valid JSON"):
        prepare_dataset([tmp_path / "bad.jsonl"], tmp_path / "out", workers=1)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(PrepareError, match="latin1.txt: not UTF-8"):
        prepare_dataset([tmp_path / "latin1.txt"], tmp_path / "out", workers=1)
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(b"some text " * 100)[:-12])
    with pytest.raises(PrepareError, match="cut.txt.gz: corrupt or truncated gzip"):
        prepare_dataset([tmp_path / "cut.txt.gz"], tmp_path / "out", workers=1)
    (tmp_path / "plain.jsonl.gz").write_text("not gzip")
    with pytest.raises(PrepareError, match="plain.jsonl.gz: corrupt or truncated gzip"):
        prepare_dataset([tmp_path / "plain.jsonl.gz"], tmp_path / "out", workers=1)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PrepareError, match="train split is empty.*empty input"):
        prepare_dataset([tmp_path / "empty.jsonl"], tmp_path / "out", workers=1)
    write_jsonl(tmp_path / "one.jsonl", ["a single document"])
    with pytest.raises(PrepareError, match="val split is empty.*--val-inputs"):
        prepare_dataset([tmp_path / "one.jsonl"], tmp_path / "out", workers=1)
    with pytest.raises(PrepareError, match="in both"):
        prepare_dataset([good], tmp_path / "out", val_inputs=[good], workers=1)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp directories left behind


def test_token_id_beyond_vocab_is_refused(tmp_path):
    class Broken(ByteTokenizer):
        vocab_size = 200  # claims fewer ids than the bytes it emits

    src = write_jsonl(tmp_path / "docs.jsonl", ["ÿÿÿ", "ok"])
    with pytest.raises(PrepareError, match=r"token id 256 >= its vocab_size 200"):
        prepare_dataset([src], tmp_path / "out", tokenizer=Broken(), val_fraction=0.5, workers=1)


def test_existing_output_needs_overwrite(tmp_path):
    out = make_dataset(tmp_path)
    first = json.loads((out / MANIFEST_NAME).read_text())
    with pytest.raises(FileExistsError, match="already exists"):
        make_dataset(tmp_path)
    make_dataset(tmp_path, shard_tokens=10_000, overwrite=True)
    second = json.loads((out / MANIFEST_NAME).read_text())
    # Same tokens, other shard layout: the fingerprint pins the stream, not the file cut.
    assert first["fingerprint"] == second["fingerprint"] and len(second["splits"]["train"]["shards"]) == 1
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not a prepared dataset"):
        make_dataset(tmp_path, name="mine", overwrite=True)
    assert (tmp_path / "mine" / "precious.txt").exists()


def _killed_mid_prepare(out):
    def stream():
        for i, doc in enumerate(DOCS * 50):
            if i == 1000:
                os.kill(os.getpid(), signal.SIGKILL)
            yield "train", doc, True

    prepare_mod.CHUNK_CHARS = 1000  # shards are being written when the kill lands
    prepare_mod.write_dataset(stream(), out, ByteTokenizer(), source={}, shard_tokens=5000)


def test_killed_prepare_never_looks_complete(tmp_path):
    out = tmp_path / "ds"
    proc = mp.get_context("fork").Process(target=_killed_mid_prepare, args=(out,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    assert not out.exists()
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ds.tmp-")]
    assert any(leftover.glob("train_*.bin")) and not (leftover / MANIFEST_NAME).exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenData(out)
    with pytest.raises(FileNotFoundError, match="no manifest.json.*interrupted"):
        TokenData(leftover)
    make_dataset(tmp_path)  # the leftover does not block a new prepare
    assert TokenData(out).train.num_tokens == len(byte_stream(DOCS))


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "k3train.prepare", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow
def test_cli(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    ok = run_cli(src, "--output", tmp_path / "out", "--val-fraction", "0.2", "--shard-tokens", "500", "--workers", "2")
    assert ok.returncode == 0, ok.stderr
    assert "prepared" in ok.stdout and "vocab_size 257" in ok.stdout
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 1 and manifest["vocab_size"] == 257 and manifest["dtype"] == "<u2"
    assert manifest["source"]["val_fraction"] == 0.2 and manifest["source"]["inputs"] == [str(src.resolve())]
    assert sum(len(s["shards"]) for s in manifest["splits"].values()) > 2
    assert manifest["splits"]["train"]["num_tokens"] + manifest["splits"]["val"]["num_tokens"] == len(byte_stream(DOCS))

    again = run_cli(src, "--output", tmp_path / "out", "-q")
    assert again.returncode == 2 and "already exists" in again.stderr and again.stdout == ""
    bad = run_cli(tmp_path / "nope.jsonl", "--output", tmp_path / "out2")
    assert bad.returncode == 2 and "nope.jsonl does not exist" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "out2").exists()
