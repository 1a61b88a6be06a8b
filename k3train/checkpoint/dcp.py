"""Sharded checkpoints (FSDP2): a directory that torch.distributed.checkpoint (DCP) fills with every rank's shards.

A checkpoint is the same tree of parts as a single-file one (checkpoint.py). Its sharded tensors (DTensors: FSDP2
parameters and the optimizer state made like them, routed experts under expert parallelism: expert_shards.py) are
replaced by placeholders `{"__dcp__": key, "shape", "dtype", "mesh"}` (mesh: the names of the mesh's dimensions)
and saved with `dcp.save`, each rank writing its own shards; the rest of the tree (meta, counters, loader
cursors, RNG, buffers: the same on every rank) is rank 0's `extra.pt`. Reading allocates each placeholder with
`make_shard(shape, dtype, mesh)` (a DTensor laid out as this run holds that kind of tensor, or a whole plain
tensor) and lets `dcp.load` fill it, so a checkpoint saved by N ranks loads on M ranks, or in one process
(consolidate.py). Written in the background (train.checkpoint_async), the same directory is
filled by DCP's async_save with its process-based executor, each rank's writer process writing that rank's shards
(ShardedWrite, start_sharded_write), and renamed into place once every rank's writer has ended.

Opening a checkpoint never runs code from it. DCP itself reads `.metadata` with a plain `pickle.load` and
non-tensor entries with `torch.load(weights_only=False)` (torch 2.13's filesystem.py and default_planner.py:
https://github.com/pytorch/pytorch/blob/cf30153c4c131c8164ee7798e5022d810682e2cb/torch/distributed/checkpoint/filesystem.py
). So here `.metadata` is read by an unpickler that only builds DCP's own metadata
classes (anything else is refused), its entries must all be tensors (tensor data is read with weights_only=True),
and extra.pt is read with torch.load(weights_only=True) (safe_load, which single-file checkpoints use too). A file
that names any other global (a function or class, e.g. posix.system) is refused with CodeRefused, naming it.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import pickletools
import re
import shutil
import threading
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor

from k3train.files import _os_error, atomic_directory, commit_directory, temp_directory, temp_path

MakeShard = Callable[[torch.Size, torch.dtype, tuple[str, ...]], torch.Tensor]
EXTRA = "extra.pt"  # rank 0's part: the tree with placeholders where the sharded tensors go
PLACEHOLDER = "__dcp__"


class CodeRefused(ValueError):
    """A checkpoint file that names a global outside what a checkpoint may hold: code k3train will not run."""

    def __init__(self, path: str | os.PathLike, name: str, why: str = "a global no checkpoint may hold"):
        self.path, self.name = Path(path), name
        super().__init__(
            f"{path} holds code, which k3train will not run: it names {name}, {why}; it was not written by "
            "k3train, or was altered since: do not use it; resume from a checkpoint you trust"
        )


# torch's refusals that name the global: "Trying to load unsupported GLOBAL posix.system whose module posix is
# blocked." and "Unsupported global: GLOBAL posix.system was not an allowed global by default." (torch 2.13)
_TORCH_GLOBAL = re.compile(r"GLOBAL (\S+?) (?:whose|was)")
# torch's boilerplate around the reason, which advises loading with weights_only=False: never repeated here
_TORCH_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")


def safe_load(path: Path, mmap: bool = False) -> Any:
    """torch.load(path, weights_only=True), on the CPU (`mmap`: memory-mapped, a tensor's pages read when
    touched). A file naming a global outside torch's allow-list raises CodeRefused; any other refusal of the
    weights-only unpickler raises pickle.UnpicklingError with torch's reason alone (not its advice to load with
    weights_only=False, which would run the file's code)."""
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": a foreign pickle, refused just below
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = _TORCH_GLOBAL.search(str(exc))
        name = found.group(1) if found else None
        if name is None or "." not in name:  # torch drops "builtins." from a builtin's name: read it in the file
            name = next(iter(_unsafe_globals(path)), name)
        if name is not None:
            raise CodeRefused(path, name) from None
        raise pickle.UnpicklingError(_torch_reason(str(exc))) from None


def _torch_reason(message: str) -> str:
    """torch's weights-only refusal without its boilerplate, in one line."""
    lines = [line.strip() for line in message.splitlines()]
    reason = [line.removeprefix("WeightsUnpickler error:").strip() for line in lines if line]
    reason = [line for line in reason if line and not line.startswith(_TORCH_ADVICE) and "weights_only" not in line]
    return "; ".join(reason) or "the weights-only unpickler refused it"


