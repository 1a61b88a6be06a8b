"""Checkpoints: one Checkpointer saves and restores a run's named Stateful parts (the model: torchtitan's
https://github.com/pytorch/torchtitan/blob/745373f01700ff4e547023da7f6ff5c10b63f400/torchtitan/components/checkpoint.py).

A checkpoint is `{"meta": {...}, "<part>": part.state_dict(), ...}`: `meta` holds the format version, the step
and the identities a resume must match (model config, recipe, optimizer layout, data: see build.build_meta).
The parts are whatever the Trainer registers (model, optimizer, scaler, loaders, RNG, counters, step plan); adding
one is one `add()` call, and `load()` restores them in the order they were added. Files are written to a temporary
file in the same directory, fsynced and renamed over the old one (files.write_atomic), so a kill at any moment
leaves the previous checkpoint or the new one, never a torn file under the final name. Loading uses
torch.load(weights_only=True) (dcp.safe_load): opening a checkpoint never runs code from it, and one that names a
global outside torch's allow-list (code, e.g. posix.system) is refused in one line naming that global and the file.

Files in the run directory: last.pt; step_<7 digits>.pt (keep_last_k hard links); previous.pt (the checkpoint
last.pt replaced, until an update goes on from the new one); diverged_step_<7 digits>.pt (set aside by
`set_aside_diverged`); last_good.pt (guard=rewind's: the newest checkpoint updates went on from without a spike,
`mark_good`). Under FSDP2 or expert parallelism (ShardedCheckpointer) the same names end .dcp and name
sharded directories.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed.tensor as distributed_tensor

from k3train.checkpoint.dcp import (
    CodeRefused,
    MakeShard,
    ShardedWrite,
    new_stager,
    point_to,
    read_sharded,
    safe_load,
    start_sharded_write,
    start_writer_processes,
    whole_tensor,
    write_sharded,
)
from k3train.checkpoint.staging import BackgroundWrite, staged_copy
from k3train.files import commit_temp, temp_path, write_atomic

SHARDED_STORE = "dcp"  # <run dir>/dcp/step_<N>-<random>/: the sharded checkpoints a run wrote
FORMAT_VERSION = 2  # 2: named Stateful parts (train_loader, val_loader, rng, trainer, plan); 1 had fixed entries


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, of another format, or incompatible with this run."""


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def save_checkpoint(path: Path, payload: dict) -> int:
    """Atomically write payload to path (see files.write_atomic); returns the file size in bytes."""
    return write_atomic(path, lambda f: torch.save(payload, f))


