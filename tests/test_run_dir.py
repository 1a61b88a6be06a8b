"""The run directory through the CLI: one writer, refused starts that leave no trace, finished runs that stay
finished, stale temporary files, unknown keys, write failures and world size (issue 8)."""

import errno
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

TINY = [
    "model=smoke_test_lm",
    "train.batch_size=2",
    "train.seq_len=32",
    "train.log_interval=1",
    "train.eval_batches=2",
    "train.progress=lines",
    "schedule.warmup_steps=1",
]


def hashes(directory):
    """Every file below directory (.hydra/ and hidden files included) by its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture
def finished_run(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(*TINY, "train.max_steps=2", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    return run_dir


# ---- defect 5: a refused resume leaves every file of the run, .hydra/ included, byte-identical -------------------
def test_a_refused_resume_leaves_every_file_byte_identical(run_cli, finished_run):
    before = hashes(finished_run)
    assert ".hydra/overrides.yaml" in before
    proc = run_cli(*TINY, "train.max_steps=4", "model.d_model=32", "resume=auto", f"hydra.run.dir={finished_run}")
    assert proc.returncode == 2 and "d_model was 64, now 32" in proc.stderr
    assert hashes(finished_run) == before


# ---- defect 4: a finished run stays finished ----------------------------------------------------------------------
def test_resuming_a_finished_run_says_so_and_touches_nothing(run_cli, finished_run):
    before = hashes(finished_run)
    proc = run_cli(*TINY, "train.max_steps=2", "resume=auto", f"hydra.run.dir={finished_run}")
    assert proc.returncode == 0, proc.stderr
    assert "is a finished run (it reached train.max_steps=2 at step 2); nothing to do" in proc.stdout
    assert hashes(finished_run) == before


def test_resuming_a_run_whose_data_ran_out_touches_nothing(run_cli, tmp_path, tiny_data_dir):
    run_dir = tmp_path / "run"
    common = [
        *TINY,
        "data=prepared",
        f"data.path={tiny_data_dir}",
        "train.max_steps=null",
        "train.eval_interval=0",
        f"hydra.run.dir={run_dir}",
    ]
    assert run_cli(*common).returncode == 0
    assert read_metrics(run_dir / "metrics.jsonl")[-1]["reason"] == "end_of_data"
    before = hashes(run_dir)
    proc = run_cli(*common, "resume=auto")
    assert proc.returncode == 0, proc.stderr
    assert "its train split is used up" in proc.stdout
    assert hashes(run_dir) == before


# ---- defect 6: one writer per run directory ------------------------------------------------------------------------
def test_a_second_writer_is_refused_naming_the_directory_and_the_holder(k3_cache, run_cli, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache), "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "k3train",
            *TINY,
            "train.max_steps=1000000",
            "train.checkpoint_interval=0",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in first.stdout:  # the first writer is training
            if "| loss " in line:
                break
        hydra_before = hashes(run_dir / ".hydra")
        second = run_cli(*TINY, "train.max_steps=1000000", "resume=auto", f"hydra.run.dir={run_dir}")
        assert second.returncode == 2
        assert error_lines(second) == [
            f"k3train: error: {run_dir} is in use by another k3train process "
            f"(pid {first.pid}): wait for it to end, or choose another hydra.run.dir"
        ]
        assert hashes(run_dir / ".hydra") == hydra_before
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [s["end_reason"] for s in sessions] == ["signal:SIGTERM"]  # the second writer added nothing
    # once the holder is gone (the OS released its lock), the run continues
    proc = run_cli(*TINY, f"train.max_steps={sessions[0]['final_step'] + 1}", "resume=auto", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / ".lock").read_text().strip().isdigit()


def test_a_lock_held_by_another_process_refuses_the_start_and_changes_nothing(run_cli, finished_run):
    before = hashes(finished_run)
    with open(finished_run / ".lock", "r+") as holder:  # this test process plays the live writer
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = run_cli(*TINY, "train.max_steps=4", "resume=auto", f"hydra.run.dir={finished_run}")
    assert proc.returncode == 2 and f"{finished_run} is in use by another k3train process (pid " in proc.stderr
    assert hashes(finished_run) == before


# ---- defect 7: stale temporary files of dead writers --------------------------------------------------------------
def test_stale_temp_files_of_dead_writers_are_removed_at_start(run_cli, finished_run):
    (finished_run / ".last.pt.tmp-999999").write_bytes(b"\0" * 100_000)  # a kill during a checkpoint write
    (finished_run / ".run.json.tmp-999998").write_bytes(b"")  # a full disk during a manifest write
    proc = run_cli(*TINY, "train.max_steps=3", "resume=auto", f"hydra.run.dir={finished_run}")
    assert proc.returncode == 0, proc.stderr
    assert "removed 2 temporary file(s) left by an interrupted writer" in proc.stdout
    assert not list(finished_run.glob(".*.tmp-*"))
    assert load_checkpoint(finished_run / "last.pt")["trainer"]["step"] == 3


def test_a_finished_run_removes_a_dead_writers_temp_file_and_touches_nothing_else(run_cli, finished_run):
    """A kill after the final checkpoint, while run.json was being rewritten, leaves its temporary file; resuming the
    finished run must not leave it there for ever (the fault trials met this)."""
    before = hashes(finished_run)
    (finished_run / ".run.json.tmp-999998").write_bytes(b"{")
    proc = run_cli(*TINY, "train.max_steps=2", "resume=auto", f"hydra.run.dir={finished_run}")
    assert proc.returncode == 0, proc.stderr
    assert "is a finished run" in proc.stdout
    assert not list(finished_run.glob(".*.tmp-*")) and hashes(finished_run) == before


# ---- defect 15: a refused start leaves no directory behind ----------------------------------------------------------
REFUSED = [
    (["data=prepared"], "data.path is not set: add data.path=... to the command"),
    (["data=prepared", "data.path=/nonexistent/data"], "does not exist"),
    (["train.max_steps=0"], "train.max_steps must be >= 1"),
    (["+train.max_stpes=5"], "unknown key train.max_stpes: did you mean train.max_steps"),  # defect 14
    (["++train.max_stpes=5"], "unknown key train.max_stpes: did you mean train.max_steps"),
]
if not torch.cuda.is_available():
    REFUSED.append((["train.device=cuda"], "CUDA is not available"))


@pytest.mark.parametrize("overrides,message", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_a_refused_start_says_one_line_and_leaves_no_directory(run_cli, tmp_path, overrides, message):
    run_dir = tmp_path / "outputs" / "runs" / "day" / "time"
    proc = run_cli(*TINY, "train.max_steps=2", *overrides, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("k3train: error: ") and message in lines[0], proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_refused_start_never_removes_a_directory_that_existed(run_cli, tmp_path):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    proc = run_cli(*TINY, "data=prepared", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]  # no .hydra/, no .lock


# ---- a launcher environment set by hand, half-way --------------------------------------------------------------------
def test_a_half_set_launcher_environment_is_refused_before_any_directory_is_written(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun --nproc_per_node=2 sets in each process, beside MASTER_PORT
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    proc = run_cli(*TINY, "train.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and "MASTER_PORT is not" in lines[0] and "torchrun" in lines[0]
    assert not (tmp_path / "run").exists()


# ---- defect 8: a full disk or a read-only directory ---------------------------------------------------------------
# Runs k3train with every fsync failing once the first checkpoint is written: the next checkpoint and the
# session's end in run.json both fail, as on a disk that has just filled up.
FAILING_DISK = """
import errno, os, runpy, sys
import torch
code = getattr(errno, os.environ["FAIL_ERRNO"])
real_save, real_fsync, state = torch.save, os.fsync, {"checkpoints": 0}
def save(obj, f, *args, **kwargs):
    if state["checkpoints"] >= 1:
        f.write(b"partial")
        raise OSError(code, os.strerror(code))
    state["checkpoints"] += 1
    return real_save(obj, f, *args, **kwargs)