def _unsafe_globals(path: Path) -> list[str]:
    """The globals a checkpoint's pickle names that torch's weights-only unpickler does not allow, found by
    reading its opcodes (pickletools.genops runs nothing); [] when there are none or the file cannot be parsed."""
    try:
        if zipfile.is_zipfile(path):  # torch.save's format: the pickle is data.pkl, the tensors other records
            with zipfile.ZipFile(path) as archive:
                pickles = [archive.read(n) for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"]
        else:  # a plain pickle: it starts the file
            with open(path, "rb") as f:
                pickles = [f.read(1 << 24)]
    except (OSError, zipfile.BadZipFile, ValueError):
        return []
    from torch import _weights_only_unpickler as allowed

    safe = set(allowed._get_allowed_globals()) | set(allowed._get_user_allowed_globals())
    return [name for pkl in pickles for name in _pickle_globals(pkl) if name not in safe]


def _pickle_globals(data: bytes) -> list[str]:
    """Every global (module.name) the pickle at the start of `data` names, in order: GLOBAL and INST carry it, and
    STACK_GLOBAL takes the two strings pushed (or fetched from the memo) just before it."""
    names, pushed, memo = [], [], {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                names.append(arg.replace(" ", "."))
                pushed.append(None)
            elif op.name == "STACK_GLOBAL":
                if len(pushed) >= 2 and isinstance(pushed[-2], str) and isinstance(pushed[-1], str):
                    names.append(f"{pushed[-2]}.{pushed[-1]}")
                pushed.append(None)
            elif op.name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = pushed[-1] if pushed else None
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(arg))
            elif op.name in ("FRAME", "PROTO", "STOP"):
                continue
            else:
                pushed.append(arg if isinstance(arg, str) else None)
    except (ValueError, EOFError):  # a truncated or foreign file: the globals read so far
        pass
    return names


def whole_tensor(shape: torch.Size, dtype: torch.dtype, mesh: tuple[str, ...] = ()) -> torch.Tensor:
    """A placeholder read whole, as a plain CPU tensor (one process, DDP, consolidation)."""
    return torch.empty(shape, dtype=dtype)


def split_shards(tree: Any, prefix: str = "") -> tuple[Any, dict[str, DTensor]]:
    """(the tree with each DTensor replaced by a placeholder, {key: DTensor}); keys are the '/'-joined path."""
    if isinstance(tree, DTensor):
        mesh = list(tree.device_mesh.mesh_dim_names or ())
        dtype = str(tree.dtype).removeprefix("torch.")
        return {PLACEHOLDER: prefix, "shape": list(tree.shape), "dtype": dtype, "mesh": mesh}, {prefix: tree}
    shards: dict[str, DTensor] = {}
    if isinstance(tree, dict):
        out = type(tree)() if type(tree) is not dict else {}
        for k, v in tree.items():
            out[k], found = split_shards(v, f"{prefix}/{k}" if prefix else str(k))
            shards.update(found)
        return out, shards
    if isinstance(tree, list):
        out = []
        for i, v in enumerate(tree):
            item, found = split_shards(v, f"{prefix}/{i}")
            out.append(item)
            shards.update(found)
        return out, shards
    return tree, shards


def _placeholders(tree: Any):
    if isinstance(tree, dict) and PLACEHOLDER in tree:
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _placeholders(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _placeholders(v)


def _fill(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict) and PLACEHOLDER in tree:
        return tensors[tree[PLACEHOLDER]]
    if isinstance(tree, dict):
        for k, v in tree.items():
            tree[k] = _fill(v, tensors)
    elif isinstance(tree, list):
        tree[:] = [_fill(v, tensors) for v in tree]
    return tree


def merge_trees(trees: list) -> Any:
    """The union of state trees whose dicts hold different keys (a pipeline's stages: each rank its own layers and
    their optimizer state, under the whole model's names and numbers); where several hold a key, the first's."""
    first = trees[0]
    if not isinstance(first, dict) or PLACEHOLDER in first:
        return first
    out = dict(first)
    for tree in trees[1:]:
        for k, v in tree.items():
            out[k] = merge_trees([out[k], v]) if k in out else v
    return out


def write_sharded(directory: Path, tree: Any, writer: bool, merge_group: dist.ProcessGroup | None = None) -> int:
    """Save `tree` as a sharded checkpoint at `directory` (a new name), atomically: a collective, every rank calls
    it; `writer` (rank 0) writes extra.pt and renames the complete directory into place. Returns the bytes on disk
    (0 on other ranks). With `merge_group` (the writer's pipeline, one rank a stage) the ranks of that group hold
    different parts of the tree, and the writer's extra.pt is the union of theirs (merge_trees); every rank writes
    its own shards. A write that fails (a full disk, a read-only directory) leaves no temporary directory and
    raises, on every rank, an OSError naming rank 0's `directory`, as a single-file checkpoint's does
    (files.write_atomic)."""
    skeleton, shards = _split_and_merge(tree, writer, merge_group)
    named = directory  # in errors: rank 0's name, the one used, on every rank
    try:
        if not writer:
            tmp, named = _broadcast([None, None])
            dcp.save(shards, checkpoint_id=tmp)
            return 0
        with atomic_directory(directory) as tmp:
            _broadcast([str(tmp), str(directory)])
            dcp.save(shards, checkpoint_id=tmp)  # every rank its shards; rank 0 also .metadata, once all are written
            torch.save(skeleton, tmp / EXTRA)
    except (CheckpointException, OSError, RuntimeError) as exc:
        _raise_write_error(exc, named)
    return _size(directory)


def _split_and_merge(tree: Any, writer: bool, merge_group: dist.ProcessGroup | None) -> tuple[Any, dict]:
    """(the skeleton the writer's extra.pt holds, this rank's shards): see write_sharded."""
    skeleton, shards = split_shards(tree)
    if merge_group is not None:  # tensors stay where they are: only the skeletons (placeholders, small state) move
        parts: list | None = [None] * dist.get_world_size(merge_group) if writer else None
        dist.gather_object(skeleton, parts, group=merge_group, group_dst=0)
        skeleton = merge_trees(parts) if parts is not None else skeleton
    return skeleton, shards


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir())


def _raise_write_error(exc: BaseException, named: Path | str):
    """A failed sharded write as the OSError naming `named` that a single-file checkpoint's would raise, when it
    is one (a full disk, a read-only directory); anything else (a lost peer, say) as it came."""
    error = rank_error(exc) if isinstance(exc, CheckpointException) else exc
    failure = _write_error(error)
    if failure is not None:
        raise OSError(failure.errno, failure.strerror or str(failure), str(named)) from exc
    if error is exc:
        raise exc
    raise error from exc


class ShardedWrite:
    """A sharded checkpoint being written in the background (train.checkpoint_async), started by every rank at
    the same update boundary: the loop waited only while each rank's shards were copied to shared CPU memory
    (pinned from a GPU) and rank 0 wrote extra.pt into the temporary directory; DCP's async_save hands the copy to
    a writer process per rank (its process-based executor, with its own gloo group among the writers), which
    writes the shards and, on rank 0 once all are written, .metadata. `result()` waits for it; rank 0 then fsyncs
    the directory and renames it into place (files.commit_directory), so a kill at any moment leaves no
    checkpoint at `directory` or a complete one."""

    def __init__(self, step: int, directory: Path, tmp: Path, writer: bool, future: Any, blocked_s: float):
        self.step, self.directory, self.tmp, self.writer, self.blocked_s = step, directory, tmp, writer, blocked_s
        self._future = future
        self._started = time.perf_counter()
        self.seconds: float | None = None  # the background write's duration, once it has ended

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> int:
        """Wait for every rank's shards, put the directory in place (rank 0) and return its bytes on disk (0 on
        other ranks); a write that failed raises on every rank as write_sharded's does, leaving no directory."""
        try:
            self._future.result()
            self.seconds = time.perf_counter() - self._started
            if not self.writer:
                return 0
            commit_directory(self.tmp, self.directory)
        except BaseException as exc:
            if self.writer:
                shutil.rmtree(self.tmp, ignore_errors=True)
            if not isinstance(exc, (Exception, CheckpointException)):
                raise  # a second Ctrl-C, say: as it came
            error = rank_error(exc) if isinstance(exc, CheckpointException) else exc
            failure = _write_error(error)
            if failure is not None:  # a full disk, a read-only directory
                raise OSError(failure.errno, failure.strerror or str(failure), str(self.directory)) from exc
            # the writer process died, or lost its peers (another rank's writer died): a write that failed
            said = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise OSError(errno.EIO, f"the checkpoint writer process failed: {said}", str(self.directory)) from exc
        return _size(self.directory)


def start_sharded_write(
    step: int,
    directory: Path,
    tree: Any,
    writer: bool,
    stager: Any,
    merge_group: dist.ProcessGroup | None = None,
) -> ShardedWrite:
    """write_sharded's asynchronous twin (ShardedWrite): a collective at an update boundary, every rank calls it
    with the same `stager` each time (a DCP DefaultStager, whose staging buffers are reused from save to save)."""
    start = time.perf_counter()
    skeleton, shards = _split_and_merge(tree, writer, merge_group)
    failed = None
    if writer:
        tmp = temp_directory(directory)
        try:
            torch.save(skeleton, tmp / EXTRA)  # small, and the loop changes it next: written now
        except (OSError, RuntimeError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            failed = exc
        tmp, named, error = _broadcast([str(tmp), str(directory), None if failed is None else repr(failed)])
    else:
        tmp, named, error = _broadcast([None, None, None])
    if failed is not None:
        _raise_write_error(failed, directory)
    if error is not None:  # rank 0's extra.pt failed: every rank stops saving at the same boundary
        raise OSError(errno.EIO, f"rank 0 could not write {EXTRA}: {error}", named)
    future = _async_save(shards, tmp, stager)
    return ShardedWrite(step, Path(named), Path(tmp), writer, future, time.perf_counter() - start)


def _async_save(state: Any, tmp: str, stager: Any) -> Any:
    """DCP's async_save of `state` into `tmp` by this rank's writer process; its future."""
    with warnings.catch_warnings():  # "experimental": the behaviour k3train relies on is checked by its tests
        warnings.filterwarnings("ignore", ".*async_save.*", UserWarning)
        return dcp.async_save(
            state,
            storage_writer=ProcessFileSystemWriter(tmp),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )


def start_writer_processes(store: Path, stager: Any) -> float:
    """Start every rank's checkpoint writer process now, before training (a collective): a save of one small
    tensor into a temporary directory, waited for, then removed; the seconds it took.

    A writer learns of its rank's death only once it serves a save (ProcessFileSystemWriter). While it starts, it
    meets the other ranks' writers in a gloo rendezvous, and a writer whose rank was killed then waits out gloo's
    timeout (30 minutes) for a peer that torchrun has ended (found by the fault trials, when writers started at a
    run's first save). Started here, that window is a few seconds of the job's own start-up, not any moment of
    training."""
    start = time.perf_counter()
    writer = not dist.is_initialized() or dist.get_rank() == 0
    tmp = temp_directory(store / "writers") if writer else None
    [tmp] = _broadcast([None if tmp is None else str(tmp)])
    try:
        _async_save({"started": torch.zeros(1)}, tmp, stager).result()
    finally:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - start


def new_stager() -> Any:
    """The stager a run's asynchronous sharded saves share: copies to shared memory, which the writer process
    maps without another copy (pinned as well from a GPU, the copy non-blocking)."""
    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=cuda
        )
    )