def load_checkpoint(
    path: Path, make_shard: MakeShard | None = None, keep: Callable[[str], bool] | None = None, mmap: bool = False
) -> dict:
    """A checkpoint file (`mmap`: memory-mapped, its tensors' pages read when touched), or a sharded checkpoint
    directory (dcp.py) whose sharded tensors `make_shard(shape, dtype, mesh)` allocates (whole plain tensors by
    default: any number of processes can read it), those whose key `keep` refuses left out (None)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist: check the resume= path")
    try:
        payload = read_sharded(path, make_shard or whole_tensor, keep) if path.is_dir() else safe_load(path, mmap)
    except CodeRefused as exc:  # not "cannot be read": it can, and must not be
        raise CheckpointError(f"checkpoint {exc}") from None
    except Exception as exc:  # torch raises several types for truncated or foreign files
        said = (str(exc).strip().splitlines() or ["no message"])[0]  # torch's first line; the rest is its internals
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({said}). It is truncated, corrupt or not a "
            "k3train checkpoint; resume from an earlier one (keep_last_k keeps step_*.pt copies)"
        ) from exc
    if not isinstance(payload, dict) or "meta" not in payload:
        raise CheckpointError(f"{path} is not a k3train checkpoint (no 'meta' entry)")
    version = payload["meta"].get("format_version")
    if version != FORMAT_VERSION:
        older = isinstance(version, int) and version < FORMAT_VERSION
        raise CheckpointError(
            f"checkpoint {path} has format version {version}; this k3train reads version {FORMAT_VERSION}"
            + (
                "; it was written by an older k3train: resume it with the k3train version that wrote it, or start "
                "a new run"
                if older
                else "; it was written by a newer k3train: upgrade k3train to resume it"
            )
        )
    return payload


MODEL_FIELDS_SHOWN = 4  # a model config that differs names its first fields with their values, the rest by name


def check_compatible(saved: dict, current: dict, path: Path) -> None:
    """Compare two `meta` dicts and name every mismatch that makes a resume wrong, in one line. Another model is
    one item (its fields, the first few with their values); its optimizer layout, which follows from it, is not
    listed again."""
    problems = []
    model_differs = False
    for key, what, fix in (
        ("model_config", "model config", "use the model config the checkpoint was trained with"),
        (
            "recipe",
            "training recipe",
            "restore these train.* / precision settings; global_batch_size is "
            "train.batch_size x the data-parallel ranks, the processes / (parallel.pp x parallel.cp)",
        ),
        ("optimizer_layout", "optimizer param groups", "use the same optim config"),
        ("data", "dataset identity", "point data at the dataset the checkpoint was trained on"),
    ):
        old, new = saved.get(key, {}), current.get(key, {})
        if key == "model_config":  # a field the checkpoint predates has its default: the behaviour it was trained with
            old = {**current.get("model_config_defaults", {}), **old}
        if key == "optimizer_layout" and model_differs:
            continue
        differ = [
            f"{field} was {old.get(field)!r}, now {new.get(field)!r}"
            for field in sorted(set(old) | set(new))
            if old.get(field) != new.get(field)
        ]
        if not differ:
            continue
        if key == "model_config":
            model_differs = True
            names = [item.split(" was ", 1)[0] for item in differ[MODEL_FIELDS_SHOWN:]]
            differ = differ[:MODEL_FIELDS_SHOWN] + ([f"and {', '.join(names)}"] if names else [])
        problems.append(f"{what}: {'; '.join(differ)} ({fix})")
    if problems:
        raise CheckpointError(f"cannot resume from {path}, which does not match this run: " + " | ".join(problems))


def link_or_copy(checkpoint: Path, copy: Path) -> None:
    """A second name for a checkpoint: a hard link is free, since last.pt is replaced by rename, never rewritten.
    A sharded checkpoint's names are symbolic links to its directory: the copy points where the original does."""
    if checkpoint.is_symlink():
        point_to(copy, Path(os.readlink(checkpoint)))
        return
    try:
        os.link(checkpoint, copy)
    except OSError:  # a filesystem without hard links
        shutil.copy2(checkpoint, copy)


def keep_last(run_dir: Path, checkpoint: Path, step: int, k: int, suffix: str = ".pt") -> None:
    """Besides last.pt, keep hard-linked step_XXXXXXX.pt copies of the last k checkpoints."""
    if k <= 0:
        return
    copy = run_dir / f"step_{step:07d}{suffix}"
    tmp = temp_path(copy)  # replaced, not kept: a rewind or a resume from an earlier checkpoint saves this step again
    tmp.unlink(missing_ok=True)
    link_or_copy(checkpoint, tmp)
    os.replace(tmp, copy)
    for old in sorted(run_dir.glob(f"step_*{suffix}"))[:-k]:
        old.unlink()


