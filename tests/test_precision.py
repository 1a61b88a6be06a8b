"""precision=bf16/fp16 on a CPU: a warning with the measured slowdown where half precision is slow."""

from __future__ import annotations

import types

import pytest
import torch

from k3train.runtime import cpu as cpu_module
from k3train.runtime.cpu import matmul_slowdown
from k3train.train import precision as precision_module
from k3train.train.precision import Precision


def test_slow_half_precision_on_cpu_warns_with_the_ratio(monkeypatch, capsys) -> None:
    monkeypatch.setattr(precision_module, "matmul_slowdown", lambda dtype: 37.25)  # an AVX2-only CPU
    warning = Precision("bf16").check_device(torch.device("cpu"))
    assert warning is not None and "37.2x slower than fp32" in warning and "use precision=fp32" in warning
    assert warning in capsys.readouterr().err


def test_fast_half_precision_and_fp32_do_not_warn(monkeypatch) -> None:
    monkeypatch.setattr(precision_module, "matmul_slowdown", lambda dtype: 0.3)  # AMX: bf16 faster than fp32
    assert Precision("bf16").check_device(torch.device("cpu")) is None
    assert Precision("fp16").check_device(torch.device("cpu")) is None

    def never(dtype):
        raise AssertionError("fp32 needs no measurement")

    monkeypatch.setattr(precision_module, "matmul_slowdown", never)
    assert Precision("fp32").check_device(torch.device("cpu")) is None


class MatmulClock:
    """matmul_slowdown's clock made deterministic: time passes only in `x @ x`, by what that call costs.
    costs[dtype]: seconds of each call in turn (a list) or of every call (a number). `calls`: the dtypes multiplied,
    in order."""

    def __init__(self, monkeypatch, costs: dict):
        self.now, self.costs, self.calls = 0.0, costs, []
        monkeypatch.setattr(cpu_module, "time", types.SimpleNamespace(perf_counter=lambda: self.now))
        monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: self.matmul(a, b))

    def matmul(self, a, b):
        cost = self.costs[a.dtype]
        self.now += cost if isinstance(cost, float) else cost[self.calls.count(a.dtype)]
        self.calls.append(a.dtype)


MS = 2.0**-10  # about a millisecond, exact in binary: the ratios below come out exact


def test_matmul_slowdown_is_the_best_half_precision_time_over_the_best_fp32_time(monkeypatch) -> None:
    # Round 0 warms up and is not counted (its fp32 call is the fastest of all); the other rounds' best of each
    # dtype are 2 ms and 74 ms, each beside a slower round (another process's load).
    fp32 = [MS / 64, 4 * MS, 2 * MS, 3 * MS]
    bf16 = [900 * MS, 80 * MS, 74 * MS, 500 * MS]
    clock = MatmulClock(monkeypatch, {torch.float32: fp32, torch.bfloat16: bf16})
    assert matmul_slowdown(torch.bfloat16, n=8, rounds=3, budget_s=10.0) == 37.0
    assert clock.calls == [torch.float32, torch.bfloat16] * 4  # interleaved, warm-up round first


def test_matmul_slowdown_stops_after_the_round_that_runs_past_the_budget(monkeypatch) -> None:
    # 0.4 s per round: round 0 (warm-up) ends at 0.4 s, round 1 at 0.8 s > 0.5 s, so 2 rounds of the 11 asked for.
    clock = MatmulClock(monkeypatch, {torch.float32: 0.1, torch.float16: 0.3})
    assert matmul_slowdown(torch.float16, n=8, rounds=10, budget_s=0.5) == pytest.approx(3.0)
    assert clock.calls == [torch.float32, torch.float16] * 2


@pytest.mark.parametrize(
    "dtype, ratio, shown",
    [
        ("bf16", 37.0, "37.0x"),  # no native bf16 (AVX2): tens of times slower
        ("fp16", 1.625, "1.6x"),  # just over the 1.5x threshold
    ],
)
def test_a_measured_slow_half_precision_warns_with_its_ratio(monkeypatch, capsys, dtype, ratio, shown) -> None:
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    MatmulClock(monkeypatch, {torch.float32: MS, half: ratio * MS})
    warning = Precision(dtype).check_device(torch.device("cpu"))
    assert warning is not None and f"a {dtype} matmul measured {shown} slower than fp32" in warning
    assert warning in capsys.readouterr().err


@pytest.mark.parametrize("dtype, ratio", [("bf16", 0.5), ("fp16", 1.0), ("bf16", 1.375)])  # AMX; par; under 1.5x
def test_a_measured_fast_half_precision_does_not_warn(monkeypatch, capsys, dtype, ratio) -> None:
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    clock = MatmulClock(monkeypatch, {torch.float32: MS, half: ratio * MS})
    assert Precision(dtype).check_device(torch.device("cpu")) is None
    assert clock.calls and set(clock.calls) == {torch.float32, half}  # it was measured, and found fast
    assert capsys.readouterr().err == ""
