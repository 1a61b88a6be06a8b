"""An optional torch.profiler window; traces go to <run_dir>/profile/ (Chrome/Perfetto trace JSON)."""

from __future__ import annotations

from pathlib import Path

import torch


class _NoProfiler:
    def __enter__(self) -> _NoProfiler:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def step(self) -> None:
        pass


def make_profiler(config, run_dir: Path, device: torch.device):
    """A context manager whose step() is called once per optimizer attempt (skipped updates count)."""
    if not config.enabled:
        return _NoProfiler()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    out = Path(run_dir) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out)),
        record_shapes=True,
        profile_memory=True,
    )