class ProcessFileSystemWriter(FileSystemWriter):
    """DCP's FileSystemWriter, which also sets up the writer process it is unpickled in (DCP's process-based
    executor sends it with each save; torch 2.13's _async_process_executor.py):
    - the process ends within a second of its rank's death. Idle, it would end by itself (its pipe closes), but
      in the middle of a write it goes on, its gloo peers waiting on it, for as long as the write takes or until
      gloo's timeout (the fault trials found writers alive 30 s after their job); its half-written directory is
      removed on the next start. (Not the parent-death signal: it fires when the thread that started the
      process ends, and DCP starts it from a pool thread that ends after the first save.)
    - its root logger is lowered to WARNING: the executor sets it to INFO, three lines a rank for every save;
      what it says once at start-up still shows."""

    def __setstate__(self, state: dict) -> None:  # in the writer process, before the save is logged
        self.__dict__.update(state)
        logging.getLogger().setLevel(logging.WARNING)
        _end_with_rank()


_WATCHING: list[int] = []  # the rank this writer process watches, once watched


def _end_with_rank() -> None:
    if _WATCHING:
        return
    _WATCHING.append(os.getppid())

    def watch() -> None:
        while os.getppid() == _WATCHING[0]:
            time.sleep(1.0)
        os._exit(1)  # the rank died: no clean-up of a process whose work nobody will use

    threading.Thread(target=watch, name="end-with-rank", daemon=True).start()


