import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# tests/ on sys.path under any --import-mode (prepend, pytest's default, adds it too; importlib would not): the test
# files import what they share as `from helpers.NAME import ...` (tests/helpers/), never from another test file.
TESTS = str(REPO / "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
# As the non-training CLIs do (k3train/runtime/cpu.py): this file loads before any test imports torch, so the suite's
# threads, and those of the `python -m k3train` runs it starts, sleep instead of spinning when another job holds a
# core (the suite's processes often do, and most of its runs use train.cpu_threads=1 or tiny models).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The NaN guard (uninitialised memory reads as NaN: helpers/nan_guard.py), before any test module is collected; it
# imports torch, after OMP_WAIT_POLICY, which torch reads when it loads.
from helpers import nan_guard  # noqa: E402

nan_guard.install()


@pytest.fixture(scope="session")
def k3_cache(tmp_path_factory) -> Path:
    """One built-in corpus cache for the whole session (K3TRAIN_CACHE of CI, or a fresh temp dir)."""
    env = os.environ.get("K3TRAIN_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("k3train-cache")


@pytest.fixture(scope="session")
def builtin_data(k3_cache):
    from k3train.data import TokenData

    return TokenData.builtin(cache_dir=k3_cache)


@pytest.fixture
def run_cli(k3_cache):
    """Run `python -m k3train ...` in a subprocess; returns the CompletedProcess (text output)."""

    def run(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**os.environ, "K3TRAIN_CACHE": str(k3_cache), "PYTHONUNBUFFERED": "1"}
        return subprocess.run(
            [sys.executable, "-m", "k3train", *overrides],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """A prepared dataset of a few thousand byte tokens: small enough that a run can use it all up."""
    from helpers.data import make_dataset

    return make_dataset(tmp_path_factory.mktemp("tiny-data"), shard_tokens=1000)


@pytest.fixture
def one_thread():
    """For tests of tiny ops (pytestmark = pytest.mark.usefixtures("one_thread")): a thread pool only adds
    synchronisation, which stalls badly on a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_thread_environment(monkeypatch):
    """As a process started without OMP_NUM_THREADS or MKL_NUM_THREADS: both removed from the environment, and the
    record of what the process started with cleared too (restored afterwards). Without the second, importing any CLI
    module (its bootstrap() records the environment once per process) in an earlier test of the same worker keeps,
    say, a cluster's OMP_NUM_THREADS=1 as "the user's" after the test removed it."""
    from k3train.runtime import cpu

    for name in cpu.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu, "_thread_environment_at_start", None)
    return monkeypatch


def _gloo_rank(rank: int, fn, world_size: int, workdir: Path, args: tuple) -> None:
    """One spawned rank: join the gloo group through a file in workdir, run fn, save its result for the parent."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    # A collective that one rank never reaches raises after this long instead of blocking.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir / 'store'}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, workdir / f"rank{rank}.pt")
    from helpers.spawn import leave_without_finalizing

    leave_without_finalizing()


def run_on_gloo_ranks(fn, workdir: Path, *args, world_size: int = 2, timeout: float = 120) -> list:
    """fn(rank, world_size, *args) in world_size spawned processes joined in a gloo group -> each rank's result.
    fn must be importable (module level) and return what torch.load(weights_only=True) reads back. workdir: an
    empty directory of this call's own (the group's FileStore lives there, so concurrent tests never collide).
    A rank's exception fails the caller with its traceback; a run past `timeout` seconds is killed and fails."""
    import time

    import torch
    import torch.multiprocessing as mp

    context = mp.spawn(_gloo_rank, args=(fn, world_size, workdir, args), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{fn.__name__} on {world_size} gloo ranks did not finish within {timeout:.0f} s")
    return [torch.load(workdir / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


@pytest.fixture(scope="session")
def gloo_ranks():
    """run_on_gloo_ranks: spawn a gloo process group and collect what each rank returns."""
    return run_on_gloo_ranks


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, at=None): a tmpfs of `size` (e.g. "1m") at the new directory `at` (default tmp_path/tmpfs), for a
    real full disk; unmounted afterwards. Skips, saying why, where mounting is not permitted (not root)."""
    mounted: list[Path] = []

    def mount(size: str, at: Path | None = None) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        at = tmp_path / "tmpfs" if at is None else at
        at.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(at)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here: {proc.stderr.decode().strip()}")
        mounted.append(at)
        return at

    yield mount
    for at in mounted:
        subprocess.run(["umount", str(at)], check=True)


@pytest.fixture(autouse=True)
def one_slurm_test_at_a_time(request, tmp_path_factory):
    """README's test command spreads the files over two pytest-xdist workers (--dist loadfile: a file's tests, and
    its module fixtures, on one worker). The SLURM tests of two files would then share the one local SLURM node,
    whose CPUs each test's jobs expect to have to themselves: they take turns, through a lock in the directory the
    workers' temp directories share."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "slurm-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
