import math

import pytest
import torch

from k3train.optim.schedule import LRSchedule


def test_warmup_is_linear_and_reaches_peak():
    s = LRSchedule(total_steps=100, decay="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert [s.factor(i) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert s.factor(9) == pytest.approx(1.0)
    assert s.factor(10) == pytest.approx(1.0)  # first post-warmup update is at the peak


def test_cosine_reaches_floor_at_last_update_and_is_monotone():
    s = LRSchedule(total_steps=100, decay="cosine", warmup_steps=10, min_lr_ratio=0.1)
    values = [s.factor(i) for i in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert s.factor(99) == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2
    assert s.factor(int(mid)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))
    assert s.factor(500) == pytest.approx(0.1)  # past the plan (a resumed run with more steps): stays at floor


def test_constant_and_wsd():
    c = LRSchedule(total_steps=50, decay="constant", warmup_steps=5, min_lr_ratio=1.0)
    assert c.factor(4) == pytest.approx(1.0) and c.factor(49) == 1.0 and c.factor(0) == pytest.approx(0.2)
    w = LRSchedule(total_steps=100, decay="wsd", warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    assert w.factor(50) == 1.0 and w.factor(79) == 1.0
    assert w.factor(80) == pytest.approx(1.0)  # decay starts from the peak...
    assert w.factor(81) == pytest.approx(1 - 1 / 20)
    assert w.factor(99) == pytest.approx(1 / 20)  # ...and the last update still moves
    assert w.factor(100) == pytest.approx(0.0)


def test_apply_scales_every_group_from_initial_lr():
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 0.5}])
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    s = LRSchedule(total_steps=10, decay="constant", warmup_steps=4, min_lr_ratio=1.0)
    s.apply(opt, 1)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.25])


@pytest.mark.parametrize(
    "kwargs", [dict(decay="linear"), dict(warmup_steps=-1), dict(min_lr_ratio=2.0), dict(total_steps=0)]
)
def test_bad_schedule_is_rejected(kwargs):
    with pytest.raises(ValueError, match="schedule|total_steps"):
        LRSchedule(**{"total_steps": 10, **kwargs})