# torch.save's zip writer checks that each write wrote it all: a short write, which is how a full disk answers
# once only part of a write fits (tmpfs says nothing else), fails that check with "unexpected pos" and no OSError.
_SHORT_WRITE = "unexpected pos"


def _write_error(exc: BaseException) -> OSError | None:
    """The OSError a failed write met: exc itself, the one it was raised while handling (torch.save's clean-up
    raises a RuntimeError on top of it), or ENOSPC for torch's short write; None for any other error."""
    cause = _os_error(exc)
    if cause is not None:
        return cause
    if isinstance(exc, RuntimeError) and _SHORT_WRITE in str(exc):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def rank_error(exc: CheckpointException) -> Exception:
    """DCP's CheckpointException (a BaseException that holds every failing rank's error) as the first of those
    errors, which the runner reports like any other (an OSError: a full disk, a read-only directory)."""
    errors = [error for error, _ in exc.failures.values()]
    if errors and isinstance(errors[0], Exception):
        return errors[0]
    return RuntimeError(str(exc).strip().splitlines()[-1])


def _broadcast(objects: list) -> list:
    dist.broadcast_object_list(objects, src=0)  # between this job's own ranks
    return objects


def read_sharded(directory: Path, make_shard: MakeShard, keep: Callable[[str], bool] | None = None) -> Any:
    """The tree saved by write_sharded, its sharded tensors allocated by make_shard and filled by dcp.load (a
    collective when a process group is up: every rank calls it; in one process it needs none). Those whose key
    `keep` refuses (a pipeline's other stages') are neither allocated nor read: None in the tree."""
    skeleton = safe_load(Path(directory) / EXTRA)
    wanted: dict = {}
    skipped: dict = {}
    for p in _placeholders(skeleton):
        if keep is not None and not keep(p[PLACEHOLDER]):
            skipped[p[PLACEHOLDER]] = None
            continue
        dtype = getattr(torch, str(p["dtype"]), None)
        mesh = p.get("mesh", ["dp_shard"])  # written before there was more than FSDP2's
        if (
            not isinstance(dtype, torch.dtype)
            or not all(isinstance(n, int) for n in p["shape"])
            or not all(isinstance(n, str) for n in mesh)
        ):
            raise ValueError(f"{directory / EXTRA} has a malformed tensor entry {p!r}")
        wanted[p[PLACEHOLDER]] = make_shard(torch.Size(p["shape"]), dtype, tuple(mesh))
    reader = SafeFileSystemReader(directory)
    reader.read_metadata()  # refused here, in one clear line, rather than inside dcp.load's collectives
    if wanted:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            try:
                dcp.load(wanted, storage_reader=reader, no_dist=not dist.is_initialized())
            except CheckpointException as exc:
                raise ValueError(str(rank_error(exc))) from exc
    return _fill(skeleton, wanted | skipped)


