"""Bad input on the Hugging Face path (docs/errors.md): a corrupt safetensors file, an absurd config.json and
`--shard-size 0` are refused with exit 2 and one line naming what was wrong; a full disk in export (either format)
or import_hf fails with exit 1 and one line, leaving nothing at OUT_DIR; an export follows the umask and fills an
existing empty directory, a mount point included, in place.

The CLIs' main() is called in this process (`python -m` raises SystemExit(main())): its return value is the exit
status, and an exception it let through would fail the test as a traceback would. The tmpfs cases mount one (root
only: skipped, saying why, where mounting is not permitted); each also has a case without a mount."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
from safetensors import SafetensorError
from test_hf import KIMI_LINEAR, hf_dir

from k3train.export import main as export_main
from k3train.hf import HFFormatError
from k3train.hf import shards as shards_module
from k3train.hf.shards import INDEX_FILE, SINGLE_FILE, ShardedSafetensors
from k3train.import_hf import main as import_main

pytestmark = pytest.mark.usefixtures("one_thread")

FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"  # what safetensors raises


def error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


# --- a corrupt safetensors file -----------------------------------------------------------------------------------


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _garbage_header(data: bytes) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    return data[:8] + b"\xff\xfe not a JSON header " * (n // 20) + b"!" * (n % 20) + data[8 + n :]


def _huge_header_length(data: bytes) -> bytes:
    return struct.pack("<Q", 2**60) + data[8:]


def _offsets_past_the_end(data: bytes) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10**9
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


CORRUPTIONS = {
    "truncated": (_truncated, "file not fully covered"),
    "garbage header": (_garbage_header, "invalid UTF-8"),
    "huge header length": (_huge_header_length, "header too large"),
    "offsets past the end": (_offsets_past_the_end, "offset for tensor"),
}


def corrupt(path: Path, how: str) -> None:
    path.write_bytes(CORRUPTIONS[how][0](path.read_bytes()))


@pytest.mark.parametrize("how", list(CORRUPTIONS))
@pytest.mark.parametrize("layout", ["shards", "single file"])
def test_a_corrupt_safetensors_file_is_refused_naming_it(tmp_path, how, layout) -> None:
    source = hf_dir(tmp_path)
    if layout == "single file":
        reader = ShardedSafetensors(source)
        tensors = {k: reader.get(k) for k in reader.keys()}
        for file in source.glob("model*.safetensors*"):
            file.unlink()
        shards_module.write_shards(tensors.items(), source, max_shard_bytes=10**9)
    bad = source / (SINGLE_FILE if layout == "single file" else "model-00002-of-00003.safetensors")
    assert bad.is_file() and (layout == "single file") != (source / INDEX_FILE).is_file()
    corrupt(bad, how)
    with pytest.raises(HFFormatError, match=f"{bad} is no readable safetensors file .*{CORRUPTIONS[how][1]}"):
        reader = ShardedSafetensors(source)
        for _ in reader.items():
            pass


@pytest.mark.parametrize("how", ["truncated", "garbage header"])
def test_import_hf_of_a_corrupt_shard_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, how) -> None:
    source = hf_dir(tmp_path)
    corrupt(source / "model-00001-of-00003.safetensors", how)
    assert import_main([str(source), str(tmp_path / "out")]) == 2
    line = error_line(capsys, "k3train.import_hf")
    assert "model-00001-of-00003.safetensors is no readable safetensors file" in line and "again" in line
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_init_from_a_corrupt_shard_is_refused_as_bad_input(monkeypatch, tmp_path, tiny_data_dir) -> None:
    from test_hf import model_overrides

    from helpers.config import built_run

    source = hf_dir(tmp_path)
    corrupt(source / "model-00003-of-00003.safetensors", "truncated")
    with pytest.raises(HFFormatError, match="model-00003-of-00003.safetensors is no readable safetensors file"):
        built_run(
            monkeypatch, tmp_path / "run", tiny_data_dir, *model_overrides(KIMI_LINEAR), f"train.init_from={source}",
            model="kimi_linear_tiny",
        )  # fmt: skip
    assert not (tmp_path / "run").exists()


# --- an absurd config.json -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value", [("vocab_size", 10**12), ("hidden_size", 10**9), ("num_experts", 10**9)], ids=str
)
def test_a_config_describing_a_model_bigger_than_memory_is_refused_before_it_is_built(
    tmp_path, capsys, field, value
) -> None:
    source = hf_dir(tmp_path, config_edit=lambda c: c.update({field: value}))
    assert import_main([str(source), str(tmp_path / "out")]) == 2
    line = error_line(capsys, "k3train.import_hf")
    assert "config.json describes a model of" in line and "GiB of memory: check its sizes" in line, line
    assert not (tmp_path / "out").exists()


# --- a full disk ---------------------------------------------------------------------------------------------------


def export_to(fmt: str, source: Path, out: Path) -> int:
    if fmt == "import_hf":
        return import_main([str(source), str(out)])
    return export_main([str(source), str(out), "--format", fmt])


PROGS = {"hf": "k3train.export", "k3train": "k3train.export", "import_hf": "k3train.import_hf"}


@pytest.mark.parametrize("fmt", list(PROGS))
@pytest.mark.parametrize("into", ["a new directory", "the mount point"])
def test_a_full_disk_exits_1_with_one_line_and_leaves_nothing(tmp_path, capsys, tmpfs, fmt, into) -> None:
    source = hf_dir(tmp_path)  # 270 KB of weights
    disk = tmpfs("128k", tmp_path / "disk")
    out = disk / "out" if into == "a new directory" else disk
    assert export_to(fmt, source, out) == 1
    assert "No space left on device" in error_line(capsys, PROGS[fmt])
    assert list(disk.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["disk", "hf"]


@pytest.mark.parametrize("fmt", list(PROGS))
def test_a_full_disk_as_safetensors_reports_it_exits_1_with_one_line(tmp_path, capsys, monkeypatch, fmt) -> None:
    """Without a mount: safetensors' writer fails as it does on a full disk, after writing part of the file."""
    import safetensors.torch

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"part of a shard")
        raise SafetensorError(FULL_DISK)

    source = hf_dir(tmp_path)
    monkeypatch.setattr(shards_module, "save_file", full)
    monkeypatch.setattr(safetensors.torch, "save_file", full)  # what save_model calls
    assert export_to(fmt, source, tmp_path / "out") == 1
    assert "No space left on device" in error_line(capsys, PROGS[fmt])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no OUT_DIR, no temporary directory


