"""Hook points of the update loop, for what acts beside the optimizer (QK-Clip, here) or watches the run.

A callback subclasses Callback and overrides what it needs. The runner builds the callbacks listed under
`callbacks` in the config (conf/callbacks/; name -> `_target_` node) and the Trainer calls, for each one:

    setup(model, optimizer, dims)  once, before the first update of the session (dims: the run's ParallelDims)
    after_optimizer_step(step)  after each successful update (the weights just changed; step counts it)
    after_skipped_step(step)    after an update skipped for a non-finite loss or gradient
    metrics() -> dict           its figures since the last call, logged in each train event under its name
    describe() -> str           one line for the run summary
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3train.optim.qk_clip import qk_clip_, reset_max_logits, set_max_logit_tracking
from k3train.runtime.parallel_dims import ParallelDims


class Callback:
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims) -> None:
        pass

    def after_optimizer_step(self, step: int) -> None:
        pass

    def after_skipped_step(self, step: int) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def describe(self) -> str:
        return type(self).__name__


class QKClip(Callback):
    """QK-Clip after every successful update, with threshold tau; its `metrics()` gather every update's clipping
    since the last train event: max logit per module (the largest seen) and the head it was in (the health panel's
    MLA figures), heads clipped, clip count."""

    def __init__(self, tau: float):
        if not tau > 0:
            raise ValueError(f"callbacks.qk_clip.tau={tau} must be > 0 (remove callbacks.qk_clip to turn QK-Clip off)")
        self.tau = tau
        self.model: nn.Module | None = None
        self.group: dist.ProcessGroup | None = None
        self.n_modules = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self.max_logit: dict[str, float] = {}
        self.max_logit_head: dict[str, int] = {}
        self.clipped_heads: dict[str, set] = {}
        self.n_clipped = 0

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims) -> None:
        self.model = model
        self.group = dims.dp_group
        self.n_modules = set_max_logit_tracking(model, True)

    def after_optimizer_step(self, step: int) -> None:
        if not self.n_modules:
            return
        result = qk_clip_(self.model, self.tau, self.group)
        for name, value in result["max_logit"].items():
            if name not in self.max_logit or not value <= self.max_logit[name]:  # NaN too, as max() kept it
                self.max_logit[name], self.max_logit_head[name] = value, result["max_logit_head"][name]
        for name, heads in result["clipped_heads"].items():
            self.clipped_heads.setdefault(name, set()).update(heads)
        self.n_clipped += result["n_clipped"]

    def after_skipped_step(self, step: int) -> None:
        if self.n_modules:
            reset_max_logits(self.model)  # measured by the failed forward: never act on it

    def metrics(self) -> dict:
        if not self.max_logit:
            return {}
        out = {
            "max_logit": self.max_logit,
            "max_logit_head": self.max_logit_head,
            "n_clipped": self.n_clipped,
            "clipped_heads": {k: sorted(v) for k, v in self.clipped_heads.items()},
        }
        self._reset_window()
        return out

    @staticmethod
    def merge(figures: list[dict]) -> dict:
        """metrics() of the ranks of a pipeline's stages as one: each measured its own MLA layers."""
        out: dict = {"max_logit": {}, "max_logit_head": {}, "n_clipped": 0, "clipped_heads": {}}
        for part in figures:
            out["max_logit"] |= part["max_logit"]
            out["max_logit_head"] |= part.get("max_logit_head", {})
            out["clipped_heads"] |= part["clipped_heads"]
            out["n_clipped"] += part["n_clipped"]
        return out

    def describe(self) -> str:
        if not self.n_modules:
            return "QK-Clip: off (the model has no attention module that measures its max logits)"
        return f"QK-Clip: tau {self.tau:g} on {self.n_modules} attention module(s)"