# What DCP's .metadata may hold: its own dataclasses, torch.Size, dtypes, layouts (by name, through
# torch.serialization._get_layout, a table lookup), memory formats and the saved path; nothing that runs code.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str):
        super().__init__(f"{name} is not part of a checkpoint's metadata")
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """Python's "restricting globals" recipe (pickle docs): only the classes DCP's metadata is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` without running code from it and refusing non-tensor entries
    (DCP would torch.load those with weights_only=False)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            except _Refused as exc:
                raise CodeRefused(path, exc.name, "which is not part of a checkpoint's metadata") from None
            except (pickle.UnpicklingError, AttributeError, EOFError, TypeError, ValueError) as exc:
                raise ValueError(f"{path} is not a checkpoint's metadata ({exc})") from exc
        if (
            not isinstance(metadata, dcp_metadata.Metadata)
            or not all(
                isinstance(md, dcp_metadata.TensorStorageMetadata) for md in metadata.state_dict_metadata.values()
            )
            or not all(isinstance(info, _StorageInfo) for info in (metadata.storage_data or {}).values())
        ):
            raise ValueError(
                f"{path} holds entries other than tensors; k3train's sharded checkpoints hold only tensors there"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def point_to(link: Path, target: Path) -> None:
    """Make `link` a symbolic link to `target`, atomically (a new link renamed over the old name)."""
    tmp = temp_path(link)
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fd = os.open(link.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_TEMP_LINK = re.compile(r"\..+\.tmp-\d+")  # point_to's temporary name (files.temp_path): .<name>.tmp-<pid>


def remove_stale_temp_links(directory: Path) -> list[Path]:
    """Delete the temporary links of dead point_to callers in directory (a kill between its symlink and its
    replace leaves one; files.remove_stale_temp_files deletes regular files only); only call it while holding the
    directory's lock. Only point_to's names: any other link is left alone."""
    removed = []
    for path in sorted(Path(directory).glob(".*.tmp-*")):
        if path.is_symlink() and _TEMP_LINK.fullmatch(path.name):
            path.unlink()
            removed.append(path)
    return removed
