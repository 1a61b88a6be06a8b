"""Range checks for optimizer settings that name the bad setting: `optim.lr=nan must be a finite number >= 0`.

A NaN compares false with everything, so `lr < 0` lets it through; every check here first requires a finite
number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def check_number(
    key: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False
) -> None:
    """Raise ValueError naming `key` unless value is a finite number in the interval [low, high] ("(" / ")" open)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lower = f"> {low:g}" if low_open else f">= {low:g}"
        upper = "" if high == math.inf else (f" and < {high:g}" if high_open else f" and <= {high:g}")
        raise ValueError(f"{key}={value} must be a finite number {lower}{upper}")


def check_int(key: str, value: Any, *, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key}={value} must be an integer >= {low}")


def check_adamw_settings(prefix: str, lr: Any, weight_decay: Any, betas: Sequence[Any], eps: Any) -> None:
    """The settings both optimizers share; prefix is "optim." from the config, "" for direct construction."""
    check_number(f"{prefix}lr", lr, low=0)
    check_number(f"{prefix}weight_decay", weight_decay, low=0)
    if len(betas) != 2:
        raise ValueError(f"{prefix}betas={list(betas)} must be two numbers in [0, 1)")
    for i, beta in enumerate(betas):
        check_number(f"{prefix}betas[{i}]", beta, low=0, high=1, high_open=True)
    check_number(f"{prefix}eps", eps, low=0, low_open=True)


def check_muon_settings(
    prefix: str, momentum: Any, ns_steps: Any, rms_match: Any, orthogonality_check_interval: Any
) -> None:
    check_number(f"{prefix}momentum", momentum, low=0, high=1, high_open=True)
    check_int(f"{prefix}ns_steps", ns_steps, low=1)
    check_number(f"{prefix}rms_match", rms_match, low=0, low_open=True)
    check_int(f"{prefix}orthogonality_check_interval", orthogonality_check_interval, low=1)
