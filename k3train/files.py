"""Files and directories a crash cannot tear: each is written under a temporary name beside its final one
(`.<name>.tmp-<pid>` for a file, `.<name>.tmp-<pid>-<random>` for a directory), fsynced, then renamed over it, so a
kill at any moment leaves the previous complete file or directory, or the new one. A killed writer can leave its
temporary file behind; `remove_stale_temp_files` deletes those once no writer can be alive (the run-directory
lock is held)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

TEMP_GLOB = ".*.tmp-*"


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> int:
    """Write path through write(file) atomically; returns the file size in bytes. An OSError (a full disk, a
    read-only directory), also one that torch.save wraps in a RuntimeError, leaves the previous file and no
    temporary one, and is raised as an OSError naming path."""
    return commit_temp(write_temp(path, write), path)


def write_temp(path: Path, write: Callable[[BinaryIO], None]) -> Path:
    """The first half of write_atomic: path's temporary file written through write(file) and fsynced, not yet
    renamed (commit_temp does that); an asynchronous checkpoint writes it in the background. A failure leaves no
    temporary file and raises as write_atomic does."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, (OSError, RuntimeError)):
            _reraise_write_error(exc, path)
        raise
    return tmp


def commit_temp(tmp: Path, path: Path) -> int:
    """The second half: the written temporary file renamed over path, the rename made durable; path's size."""
    path = Path(path)
    try:
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # make the rename itself durable
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        _reraise_write_error(exc, path)
    return path.stat().st_size


def _reraise_write_error(exc: BaseException, path: Path):
    # torch.save's zip writer meets a full disk as an OSError, or a second Ctrl-C as a KeyboardInterrupt, then
    # its own clean-up raises a RuntimeError ("unexpected pos") on top of it: what is underneath is what happened.
    interrupt = _underneath(exc, KeyboardInterrupt)
    if interrupt is not None:
        raise interrupt from None
    failure = _os_error(exc)
    if failure is None:
        raise exc
    raise OSError(failure.errno, failure.strerror or str(failure), str(path)) from exc


@contextlib.contextmanager
def atomic_directory(path: Path, may_replace: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Yield a new empty temporary directory beside path to fill; when the block ends without an exception, its
    files are fsynced and it is renamed to path in one step (commit_directory). An exception, or a kill, never
    leaves anything at path (a kill may leave the temporary directory, which nothing reads)."""
    tmp = temp_directory(path)
    try:
        yield tmp
        commit_directory(tmp, path, may_replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after the rename tmp no longer exists


def temp_directory(path: Path) -> Path:
    """atomic_directory's first half: a new empty directory beside path, `.<name>.tmp-<pid>-<random>`, to fill (an
    asynchronous sharded checkpoint's writer process fills it in the background)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{temp_path(path).name}-", dir=path.parent))


def commit_directory(tmp: Path, path: Path, may_replace: Callable[[Path], None] | None = None) -> None:
    """The second half: tmp's files fsynced and tmp renamed to path in one step, the rename made durable.

    A path that is missing or an empty directory is simply replaced. A non-empty one is replaced only through
    may_replace(path), called just before the swap (it raises to refuse); without it the swap raises
    FileExistsError. Replacing renames the old directory aside and deletes it after the new one is in place: a
    kill inside that window leaves the old directory under `.<name>.tmp-<pid>-<random>-old` and nothing at path.
    """
    path = Path(path)
    for file in tmp.rglob("*"):
        if file.is_file():
            _fsync_file(file)
    _fsync_dir(tmp)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        if may_replace is None:
            raise FileExistsError(f"{path} already exists and is not empty")
        may_replace(path)
        old = tmp.with_name(tmp.name + "-old")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        try:
            os.rename(tmp, path)  # replaces an empty directory; fails if something filled path meanwhile
        except OSError as exc:
            raise FileExistsError(f"{path} appeared while it was being written") from exc
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(exc: BaseException) -> OSError | None:
    """exc if it is an OSError, else the OSError it was raised while handling (None if there is none)."""
    return _underneath(exc, OSError)


def _underneath(exc: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """exc if it is a `kind`, else the `kind` it was raised while handling (None if there is none)."""
    while exc is not None and not isinstance(exc, kind):
        exc = exc.__context__
    return exc


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files of dead writers in directory; only call it while holding its lock."""
    removed = []
    for path in sorted(Path(directory).glob(TEMP_GLOB)):
        if path.is_file():
            path.unlink()
            removed.append(path)
    return removed


def remove_stale_temp_directories(directory: Path) -> list[Path]:
    """Delete the temporary directories (atomic_directory's, half filled) of dead writers in directory; only call
    it while holding its lock."""
    removed = []
    for path in sorted(Path(directory).glob(TEMP_GLOB)):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            removed.append(path)
    return removed
