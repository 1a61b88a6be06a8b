"""How the ranks of a torchrun job end when another part of it dies: a rank whose peer was killed says so in one
line even when torchrun's SIGTERM reached it first, and the ranks of a torchrun that was killed stop on their own
(SIGTERM from the kernel: a checkpoint, then the end), leaving the last good checkpoint and the lock free."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.run import runner
from k3train.runtime.distributed import World

from helpers.distributed_runs import REPO, SMOKE

# What gloo raises in the survivor's collective once its peer is gone (torch 2.13, CPU)
GLOO_LOST_PEER = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"


class _SignalledFirst:
    """The run's StopSignals after torchrun's SIGTERM arrived; redelivery (which would end pytest) only noted."""

    received = signal.SIGTERM
    redelivered = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def redeliver(self, sig=None) -> None:
        self.redelivered = True


def test_a_rank_that_lost_its_peer_after_torchruns_sigterm_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    def fit():
        raise RuntimeError(GLOO_LOST_PEER)

    trainer = SimpleNamespace(signals=_SignalledFirst(), fit=fit, state=SimpleNamespace(step=5, tokens=0))
    metrics = SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(runner, "current_world", lambda: World(rank=0, size=2))
    monkeypatch.setattr(runner, "_open_session", lambda *args, **kwargs: (None, metrics))
    parts = {"trainer": trainer, "metrics": metrics, "data": None, "resume_path": None, "threads": None}
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        runner._train(None, tmp_path, parts, multirun=False)
    assert trainer.signals.redelivered  # the signal still ends the process, as torchrun expects
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr, stderr
    assert stderr.splitlines() == [
        "k3train: rank 0 of 2 lost contact with another rank in a collective (RuntimeError): that rank ended "
        "first; its own error, or the launcher's summary (torchrun's Root Cause, srun's task N), names it"
    ]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _ended(pid: int) -> bool:
    """Whether pid has exited (a zombie nobody reaps, its parent gone, counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_ranks_of_a_killed_torchrun_end_with_a_checkpoint_and_free_the_lock(k3_cache, tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMOKE, "train.max_steps=100000", "train.batch_size=2", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "k3train"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        torchrun = subprocess.Popen([*command, *args], cwd=REPO, env=env, stdout=out, stderr=err)
    ranks: list[int] = []
    try:
        checkpointed = _wait(lambda: (run_dir / "last.pt").exists() or torchrun.poll() is not None, 180)
        assert checkpointed and torchrun.poll() is None, (tmp_path / "err").read_text()[-3000:]
        ranks = _children(torchrun.pid)
        assert len(ranks) == 2, ranks
        torchrun.kill()
        torchrun.wait()
        assert _wait(lambda: all(_ended(rank) for rank in ranks), 30), "the ranks went on without their torchrun"
    finally:
        torchrun.kill()
        for rank in ranks:  # the ranks of this test alone, by pid
            if not _ended(rank):
                os.kill(rank, signal.SIGKILL)
    assert load_checkpoint(run_dir / "last.pt")["meta"]["step"] >= 2
    with open(run_dir / ".lock", "rb+") as lock:  # no rank holds it: a restart can claim the directory

        def claimed() -> bool:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        # Within seconds of the ranks' end (CI saw it still held at the instant they ended, on a loaded machine).
        assert _wait(claimed, 30), "the run directory's lock is still held 30 s after the ranks ended"


# `python -m k3train` as rank 0 of 2 whose run meets gloo's lost peer (no process group: nothing else needs one)
_LOSES_ITS_PEER = f"""
import sys
import k3train.__main__ as entry
from k3train.run import runner
from k3train.runtime import distributed

world = distributed.World(rank=0, size=2)
distributed.init_from_env = lambda env=None: world
distributed.current_world = lambda: world

def run(cfg):
    raise RuntimeError({GLOO_LOST_PEER!r})

runner.run = run
sys.argv = ["k3train", "hydra.run.dir=" + sys.argv[1]]
entry.main()
"""


def test_a_rank_that_lost_its_peer_before_any_signal_says_so_in_one_line(tmp_path):
    """The gloo error first, torchrun's SIGTERM not yet: the rank's one line, not Hydra's traceback after it."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(
        [sys.executable, "-c", _LOSES_ITS_PEER, str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        "k3train: rank 0 of 2 lost contact with another rank in a collective (RuntimeError): that rank ended "
        "first; its own error, or the launcher's summary (torchrun's Root Cause, srun's task N), names it"
    ]


def test_a_rank_whose_torchrun_is_pid_1_is_not_stopped():
    """A container whose entry point is torchrun: the ranks' parent is pid 1 from the start, which is no sign that
    it died (end_with_launcher compares with the parent at import only)."""
    code = (
        "import os\n"
        "from k3train.runtime import distributed\n"
        "distributed._PARENT_PID = 1\n"
        "os.getppid = lambda: 1\n"
        "assert distributed.end_with_launcher({'TORCHELASTIC_RUN_ID': 'test'})\n"
        "print('still running')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "still running", proc.stderr