class Checkpointer:
    """Saves and restores the named parts of a run in `run_dir/last.pt`.

    An update can blow the weights up and still be finite; only the non-finite steps after it show it. So the
    checkpoint last.pt replaces stays as previous.pt (a hard link: free) until `update_went_on()` says an update
    went on from the new one, and `set_aside_diverged()` puts it back if the run diverges first."""

    suffix = ".pt"  # of every checkpoint name: last, previous, step_N, diverged_step_N
    sharded = False  # whether every rank writes its own tensors (ShardedCheckpointer) or rank 0 writes them all

    def __init__(self, run_dir: Path, meta: dict, keep_last_k: int = 0, writer: bool = True):
        self.run_dir = Path(run_dir)
        self.writer = writer  # rank 0 writes; under DDP every rank holds the same state and only reads
        self.meta = {**meta, "format_version": FORMAT_VERSION}
        self.keep_last_k = keep_last_k
        self.parts: dict[str, Stateful] = {}
        self.optional: set[str] = set()  # parts a checkpoint may lack (written before they existed): left as they are
        self.path = self.run_dir / f"last{self.suffix}"
        self.previous_path = self.run_dir / f"previous{self.suffix}"
        self.good_path = self.run_dir / f"last_good{self.suffix}"
        self.saved_step: int | None = None  # the step in last.pt, when this line of training wrote or read it
        self._previous_step: int | None = None
        # Whether previous.pt is on disk (a killed session's counts too), so the loop checks a flag, not the disk.
        self._previous_kept = self.previous_path.exists()
        self._in_flight: BackgroundWrite | None = None  # an asynchronous save being written (save(wait=False))
        self._good_when_written: int | None = None  # a step mark_good named while its save was in flight

    def add(self, name: str, part: Stateful, optional: bool = False) -> None:
        """Register a part; an `optional` one a checkpoint may lack (it was written before the part existed)."""
        if name == "meta" or name in self.parts:
            raise ValueError(f"checkpoint part {name!r} is reserved or already added")
        if not isinstance(part, Stateful):
            raise TypeError(
                f"checkpoint part {name!r} ({type(part).__name__}) needs state_dict() and load_state_dict()"
            )
        self.parts[name] = part
        if optional:
            self.optional.add(name)

    def save(self, step: int, wait: bool = True) -> int | None:
        """Write every part to last.pt (at an update boundary); returns the file's size in bytes (0 where this
        process is not the writer). With wait=False (train.checkpoint_async) the state is copied now and written in
        the background: None, and poll() / wait() put it in place once written. One save at a time: a save first
        waits for the one in flight."""
        self.wait()
        if wait:
            self._keep_previous()
            size = self._write(step)
            self._written(step)
            return size
        self._in_flight = self._start_write(step)
        return None

    def start_background_writers(self) -> float:
        """Before training, when saves will be asynchronous: what writes them in the background started (the
        single-file format's thread starts with each save: nothing); the seconds it took."""
        return 0.0

    def _start_write(self, step: int) -> BackgroundWrite | None:
        """save(wait=False)'s first half: the state copied, its write started in a thread (None where this process
        is not the writer)."""
        start = time.perf_counter()
        payload = self.payload(step)  # a collective where the parts gather (GatheredCheckpointer)
        if not self.writer:
            self.saved_step = step  # nothing to write here: the writer's save is the one in flight
            return None
        staged = staged_copy(payload)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies to pinned memory have landed
        return BackgroundWrite(step, self.path, lambda f: torch.save(staged, f), time.perf_counter() - start)

    def _put_in_place(self, write: BackgroundWrite) -> int:
        """The second half, once the write has ended: last.pt moved to previous.pt and the written file renamed to
        last.pt; its size."""
        tmp = write.result()
        self._keep_previous()
        return commit_temp(tmp, self.path)

    @property
    def latest_step(self) -> int | None:
        """The step of the newest checkpoint this line of training started: the one in flight, else last.pt's."""
        return self._in_flight.step if self._in_flight is not None else self.saved_step

    def poll(self) -> dict | None:
        """The save in flight put in place if its write has ended (raising what the write raised): its figures
        {step, path, bytes, blocked_s, background_s}; None while none has ended."""
        if self._in_flight is None or not self._written_everywhere(self._in_flight.done()):
            return None
        return self.wait()

    def _written_everywhere(self, done: bool) -> bool:
        """Whether the save in flight has ended wherever it is written: here, the writer alone."""
        return done

    def wait(self) -> dict | None:
        """Wait for the save in flight, put it in place and return its figures (poll's); None without one. A
        write that failed leaves last.pt as it was and raises its error (an OSError naming last.pt)."""
        write, self._in_flight = self._in_flight, None
        if write is None:
            return None
        size = self._put_in_place(write)
        self._written(write.step)
        if self._good_when_written == write.step:
            self._good_when_written = None
            self.mark_good(write.step)
        return {
            "step": write.step,
            "path": str(self.path),
            "bytes": size,
            "blocked_s": write.blocked_s,
            "background_s": write.seconds,
        }

    def _keep_previous(self) -> None:
        """Before last.pt is replaced: it stays as previous.pt until an update goes on from the new one."""
        if not self.writer:
            return
        self.previous_path.unlink(missing_ok=True)
        self._previous_kept = False
        if self.saved_step is not None and self.path.exists():  # last.pt is this line's (not a later one left
            # behind by a resume from an earlier step_*.pt)
            link_or_copy(self.path, self.previous_path)
            self._previous_step, self._previous_kept = self.saved_step, True

    def _written(self, step: int) -> None:
        self.saved_step = step
        if self.writer:
            keep_last(self.run_dir, self.path, step, self.keep_last_k, self.suffix)
            self._forget_unnamed()

    def payload(self, step: int) -> dict:
        """What a checkpoint of `step` holds, whichever writer stores it: `meta` (this run's identities, the format
        version and the step) and each part's state_dict, in the order the parts were added."""
        payload = {"meta": {**self.meta, "step": step}}
        payload.update((name, part.state_dict()) for name, part in self.parts.items())
        return payload

    def _write(self, step: int) -> int:
        """Every part into self.path, atomically; the size written (rank 0 alone writes: DDP ranks hold the same)."""
        if not self.writer:
            return 0
        return save_checkpoint(self.path, self.payload(step))

    def _read(self, path: Path) -> dict:
        return load_checkpoint(path)

    def _forget_unnamed(self) -> None:
        """Delete stored checkpoints that no name refers to any more (hard links need no help)."""

    def load(self, path: Path) -> int:
        """Check the checkpoint against this run, then restore every part; returns its step. A save in flight is
        put in place first (a rewind may read what it names)."""
        self.wait()
        path = Path(path)
        payload = self._read(path)
        check_compatible(payload["meta"], self.meta, path)
        missing = [name for name in self.parts if name not in payload and name not in self.optional]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} lacks {', '.join(missing)}: it was not written by this run's "
                "setup; resume from a checkpoint of this run"
            )
        for name, part in self.parts.items():
            if name not in payload:
                continue  # optional, and older than the checkpoint
            try:
                part.load_state_dict(payload[name])
            except (KeyError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f"cannot restore {name} from {path}: {exc}") from exc
        step = payload["meta"]["step"]
        if path.resolve() == self.path.resolve():
            self.saved_step = step  # continuing from last.pt itself
        return step

    def update_went_on(self) -> None:
        """An update went on from last.pt: it is a good checkpoint, and previous.pt is no longer needed."""
        if self._previous_kept and self.writer:
            self.previous_path.unlink(missing_ok=True)
            self._previous_step, self._previous_kept = None, False
            self._forget_unnamed()

    def mark_good(self, step: int) -> None:
        """The checkpoint of `step` is good (guard=rewind): name it last_good too, atomically (a hard link or,
        sharded, a link to the same directory), so a rewind finds it after last.pt has moved on. While its save is
        in flight, once it is written; not at all when last.pt holds another step."""
        if self._in_flight is not None and self._in_flight.step == step:
            self._good_when_written = step
            return
        if not self.writer or self.saved_step != step or not self.path.exists():
            return
        if self.good_path.exists() and os.path.samefile(self.path, self.good_path):
            return  # already so named (a resumed session confirms it again); rename() between two links of one
            # file would succeed doing nothing and leave the temporary name behind
        tmp = temp_path(self.good_path)
        tmp.unlink(missing_ok=True)
        link_or_copy(self.path, tmp)
        os.replace(tmp, self.good_path)
        self._forget_unnamed()

    def set_aside_diverged(self, step: int, fix: str) -> str:
        """The run diverged at `step`: leave in last.pt a checkpoint an update went on from, and say which one it
        is and what to do (`fix`)."""
        self.wait()
        last = self.path
        if not self.writer:
            return f"rank 0 reports which checkpoint is good: {fix}"
        if not last.exists():
            return f"No checkpoint was written: {fix} and start again"
        if self.saved_step is None:
            return f"{last} is from an earlier session: {fix} and resume from a checkpoint before the failures"
        if self.saved_step != step:
            return f"{last} (step {self.saved_step}) is good (updates went on from it): {fix} and resume=auto"
        # last.pt holds the very weights that failed: one finite update blew them up, then every step overflowed
        if not self.previous_path.exists():
            return (
                f"{last} (step {step}) holds the weights that failed and no earlier checkpoint is kept: {fix} "
                "and start again"
            )
        failed = self.run_dir / f"diverged_step_{step:07d}{self.suffix}"
        os.replace(last, failed)
        os.replace(self.previous_path, last)
        self.saved_step, self._previous_kept = self._previous_step, False
        at = f" (step {self._previous_step})" if self._previous_step is not None else ""
        return (
            f"{last} is back to the checkpoint before it{at}, which updates went on from (the step-{step} one "
            f"holds the weights that failed: kept as {failed.name}): {fix} and resume=auto"
        )


