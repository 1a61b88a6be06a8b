"""Sharded safetensors as Hugging Face writes and reads them, streamed: a checkpoint bigger than memory is written from
an iterator holding one shard at a time, and read back shard by shard, one tensor at a time.

The layout is transformers' save_pretrained (with huggingface_hub's split_torch_state_dict_into_shards):
    https://github.com/huggingface/transformers/blob/main/src/transformers/modeling_utils.py
    https://github.com/huggingface/huggingface_hub/blob/main/src/huggingface_hub/serialization/_base.py
Everything in one shard is a single `model.safetensors` and no index; otherwise `model-00001-of-0000N.safetensors`
... plus `model.safetensors.index.json`, {"metadata": {"total_size": <bytes of tensor data>}, "weight_map":
{name: shard file}}, written as transformers does (indent 2, sorted keys). Shards fill in the order the tensors come,
a new one starting when the next tensor would take the current one over max_shard_bytes; a tensor bigger than that
gets a shard of its own. Each file's header carries {"format": "pt"} as transformers writes it (the safetensors
format: https://github.com/huggingface/safetensors#format).

safetensors reports a file it cannot parse, and a failed write, as its own SafetensorError (no ValueError, no
OSError: nothing that would catch bad input or a full disk catches it). Here the first is an HFFormatError naming
the file, the second the OSError it is (safetensors_os_errors), so a caller sees the two kinds it already handles.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from k3train.files import temp_path, write_atomic
from k3train.hf import HFFormatError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' message carries the errno of a failed read or write


@contextlib.contextmanager
def safetensors_os_errors(path: Path) -> Iterator[None]:
    """Inside: a SafetensorError that is a failed read or write (a full disk: "I/O error: No space left on device
    (os error 28)") is raised as that OSError, naming path; any other is left as it is."""
    try:
        yield
    except SafetensorError as exc:
        match = _OS_ERROR.search(str(exc))
        if match is None:
            raise
        code = int(match[1])
        raise OSError(code, os.strerror(code), str(path)) from None


@contextlib.contextmanager
def _opened(path: Path) -> Iterator:
    """safe_open(path); a file safetensors cannot parse (truncated, a garbage header or header length, offsets past
    its end) is an HFFormatError naming it. safetensors checks the whole header and that the data covers it on
    opening, before any tensor is read."""
    try:
        with safetensors_os_errors(path), safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as exc:
        reason = str(exc).replace("Error while deserializing header: ", "header: ")
        raise HFFormatError(
            f"{path} is no readable safetensors file ({reason}): it is truncated or corrupt; download or write it again"
        ) from None


def shard_name(index: int, count: int) -> str:
    """transformers' name for shard index (1-based) of count."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # what the file holds; a view's whole storage is not written


def write_shards(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    max_shard_bytes: int,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write (name, tensor) pairs into out_dir as sharded safetensors; returns the weight files' names in order.

    Consumes the iterable lazily and holds at most one shard's tensors at a time (plus the tensor that did not fit,
    while the full shard is written), so a caller that produces tensors on demand never has the whole checkpoint in
    memory; a shard is written as soon as it is full. The shard count is
    only known at the end, so shards are written under temporary names (`.model-00001.safetensors.tmp-<pid>`) and
    renamed once the iterable is exhausted; the index is written last, atomically, and weight files of an earlier
    save into the same directory that this one does not replace are then deleted. The directory as a whole is not
    replaced atomically: for that, write into k3train.files.atomic_directory. An exception before the renames (from
    the iterable, a full disk, a name seen twice: ValueError) removes the temporary shards and leaves the directory as
    it was. metadata goes into every file's header, beside {"format": "pt"}."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {"format": "pt", **(metadata or {})}
    temps: list[Path] = []  # one per shard, in order
    shard_keys: list[list[str]] = []
    seen: set[str] = set()
    total = 0
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0

    def flush() -> None:
        nonlocal current, current_bytes
        tmp = temp_path(out_dir / f"model-{len(temps) + 1:05d}.safetensors")
        temps.append(tmp)  # before writing, so a failed write is cleaned up too
        with safetensors_os_errors(tmp):
            save_file(current, str(tmp), metadata=header)
        _fsync(tmp)
        shard_keys.append(list(current))
        current, current_bytes = {}, 0  # drop this shard's tensors before the next one is gathered

    try:
        for name, tensor in tensors:
            if name in seen:
                raise ValueError(f"tensor name {name!r} appears twice")
            seen.add(name)
            size = _nbytes(tensor)
            if current and current_bytes + size > max_shard_bytes:
                flush()
            current[name] = tensor.contiguous()
            del tensor  # so a flush below leaves no reference to this shard's last tensor while the next one is made
            current_bytes += size
            total += size
            if current_bytes >= max_shard_bytes:  # full, or one tensor over the limit: no other tensor joins it
                flush()
        if current or not temps:  # an empty checkpoint is still one (empty) file
            flush()
        names = [SINGLE_FILE] if len(temps) == 1 else [shard_name(i + 1, len(temps)) for i in range(len(temps))]
        for tmp, name in zip(temps, names):
            os.replace(tmp, out_dir / name)
    except BaseException:
        for tmp in temps:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        raise

    if len(names) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {key: name for name, keys in zip(names, shard_keys) for key in keys},
        }
        write_atomic(
            out_dir / INDEX_FILE, lambda f: f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        )
    _remove_stale(out_dir, keep=set(names) | ({INDEX_FILE} if len(names) > 1 else set()))
    return names


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _remove_stale(out_dir: Path, keep: set[str]) -> None:
    """Delete weight files of an earlier save that this one did not write (transformers does the same), so a reader
    never mixes the two."""
    for path in out_dir.iterdir():
        name = path.name
        if name in keep:
            continue
        if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(name):
            path.unlink(missing_ok=True)


class ShardedSafetensors:
    """Read a Hugging Face safetensors checkpoint directory: model.safetensors.index.json and its shards, or a single
    model.safetensors (preferred when both exist, as transformers prefers it).

    Opening reads the index and checks that every shard it names exists. That each key the index puts in a shard is
    really there is checked when that shard is first opened, before any of its tensors is returned. items() goes
    shard by shard with one file open and one tensor materialised at a time (the open file is memory-mapped, so the
    pages read so far count in the process's RSS until the shard is closed)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        single, index = self.directory / SINGLE_FILE, self.directory / INDEX_FILE
        if single.is_file():
            with _opened(single) as f:
                self._weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
            self._checked = {SINGLE_FILE}
        elif index.is_file():
            self._weight_map = self._read_index(index)
            self._checked = set()
        else:
            where = "" if self.directory.is_dir() else " (no such directory)"
            raise HFFormatError(f"{self.directory}{where} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
        self._shards: dict[str, list[str]] = {}  # file -> its keys, in index order
        for key, file in self._weight_map.items():
            self._shards.setdefault(file, []).append(key)

    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HFFormatError(f"{index} cannot be read as JSON: {exc}") from exc
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise HFFormatError(f'{index} has no "weight_map" object of tensor name -> shard file name')
        for file in sorted(set(weight_map.values())):
            # a plain name: a shard outside the directory ("../x") is not this checkpoint's
            if Path(file).name != file or file in ("", ".", ".."):
                raise HFFormatError(f"{index} names shard {file!r}, which is not a file name in {self.directory}")
        missing = [file for file in sorted(set(weight_map.values())) if not (self.directory / file).is_file()]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise HFFormatError(f"{', '.join(missing)}, named by {INDEX_FILE}, {verb} missing from {self.directory}")
        return weight_map

    def __len__(self) -> int:
        return len(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def files(self) -> list[str]:
        """The weight files, in the order items() reads them."""
        return sorted(self._shards)

    def shard_of(self, name: str) -> str:
        """The file (a name within the directory) that holds tensor `name`."""
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.directory}") from None

    @contextlib.contextmanager
    def _open(self, file: str) -> Iterator:
        with _opened(self.directory / file) as f:
            if file not in self._checked:
                present = set(f.keys())
                for key in self._shards[file]:
                    if key not in present:
                        raise HFFormatError(f"{key}, which {INDEX_FILE} puts in {file}, is not in that file")
                self._checked.add(file)
            yield f

    @contextlib.contextmanager
    def open_for(self, name: str) -> Iterator:
        """The open shard that holds tensor `name` (its keys checked on first opening), to read slices of it."""
        with self._open(self.shard_of(name)) as f:
            yield f

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read on its own (opens its shard for the one read)."""
        file = self.shard_of(name)
        with self._open(file) as f:
            return f.get_tensor(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every (name, tensor), shard by shard: one shard open and one tensor read at a time. The consumer decides
        how many it keeps; copying each into its destination and dropping it keeps memory at one tensor."""
        for file in self.files():
            with self._open(file) as f:
                for key in self._shards[file]:
                    yield key, f.get_tensor(key)