def fsync(fd):
    if state["checkpoints"] >= 1 and not os.path.isdir(f"/proc/self/fd/{fd}") and state.get("armed"):
        raise OSError(code, os.strerror(code))
    return real_fsync(fd)
torch.save, os.fsync = save, fsync
import k3train.train.trainer as trainer
real_after = trainer.Trainer.save
def after_save(self, wait=None):
    real_after(self, wait)
    state["armed"] = True  # from now on the disk is full
trainer.Trainer.save = after_save
sys.argv = ["k3train", *sys.argv[1:]]
runpy.run_module("k3train", run_name="__main__")
"""


@pytest.mark.parametrize("code,fix", [("ENOSPC", "free disk space"), ("EROFS", "make {run_dir} writable")])
def test_a_failed_write_ends_in_one_line_and_keeps_the_previous_checkpoint(k3_cache, tmp_path, code, fix):
    run_dir = tmp_path / "run"
    env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache), "FAIL_ERRNO": code}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            FAILING_DISK,
            *TINY,
            "train.max_steps=4",
            "train.checkpoint_interval=2",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    lines = error_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(
        f"k3train: error: writing {run_dir / 'last.pt'} failed at step 4 ("
        f"{os.strerror(getattr(errno, code))}); last.pt of step 2 is kept; {fix.format(run_dir=run_dir)}"
    )
    assert lines[0].endswith("then continue with resume=auto")
    assert load_checkpoint(run_dir / "last.pt")["trainer"]["step"] == 2
    assert not list(run_dir.glob(".*.tmp-*"))
    # the manifest write at the end failed too: run.json is the previous complete one, still readable
    assert json.loads((run_dir / "run.json").read_text())["sessions"][-1]["end_reason"] is None


@pytest.fixture
def read_only_mount(tmp_path):
    """A tmpfs that can be remounted read-only (root bypasses file modes, so chmod cannot make one)."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_read_only_run_directory_is_refused_in_one_line(run_cli, read_only_mount):
    run_dir = read_only_mount / "run"
    assert run_cli(*TINY, "train.max_steps=2", f"hydra.run.dir={run_dir}").returncode == 0
    before = hashes(run_dir)
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    proc = run_cli(*TINY, "train.max_steps=4", "resume=auto", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and f"cannot lock the run directory {run_dir} (Read-only file system" in lines[0]
    assert hashes(run_dir) == before
