import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# As `python -m k3train` does (k3train/train/cpu.py): this file loads before any test imports torch, so the suite's
# own threads sleep instead of spinning when another job holds a core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
        return subprocess.run([sys.executable, "-m", "k3train", *overrides], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """A prepared dataset of a few thousand byte tokens: small enough that a run can use it all up."""
    from data_helpers import make_dataset

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
