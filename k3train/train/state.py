"""Checkpoint parts the Trainer owns besides the model and the loaders: its counters and the optimizer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch


@dataclass
class TrainState:
    """The loop's counters."""

    step: int = 0  # successful optimizer updates: the schedule's position
    tokens: int = 0  # training tokens consumed, skipped updates included (they consumed data)
    skipped_updates: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state[f.name])


class ConfiguredOptimizer:
    """The optimizer as a checkpoint part: its state (moments, momentum buffers, step counts) comes from the
    checkpoint, its hyperparameters (lr, weight decay, betas, momentum...) from the current config, so a resume
    may change them on purpose. After a load, `changed` maps "group.setting" to [old, new] for each change."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.changed: dict[str, list] = {}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        current = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        self.changed = {}
        for group, settings in zip(self.optimizer.param_groups, current):
            for key, value in settings.items():
                if key != "lr" and group.get(key) != value:  # lr is re-derived from initial_lr every update
                    self.changed[f"{group.get('name', '?')}.{key}"] = [group.get(key), value]
            group.update(settings)
