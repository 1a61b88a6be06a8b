"""Files a crash cannot tear: each is written to `.<name>.tmp-<pid>` beside its final name, fsynced, then renamed
over it, so a kill at any moment leaves the previous complete file or the new one. A killed writer can leave its
temporary file behind; `remove_stale_temp_files` deletes those once no writer can be alive (the run-directory
lock is held)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Callable

TEMP_GLOB = ".*.tmp-*"


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> int:
    """Write path through write(file) atomically; returns the file size in bytes. An OSError (a full disk, a
    read-only directory), also one that torch.save wraps in a RuntimeError, leaves the previous file and no
    temporary one, and is raised as an OSError naming path."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except (OSError, RuntimeError) as exc:
        # torch.save's zip writer meets a full disk as an OSError, then its own clean-up raises a RuntimeError
        # ("unexpected pos") on top of it: the OSError underneath is what failed.
        failure = _os_error(exc)
        if failure is None:
            raise
        raise OSError(failure.errno, failure.strerror or str(failure), str(path)) from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return path.stat().st_size


def _os_error(exc: BaseException) -> OSError | None:
    """exc if it is an OSError, else the OSError it was raised while handling (None if there is none)."""
    while exc is not None and not isinstance(exc, OSError):
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
