"""The NaN guard (tests/helpers/nan_guard.py) holds where the suite's numbers are made: in this process and in the
gloo ranks both spawning helpers start."""

import pytest
import torch

from helpers.nan_guard import NAN_EMPTY
from helpers.spawn import spawn_ranks

pytestmark = pytest.mark.skipif(not NAN_EMPTY, reason="K3TRAIN_NAN_EMPTY=0 turns the NaN guard off")


def _fresh(rank: int, world_size: int) -> dict:
    like = torch.empty_like(torch.zeros(2))
    return {"empty": torch.empty(3), "like": like, "ints": torch.empty(2, dtype=torch.int64)}


def test_empty_reads_nan_here() -> None:
    assert _fresh(0, 1)["empty"].isnan().all() and _fresh(0, 1)["like"].isnan().all()
    assert (_fresh(0, 1)["ints"] == torch.iinfo(torch.int64).max).all()


def test_empty_reads_nan_in_spawned_ranks(tmp_path) -> None:
    """spawn_ranks' processes import helpers.spawn and the test module, not conftest: they install the guard."""
    for rank in spawn_ranks(_fresh, tmp_path):
        assert rank["empty"].isnan().all() and rank["like"].isnan().all()
        assert (rank["ints"] == torch.iinfo(torch.int64).max).all()


def test_gloo_ranks_read_nan(gloo_ranks, tmp_path) -> None:
    for rank in gloo_ranks(_fresh, tmp_path):
        assert rank["empty"].isnan().all() and rank["like"].isnan().all()
