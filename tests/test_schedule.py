"""LRSchedule's factor against values worked out by hand at named steps and against torch.optim.lr_scheduler's
LinearLR and CosineAnnealingLR, which implement the same warmup, cosine and linear decay by a different route.

factor(step) is the multiplier of the update that follows `step` completed updates (step 0: the first update)."""

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR

from k3train.optim.schedule import LRSchedule


def torch_factors(make_scheduler, epochs: int) -> list[float]:
    """The lr of epochs 0..epochs-1 of a torch scheduler over one group of lr 1 (scheduler.step() between)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(optimizer)
    factors = []
    for _ in range(epochs):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return factors


def factors(schedule: LRSchedule, steps: range) -> list[float]:
    return [schedule.factor(step) for step in steps]


# --- warmup ------------------------------------------------------------------------------------------------------


def test_warmup_climbs_linearly_from_one_warmup_step_to_the_peak():
    s = LRSchedule(total_steps=100, decay="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert s.factor(0) == pytest.approx(0.1)  # the first update already moves: 1/10 of the peak, not 0
    assert s.factor(4) == pytest.approx(0.5)
    assert s.factor(9) == pytest.approx(1.0)  # warmup's last update reaches the peak...
    assert s.factor(10) == pytest.approx(1.0)  # ...and the first after it is at the peak: cosine starts there
    warm = factors(s, range(10))
    assert all(b - a == pytest.approx(0.1) for a, b in zip(warm, warm[1:]))  # equal steps up
    # torch's LinearLR from 1/10 of the lr to all of it over the 9 steps between the 10 warmup updates
    assert warm == pytest.approx(torch_factors(lambda o: LinearLR(o, 0.1, 1.0, total_iters=9), 10))


def test_without_warmup_the_first_update_is_at_the_peak():
    for decay in ("cosine", "constant", "wsd"):
        assert LRSchedule(total_steps=20, decay=decay, warmup_steps=0).factor(0) == 1.0, decay


# --- cosine ------------------------------------------------------------------------------------------------------

# 10 warmup updates, then 101 cosine updates (steps 10..110) whose 100 intervals run from the peak to the floor.
COSINE = dict(total_steps=111, decay="cosine", warmup_steps=10, min_lr_ratio=0.1)


@pytest.mark.parametrize(
    "step, factor",
    [
        (10, 1.0),  # the peak
        (35, 0.868198),  # a quarter of the way: 0.1 + 0.9 * (1 + cos(pi/4)) / 2 = 0.1 + 0.45 * 1.707107
        (60, 0.55),  # halfway: half-way between the peak and the floor
        (85, 0.231802),  # three quarters: 0.1 + 0.45 * (1 - 0.707107)
        (110, 0.1),  # the last planned update is at the floor
        (500, 0.1),  # past the plan (a run resumed with more steps): stays at the floor
    ],
)
def test_cosine_at_named_steps(step, factor):
    assert LRSchedule(**COSINE).factor(step) == pytest.approx(factor, abs=1e-6)


def test_cosine_decreases_every_update_from_the_peak_to_the_floor():
    decay = factors(LRSchedule(**COSINE), range(10, 111))
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[0] == 1.0 and decay[-1] == pytest.approx(0.1)
    # symmetric about the midpoint, as a half cosine is: f(60 - k) - 0.55 == 0.55 - f(60 + k)
    assert [a - 0.55 for a in decay[:50]] == pytest.approx([0.55 - b for b in decay[:50:-1]], abs=1e-9)


def test_cosine_equals_torch_cosine_annealing_after_the_warmup():
    s = LRSchedule(**COSINE)
    want = torch_factors(lambda o: CosineAnnealingLR(o, T_max=100, eta_min=0.1), 101)
    assert factors(s, range(10, 111)) == pytest.approx(want, abs=1e-9)


# --- constant ----------------------------------------------------------------------------------------------------


def test_constant_is_warmup_then_the_peak_for_good():
    c = LRSchedule(total_steps=50, decay="constant", warmup_steps=5, min_lr_ratio=0.3)  # the floor plays no part
    assert factors(c, range(5)) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert set(factors(c, range(5, 60))) == {1.0}
    assert factors(c, range(60)) == pytest.approx(torch_factors(lambda o: LinearLR(o, 0.2, 1.0, total_iters=4), 60))


# --- warmup-stable-decay -----------------------------------------------------------------------------------------

# 100 updates: 10 warmup, stable to step 79, the last 20 (steps 80..99) decay linearly toward the floor.
WSD = dict(total_steps=100, decay="wsd", warmup_steps=10, decay_fraction=0.2)


@pytest.mark.parametrize(
    "min_lr_ratio, step, factor",
    [
        (0.0, 10, 1.0),  # stable from the end of the warmup...
        (0.0, 79, 1.0),  # ...to the last update before the decay
        (0.0, 80, 1.0),  # the decay starts from the peak
        (0.0, 81, 0.95),  # one of 20 decay steps down
        (0.0, 90, 0.5),  # half-way through the decay
        (0.0, 99, 0.05),  # the last update still moves (a factor of 0 would waste it)
        (0.0, 100, 0.0),  # past the plan: the floor
        (0.1, 90, 0.55),  # half-way between the peak and a floor of 0.1
        (0.1, 99, 0.145),  # 1 - 0.9 * 19/20
        (0.1, 300, 0.1),
    ],
)
def test_wsd_at_named_steps(min_lr_ratio, step, factor):
    assert LRSchedule(**WSD, min_lr_ratio=min_lr_ratio).factor(step) == pytest.approx(factor, abs=1e-12)


def test_wsd_holds_the_peak_then_falls_every_decay_update_as_torch_linear_lr():
    s = LRSchedule(**WSD, min_lr_ratio=0.1)
    assert set(factors(s, range(10, 81))) == {1.0}
    decay = factors(s, range(80, 101))
    assert all(a > b for a, b in zip(decay, decay[1:]))
    want = torch_factors(lambda o: LinearLR(o, 1.0, 0.1, total_iters=20), 21)  # from the peak to 0.1 in 20 steps
    assert decay == pytest.approx(want, abs=1e-9)


def test_wsd_decay_fraction_sets_the_length_of_the_decay():
    s = LRSchedule(total_steps=100, decay="wsd", warmup_steps=0, min_lr_ratio=0.0, decay_fraction=0.5)
    assert s.factor(49) == 1.0 and s.factor(50) == 1.0 and s.factor(51) == pytest.approx(0.98)
    assert s.factor(75) == pytest.approx(0.5)


# --- applying it -------------------------------------------------------------------------------------------------


def test_apply_scales_every_group_from_initial_lr():
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 0.5}])
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    s = LRSchedule(total_steps=10, decay="constant", warmup_steps=4, min_lr_ratio=1.0)
    assert s.apply(opt, 1) == pytest.approx(0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.25])
    s.apply(opt, 3)  # from initial_lr each time, not from the lr the last call set
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.5])


@pytest.mark.parametrize(
    "kwargs", [dict(decay="linear"), dict(warmup_steps=-1), dict(min_lr_ratio=2.0), dict(total_steps=0)]
)
def test_bad_schedule_is_rejected(kwargs):
    with pytest.raises(ValueError, match="schedule|total_steps"):
        LRSchedule(**{"total_steps": 10, **kwargs})
