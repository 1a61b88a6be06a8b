"""What the planner assumes and searches under, one object through every function that plans (plan/estimate.py,
plan/search.py) rather than the same defaults repeated in each.

    mfu          the fraction of the datasheet peak FLOP/s the step's matmuls reach (--mfu; a stated assumption)
    headroom     the fraction of a device's memory kept free: the CUDA context, NCCL's buffers, the caching
                 allocator's fragmentation (--headroom)
    device_type  "cuda" or "cpu": whose kernels' shapes and memory the plan counts
    cp           the ranks each row's sequence is split over in every candidate (--cp, or the config's parallel.cp)
    cp_fixed     cp was asked for (--cp or --mesh): the recipe search keeps it rather than splitting rows further
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanSettings:
    mfu: float = 0.4
    headroom: float = 0.1
    device_type: str = "cuda"
    cp: int = 1
    cp_fixed: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu={self.mfu} must be in (0, 1]")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom={self.headroom} must be in [0, 1)")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type={self.device_type!r} must be cuda or cpu")
        if self.cp < 1:
            raise ValueError(f"cp={self.cp} must be >= 1")


DEFAULT_SETTINGS = PlanSettings()
