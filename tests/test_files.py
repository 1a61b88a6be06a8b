"""k3train/files.py: atomic files and directories leave the old complete version or the new one, never a mix, and
no temporary files after a failure."""

import errno
import os

import pytest

from k3train import files
from k3train.files import (
    atomic_directory,
    remove_stale_temp_directories,
    remove_stale_temp_files,
    temp_directory,
    write_atomic,
)


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_write_atomic_replaces_the_file_and_keeps_it_after_a_failure(tmp_path):
    target = tmp_path / "last.pt"
    assert write_atomic(target, lambda f: f.write(b"one")) == 3
    assert write_atomic(target, lambda f: f.write(b"second")) == 6 and target.read_bytes() == b"second"

    def full_disk(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left on device") as caught:
        write_atomic(target, full_disk)
    assert caught.value.filename == str(target)
    assert target.read_bytes() == b"second" and leftovers(tmp_path) == []


def test_a_ctrl_c_inside_torch_save_is_the_ctrl_c_not_the_zip_writers_error(tmp_path):
    """A second Ctrl-C while torch.save writes: its zip writer's clean-up raises "unexpected pos" on top of the
    KeyboardInterrupt; the caller gets the KeyboardInterrupt (the runner's one line), the old file, no temp file."""
    import torch

    target = tmp_path / "last.pt"
    target.write_bytes(b"the last checkpoint")

    class CtrlCMidway:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 100_000:
                raise KeyboardInterrupt
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    with pytest.raises(KeyboardInterrupt) as caught:
        write_atomic(target, lambda f: torch.save({"w": torch.zeros(10**6)}, CtrlCMidway(f)))
    assert type(caught.value) is KeyboardInterrupt and caught.value.__suppress_context__
    assert target.read_bytes() == b"the last checkpoint" and leftovers(tmp_path) == []


def test_a_ctrl_c_while_python_m_k3train_imports_ends_it_by_sigint_in_one_line():
    """bootstrap(training=True) is the first thing `python -m k3train` does; a Ctrl-C during the imports that follow
    (torch: seconds) ends the process by SIGINT with one line, not a traceback from inside an import."""
    import signal
    import subprocess
    import sys

    code = (  # SIGINT as a terminal's foreground job has it (a script's background job starts with it ignored)
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from k3train.runtime.bootstrap import bootstrap; bootstrap(training=True); "
        "import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(30)"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert proc.stderr.strip() == "k3train: interrupted by Ctrl-C while starting; nothing was written"


def test_remove_stale_temp_files_removes_only_temp_files(tmp_path):
    (tmp_path / ".last.pt.tmp-123").write_bytes(b"torn")
    (tmp_path / "last.pt").write_bytes(b"kept")
    (tmp_path / ".ds.tmp-123-abc").mkdir()  # a directory is not a writer's temp file: left alone
    assert remove_stale_temp_files(tmp_path) == [tmp_path / ".last.pt.tmp-123"]
    assert leftovers(tmp_path) == [".ds.tmp-123-abc"] and (tmp_path / "last.pt").exists()


def test_atomic_directory_appears_complete_and_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", recording_fsync)
    out = tmp_path / "new" / "ds"  # a missing parent is created
    with atomic_directory(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".ds.tmp-") and not out.exists()
        (tmp / "a.bin").write_bytes(b"a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"b")
    assert (out / "a.bin").read_bytes() == b"a" and (out / "sub" / "b.bin").read_bytes() == b"b"
    assert leftovers(out.parent) == []
    # Every file and the temporary directory before the rename, the parent after it (the rename is durable).
    assert {str(tmp / "a.bin"), str(tmp / "sub" / "b.bin"), str(tmp)} <= set(synced[:-1])
    assert synced[-1] == str(out.parent)


def test_atomic_directory_failure_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="bad input"):
        with atomic_directory(tmp_path / "ds") as tmp:
            (tmp / "a.bin").write_bytes(b"a")
            raise ValueError("bad input")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_replaces_an_empty_directory(tmp_path):
    (tmp_path / "ds").mkdir()
    with atomic_directory(tmp_path / "ds") as tmp:
        (tmp / "a.bin").write_bytes(b"a")
    assert [p.name for p in (tmp_path / "ds").iterdir()] == ["a.bin"] and leftovers(tmp_path) == []


def test_atomic_directory_replaces_content_only_when_allowed(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "old.bin").write_bytes(b"old")

    def refuse(existing):
        raise FileExistsError(f"{existing} is not ours")

    for may_replace, message in [(None, "already exists and is not empty"), (refuse, "is not ours")]:
        with pytest.raises(FileExistsError, match=message):
            with atomic_directory(out, may_replace=may_replace) as tmp:
                (tmp / "new.bin").write_bytes(b"new")
        assert [p.name for p in out.iterdir()] == ["old.bin"] and leftovers(tmp_path) == []

    seen = []
    with atomic_directory(out, may_replace=seen.append) as tmp:
        (tmp / "new.bin").write_bytes(b"new")
    assert seen == [out] and [p.name for p in out.iterdir()] == ["new.bin"]
    assert leftovers(tmp_path) == []  # the old directory is deleted too


def test_atomic_directory_never_overwrites_what_appeared_meanwhile(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_directory(out) as tmp:
            (tmp / "new.bin").write_bytes(b"new")
            out.mkdir()
            (out / "theirs.bin").write_bytes(b"theirs")  # another writer finished first
    assert [p.name for p in out.iterdir()] == ["theirs.bin"] and leftovers(tmp_path) == []


def test_atomic_directory_loses_the_race_cleanly(tmp_path, monkeypatch):
    out = tmp_path / "ds"
    real_rename = os.rename

    def rename_after_another_writer(src, dst):
        os.mkdir(out)
        (out / "theirs.bin").write_bytes(b"theirs")  # lands between the check and the rename
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", rename_after_another_writer)
    with pytest.raises(FileExistsError, match="appeared while it was being written"):
        with atomic_directory(out) as tmp:
            (tmp / "new.bin").write_bytes(b"new")
    assert [p.name for p in out.iterdir()] == ["theirs.bin"] and leftovers(tmp_path) == []


def test_stale_temporary_directories_are_removed_and_nothing_else(tmp_path):
    """What a writer killed in the middle of filling atomic_directory's temporary directory leaves (an asynchronous
    sharded save's writer processes, say) is removed on the next start; complete directories and links stay."""
    half = temp_directory(tmp_path / "step_0000003-ab12cd34")
    (half / "__0_0.distcp").write_bytes(b"half")
    complete = tmp_path / "step_0000002-0123abcd"
    complete.mkdir()
    (complete / ".metadata").write_bytes(b"m")
    (tmp_path / ".last.dcp.tmp-123").symlink_to(complete)  # a link: remove_stale_temp_links' business
    assert remove_stale_temp_directories(tmp_path) == [half]
    assert not half.exists() and (complete / ".metadata").exists() and (tmp_path / ".last.dcp.tmp-123").is_symlink()
