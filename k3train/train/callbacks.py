"""Hook points of the update loop, for what acts beside the optimizer (QK-Clip) or watches the run.

A callback subclasses Callback and overrides what it needs. The runner builds the callbacks listed under
`callbacks` in the config (conf/callbacks/; name -> `_target_` node) and the Trainer calls, for each one:

    setup(model, optimizer)     once, before the first update of the session
    after_optimizer_step(step)  after each successful update (the weights just changed; step counts it)
    after_skipped_step(step)    after an update skipped for a non-finite loss or gradient
    metrics() -> dict           its figures since the last call, logged in each train event under its name
    describe() -> str           one line for the run summary
"""

from __future__ import annotations

import torch
from torch import nn


class Callback:
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        pass

    def after_optimizer_step(self, step: int) -> None:
        pass

    def after_skipped_step(self, step: int) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def describe(self) -> str:
        return type(self).__name__
