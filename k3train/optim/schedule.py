"""Learning-rate schedule: a multiplier of each param group's initial_lr, a pure function of the update count.

Because the factor depends only on the number of successful updates, the schedule's position is the Trainer's
step counter and needs no state of its own in a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("cosine", "constant", "wsd")


@dataclass
class LRSchedule:
    total_steps: int
    decay: str = "cosine"  # cosine | constant | wsd (warmup-stable-decay, linear decay at the end)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # floor, as a fraction of the peak lr
    decay_fraction: float = 0.2  # wsd only: the share of total_steps spent decaying

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"schedule.decay must be one of {DECAYS}, got {self.decay!r}")
        if self.total_steps < 1:
            raise ValueError(f"the schedule needs total_steps >= 1, got {self.total_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"schedule.decay_fraction must be in (0, 1], got {self.decay_fraction}")

    def factor(self, step: int) -> float:
        """Multiplier for the update that follows `step` completed updates (step counts from 0)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        if self.decay == "cosine":
            span = max(1, self.total_steps - 1 - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        decay_steps = max(1, round(self.decay_fraction * self.total_steps))
        decay_start = self.total_steps - decay_steps
        if step < decay_start:
            return 1.0
        # The last update still moves (factor > min_lr_ratio): with a floor of 0 it would otherwise be wasted.
        progress = min(1.0, (step - decay_start) / decay_steps)
        return 1.0 - (1.0 - self.min_lr_ratio) * progress

    def describe(self) -> str:
        """One line for the run summary, with a warning when the warmup outlasts the plan."""
        text = f"{self.decay}, warmup {self.warmup_steps}, {self.total_steps} updates"
        if self.decay != "constant":
            text += f", down to {self.min_lr_ratio:g} x lr"
        if self.decay == "wsd":
            text += f" over the last {self.decay_fraction:g} of them"
        if self.warmup_steps >= self.total_steps:
            text += (
                f"\n  warning: schedule.warmup_steps={self.warmup_steps} >= the {self.total_steps} planned "
                "updates: the lr never reaches its peak"
            )
        return text

    def apply(self, optimizer, step: int) -> float:
        """Set every group's lr for the next update; returns the factor."""
        f = self.factor(step)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * f
        return f
