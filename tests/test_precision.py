"""precision=bf16/fp16 on a CPU: a warning with the measured slowdown where half precision is slow."""

from __future__ import annotations

import math

import pytest
import torch

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmul_slowdown_is_a_measured_ratio(dtype) -> None:
    ratio = matmul_slowdown(dtype, n=64, rounds=3)
    assert math.isfinite(ratio) and ratio > 0
