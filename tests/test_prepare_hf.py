"""prepare on Hugging Face `datasets` files (.parquet, .arrow): local only, the same dataset as the same text in
.jsonl, the same whatever the worker count; bad input in one line, nothing written."""

import json
import re
import socket
import sys

import pytest

import k3train.data.prepare as prepare_mod
from k3train.data import HFTokenizer, PrepareError, prepare_dataset
from k3train.data.manifest import MANIFEST_NAME

from helpers.data import DOCS, VAL_DOCS, train_tiny_bpe, write_jsonl

# Empty documents are skipped in every format; the rest of a row (an id) is ignored.
ROWS = [*DOCS[:20], "", *DOCS[20:]]


def files_of(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def same_dataset(a, b):
    """The same prepared dataset: every shard bitwise, and the manifest but for where the text came from."""
    fa, fb = files_of(a), files_of(b)
    ma, mb = (json.loads(f.pop(MANIFEST_NAME)) for f in (fa, fb))
    assert fa == fb
    assert {k: v for k, v in ma.items() if k != "source"} == {k: v for k, v in mb.items() if k != "source"}


@pytest.fixture
def tables(tmp_path):
    """ROWS written as .parquet (several row groups), .arrow (save_to_disk's stream format and an IPC file) and
    .jsonl by datasets/pyarrow."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(ROWS))), "text": ROWS})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=7)
    datasets.Dataset(table).save_to_disk(tmp_path / "saved")
    (saved,) = (tmp_path / "saved").glob("*.arrow")
    with pa.OSFile(str(tmp_path / "docs.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    datasets.Dataset(table).to_json(tmp_path / "hf.jsonl")
    return {
        "parquet": tmp_path / "docs.parquet",
        "save_to_disk arrow": saved,
        "arrow file": tmp_path / "docs.arrow",
        "datasets jsonl": tmp_path / "hf.jsonl",
    }


def test_tables_give_the_jsonl_dataset(tmp_path, tables, monkeypatch):
    monkeypatch.setattr(prepare_mod, "CHUNK_CHARS", 300)  # many chunks and shards
    reference = write_jsonl(tmp_path / "ref.jsonl", ROWS)
    prepare_dataset([reference], tmp_path / "ref", val_fraction=0.1, shard_tokens=500, workers=1)

    connects = []  # datasets swallows a failed request (its download counts): record them, do not raise

    def no_network(*args, **kwargs):
        connects.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    for name, path in tables.items():
        out = tmp_path / name.replace(" ", "_")
        manifest = prepare_dataset([path], out, val_fraction=0.1, shard_tokens=500, workers=1)
        same_dataset(tmp_path / "ref", out)
        assert manifest["source"]["inputs"] == [str(path.resolve())], name
    assert connects == []


def test_workers_and_val_inputs_bitwise(tmp_path, tables, monkeypatch):
    monkeypatch.setattr(prepare_mod, "CHUNK_CHARS", 200)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": VAL_DOCS}), tmp_path / "val.parquet")
    tok = HFTokenizer(train_tiny_bpe(tmp_path / "tokenizer.json"), "<|endoftext|>")
    inputs = [tables["parquet"], tables["arrow file"]]
    one = prepare_dataset(inputs, tmp_path / "one", tokenizer=tok, val_inputs=[tmp_path / "val.parquet"], workers=1)
    two = prepare_dataset(inputs, tmp_path / "two", tokenizer=tok, val_inputs=[tmp_path / "val.parquet"], workers=2)
    assert one == two
    same_dataset(tmp_path / "one", tmp_path / "two")
    assert one["splits"]["train"]["num_documents"] == 80 and one["splits"]["val"]["num_documents"] == 2
    ref = write_jsonl(tmp_path / "ref.jsonl", ROWS * 2)
    prepare_dataset([ref], tmp_path / "ref", tokenizer=tok, val_inputs=[write_jsonl(tmp_path / "v.jsonl", VAL_DOCS)])
    same_dataset(tmp_path / "ref", tmp_path / "one")


def test_bad_table_inputs_one_line_nothing_written(tmp_path, tables, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "nofield.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "null.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "junk.arrow").write_bytes(b"not arrow either")
    whole = tables["save_to_disk arrow"].read_bytes()
    (tmp_path / "cut.arrow").write_bytes(whole[: len(whole) // 2])  # a stream cut mid-way: its schema reads
    cases = {
        "'allenai/c4' is no local file or folder; if it names a Hugging Face hub dataset, prepare never downloads": (
            "allenai/c4"
        ),
        "'hf://datasets/HuggingFaceFW/fineweb' is no local": "hf://datasets/HuggingFaceFW/fineweb",
        "missing.parquet does not exist": tmp_path / "missing.parquet",
        "nofield.parquet: no 'text' column \\(found \\['body'\\]\\); choose the text field with --text-field": (
            tmp_path / "nofield.parquet"
        ),
        "ints.parquet: column 'text' is int64, not a string": tmp_path / "ints.parquet",
        "null.parquet: row 1 \\(from 0\\): 'text' is null": tmp_path / "null.parquet",
        "junk.parquet: not a readable parquet file": tmp_path / "junk.parquet",
        "junk.arrow: not a readable arrow file": tmp_path / "junk.arrow",
        "cut.arrow: not a readable arrow file": tmp_path / "cut.arrow",
    }
    for message, spec in cases.items():
        argv = [str(tables["parquet"]), str(spec), "--output", str(tmp_path / "out"), "--workers", "1"]
        assert prepare_mod.main(argv) == 2, message
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert re.search(message, captured.err), captured.err
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_a_parquet_file_with_a_broken_footer_is_one_line_of_ours(tmp_path):
    """datasets logs its own "Failed to read schema" line for it (to the stderr it captured at import, which
    pytest's capsys does not see): the command itself prints our one line only."""
    import subprocess
    import sys

    junk = tmp_path / "footer.parquet"
    junk.write_bytes(b"PAR1" + b"garbage" * 50 + b"PAR1")  # the magic, then nonsense: its footer is read
    proc = subprocess.run(
        [sys.executable, "-m", "k3train.prepare", str(junk), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "footer.parquet: not a readable parquet file" in proc.stderr, proc.stderr


def test_without_datasets(tmp_path, monkeypatch, capsys):
    """k3train prepares .jsonl without datasets; a .parquet input then says how to get it, in one line, exit 2."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    assert prepare_mod.main([str(src), "--output", str(tmp_path / "ok"), "-q"]) == 0
    (tmp_path / "docs.parquet").write_bytes(b"never read")
    assert prepare_mod.main([str(src), str(tmp_path / "docs.parquet"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "docs.parquet: reading .parquet files needs" in err
    assert err.rstrip().endswith("pip install datasets") and not (tmp_path / "out").exists()
    with pytest.raises(PrepareError, match="pip install datasets"):
        prepare_dataset([tmp_path / "docs.parquet"], tmp_path / "out")