class GatheredCheckpointer(Checkpointer):
    """The single-file Checkpointer of a run whose parts gather their state on rank 0 (a pipeline's stages:
    k3train/train/pipeline_state.py): every rank takes its parts' state_dicts (a collective), rank 0 writes."""

    def _write(self, step: int) -> int:
        payload = self.payload(step)
        return save_checkpoint(self.path, payload) if self.writer else 0


class ShardedCheckpointer(Checkpointer):
    """The Checkpointer of a run with sharded tensors (FSDP2, expert parallelism): every rank writes its shards
    (dcp.py) of each checkpoint into a new directory `dcp/step_<7 digits>-<random>/`, and the names a run uses
    (last.dcp, previous.dcp, step_<N>.dcp, diverged_step_<N>.dcp) are symbolic links to those directories, each
    replaced atomically. So a kill at any moment leaves last.dcp naming a complete checkpoint, and the
    keep/previous/diverged rules are the single-file ones; a directory no name refers to any more is deleted.

    `layouts` maps the names of the mesh a tensor was saved on to how this run holds that kind of tensor (mesh,
    placements: the parallel strategy's shard_layouts); a tensor saved on a mesh this run has no layout for is read
    as FSDP2 holds everything (dim 0 over dp_shard), or whole. So a checkpoint of N ranks resumes on M, with or
    without expert parallelism."""

    suffix = ".dcp"
    sharded = True

    def __init__(
        self,
        run_dir: Path,
        meta: dict,
        keep_last_k: int,
        layouts: dict,
        writer: bool,
        merge_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(run_dir, meta, keep_last_k, writer=writer)
        self.layouts = layouts
        self.store = self.run_dir / SHARDED_STORE
        self.merge_group = merge_group  # a pipeline's: its stages' parts are merged into one tree (write_sharded)
        self._stager = None  # save(wait=False)'s staging buffers, made at the first and reused (dcp.new_stager)

    def _write(self, step: int) -> int:
        directory = self.store / f"step_{step:07d}-{secrets.token_hex(4)}"  # rank 0's name is the one used
        size = write_sharded(directory, self.payload(step), self.writer, self.merge_group)  # a collective
        if self.writer:
            point_to(self.path, directory.relative_to(self.run_dir))
        return size

    def _start_write(self, step: int) -> ShardedWrite:
        """Every rank's shards copied to shared memory and handed to its writer process (dcp.ShardedWrite): a
        collective, and every rank then holds the save in flight."""
        if self._stager is None:
            self._stager = new_stager()
        directory = self.store / f"step_{step:07d}-{secrets.token_hex(4)}"  # rank 0's name is the one used
        return start_sharded_write(step, directory, self.payload(step), self.writer, self._stager, self.merge_group)

    def _written_everywhere(self, done: bool) -> bool:
        """Every rank's writer has ended (rank 0's ends last, with .metadata, but a failure ends them all): the
        same answer on every rank, so every rank puts the save in place, or raises its error, at one boundary."""
        if not dist.is_initialized():
            return done
        flag = torch.tensor([int(done)], dtype=torch.int32)  # on the CPU: a run's group has gloo for it
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _put_in_place(self, write: ShardedWrite) -> int:
        size = write.result()  # every rank; rank 0 renames the directory into place
        self._keep_previous()
        if self.writer:
            point_to(self.path, write.directory.relative_to(self.run_dir))
        return size

    def start_background_writers(self) -> float:
        """Before training, when saves will be asynchronous: every rank's writer process started (a collective;
        dcp.start_writer_processes); the seconds it took."""
        if self._stager is None:
            self._stager = new_stager()
        return start_writer_processes(self.store, self._stager)

    def _read(self, path: Path) -> dict:
        if not path.is_dir() and ("dp_shard",) in self.layouts:
            raise CheckpointError(
                f"{path} is a single-file checkpoint and parallel=fsdp resumes from a sharded one "
                "(a .dcp directory): resume it with parallel=ddp, or in one process"
            )
        return load_checkpoint(path, self._make_shard, self._held)

    def _held(self, key: str) -> bool:
        """Whether this rank reads the sharded tensor at `key` ('<part>/<path in it>'): all of them, but a part
        that holds some only (a pipeline's stages: `holds(path)`) says which."""
        name, _, rest = key.partition("/")
        holds = getattr(self.parts.get(name), "holds", None)
        return holds is None or holds(rest)

    def _make_shard(self, shape: torch.Size, dtype: torch.dtype, mesh: tuple[str, ...]) -> torch.Tensor:
        layout = self.layouts.get(mesh, self.layouts.get(("dp_shard",)))
        if layout is None:
            return whole_tensor(shape, dtype)
        device_mesh, placements = layout
        return distributed_tensor.empty(shape, dtype=dtype, device_mesh=device_mesh, placements=placements)

    def _forget_unnamed(self) -> None:
        named = {link.resolve() for link in self.run_dir.glob(f"*{self.suffix}") if link.is_symlink()}
        if self._in_flight is not None:
            named.add(self._in_flight.tmp.resolve())  # being written: named once it is complete
        for directory in self.store.iterdir() if self.store.is_dir() else ():
            if directory.resolve() not in named:
                shutil.rmtree(directory, ignore_errors=True)
