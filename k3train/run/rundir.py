"""One writer per run directory, and a refused start that leaves the directory exactly as it found it.

`claim(run_dir)` takes an exclusive lock on `<run_dir>/.lock` (fcntl.flock, held for the life of the process and
released by the OS when it dies, however it dies) and writes its pid there, so a second process is refused with
the holder's pid. The lock file stays after the run. A single run claims its directory from the RunDirGuard
Hydra callback, before Hydra writes .hydra/ (Hydra 1.3: on_run_start, then run_job saves .hydra/ and calls the
task), and notes what it found: whether the directory existed and the bytes of its .hydra/ files and lock file.
A start refused later (a bad setting, an incompatible checkpoint, a finished run) calls `undo()`: .hydra/ and
the lock file get their old bytes back, and a directory the claim created is removed again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from k3train.observe.run_manifest import RUN_LOCK

HYDRA_DIR = ".hydra"


class RunDirError(Exception):
    """The run directory cannot be claimed: another live process holds its lock, or it cannot be written."""


@dataclass
class RunDirClaim:
    path: Path
    created: list[Path]  # directories this claim made, outermost first
    lock_before: bytes | None  # the lock file's bytes before this process wrote its pid (None: no file)
    hydra_before: dict[str, bytes] | None  # .hydra/ files by relative path (None: no .hydra/)
    fd: int | None = field(default=None, repr=False)

    def undo(self) -> None:
        """Put back what this start changed, then let go of the directory."""
        hydra = self.path / HYDRA_DIR
        if self.hydra_before is None:
            shutil.rmtree(hydra, ignore_errors=True)
        else:
            for path in [p for p in hydra.rglob("*") if p.is_file()]:
                if str(path.relative_to(hydra)) not in self.hydra_before:
                    path.unlink()
            for name, data in self.hydra_before.items():
                path = hydra / name
                if not path.is_file() or path.read_bytes() != data:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
        if self.lock_before is None:
            (self.path / RUN_LOCK).unlink(missing_ok=True)  # safe: lockers check they hold the file at the path
        elif self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, self.lock_before, 0)
        self.release()
        for directory in reversed(self.created):
            try:
                directory.rmdir()
            except OSError:  # not empty: something else lives there now; leave it
                break

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        _claims.pop(self.path, None)


_claims: dict[Path, RunDirClaim] = {}


def _key(run_dir: Path) -> Path:
    return Path(os.path.abspath(run_dir))


def claim(run_dir: Path) -> RunDirClaim:
    """Create run_dir if needed and lock it; raises RunDirError (naming the lock's holder, or what failed)."""
    path = _key(run_dir)
    if path in _claims:
        return _claims[path]
    created = [p for p in reversed([path, *path.parents]) if not p.exists()]
    lock = path / RUN_LOCK
    try:
        path.mkdir(parents=True, exist_ok=True)
        existed = lock.exists()
        fd = _lock(lock)
    except BaseException as exc:
        for directory in reversed(created):
            if directory.exists():
                directory.rmdir()
        if isinstance(exc, OSError):
            raise RunDirError(
                f"cannot lock the run directory {path} ({exc.strerror}: {exc.filename}): make it "
                "writable, or choose another hydra.run.dir"
            ) from exc
        raise
    lock_before = _read_all(fd) if existed else None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    hydra = path / HYDRA_DIR
    hydra_before = (
        {str(p.relative_to(hydra)): p.read_bytes() for p in hydra.rglob("*") if p.is_file()} if hydra.is_dir() else None
    )
    _claims[path] = RunDirClaim(path, created, lock_before, hydra_before, fd)
    return _claims[path]


def claimed(run_dir: Path) -> RunDirClaim | None:
    """The claim this process already holds on run_dir (taken by the Hydra callback), if any."""
    return _claims.get(_key(run_dir))


def _lock(path: Path) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_all(fd).decode(errors="replace").strip()
            os.close(fd)
            by = f"another k3train process (pid {holder})" if holder.isdigit() else "another process"
            raise RunDirError(
                f"{path.parent} is in use by {by}: wait for it to end, or choose another hydra.run.dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # a refused start removed the file between our open and our lock: lock the one there now


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