# --- permissions and the output directory --------------------------------------------------------------------------


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("fmt", ["hf", "k3train"])
def test_an_export_follows_the_umask(tmp_path, umask_022, fmt) -> None:
    source = hf_dir(tmp_path)
    assert export_main([str(source), str(tmp_path / "out"), "--format", fmt, "--shard-size", "100KB"]) == 0
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert len(modes) >= 2 and set(modes.values()) == {0o644}, modes


def test_an_existing_empty_directory_is_filled_in_place(tmp_path, monkeypatch, umask_022) -> None:
    from k3train.inference.loading import load

    made: list[Path] = []
    real = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(Path(kwargs.get("dir") or tempfile.gettempdir()))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    source = hf_dir(tmp_path)
    out = tmp_path / "empty"
    out.mkdir(mode=0o700)
    assert export_main([str(source), str(out), "--format", "hf"]) == 0
    assert made == [out]  # written on OUT_DIR's own filesystem, never beside it
    assert out.stat().st_mode & 0o777 == 0o700  # the user's directory keeps its mode
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf"] and not list(out.glob(".*"))
    assert load(out).model.config.d_model == KIMI_LINEAR["d_model"]


@pytest.mark.parametrize("fmt", ["hf", "k3train"])
def test_an_export_into_a_mount_point_lands_on_it(tmp_path, tmpfs, fmt) -> None:
    from k3train.inference.loading import load

    source = hf_dir(tmp_path)
    disk = tmpfs("16m", tmp_path / "disk")
    assert export_main([str(source), str(disk), "--format", fmt]) == 0
    assert load(disk).model.config.d_model == KIMI_LINEAR["d_model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "hf"] and not list(disk.glob(".*"))


def test_an_export_fails_when_the_directory_fills_meanwhile(tmp_path, capsys, monkeypatch) -> None:
    """Someone else's file appears in the empty OUT_DIR while it is written: it is left, nothing is added."""
    from k3train.inference import writing

    real = writing.write_hf

    def write_hf(adapter, model, tokenizer, out, *args):
        (out.parent / "theirs.txt").write_text("theirs")
        return real(adapter, model, tokenizer, out, *args)

    monkeypatch.setattr(writing, "write_hf", write_hf)
    source = hf_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert export_main([str(source), str(tmp_path / "empty"), "--format", "hf"]) == 2
    assert "was filled while it was being written" in error_line(capsys, "k3train.export")
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["theirs.txt"]


def test_a_failed_fill_leaves_the_empty_directory_empty(tmp_path) -> None:
    """No stale `.empty.tmp-*` inside it, for a later export to meet as "already exists"."""
    from k3train.inference.writing import _output_directory

    out = tmp_path / "empty"
    out.mkdir()
    with pytest.raises(RuntimeError), _output_directory(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")
    assert list(out.iterdir()) == []
