"""The run's plan: how many updates it makes (the number the lr schedule is built for) and when it is over."""

from __future__ import annotations

import math
from collections.abc import Callable

from k3train.config import TrainConfig
from k3train.train.state import TrainState


class TrainingPlan:
    """total_steps is the first limit the run will reach: train.max_steps, train.max_tokens, or the end of the train
    split (the stream never wraps). A checkpoint part: a resume keeps the saved total, and so the lr curve, unless
    max_steps or max_tokens changed (skipped updates consume data, so re-deriving it from the data left would shift
    the lr)."""

    def __init__(
        self, config: TrainConfig, state: TrainState, train_loader, tokens_per_update: int, schedule_factory: Callable
    ):
        self.config, self.state, self.train_loader = config, state, train_loader
        self.tokens_per_update = tokens_per_update
        self.total_steps = self._derive_total()
        self.schedule = schedule_factory(total_steps=self.total_steps)

    def _derive_total(self) -> int:
        c = self.config
        limits = []
        if c.max_steps is not None:
            limits.append(c.max_steps)
        if c.max_tokens is not None:
            limits.append(math.ceil(c.max_tokens / self.tokens_per_update))
        self.asked = min(limits, default=None)  # what max_steps / max_tokens ask for, the data aside
        self.data_limit = None  # the step at which the train split runs out
        if not c.overfit_batch:
            self.data_limit = self.state.step + self.train_loader.batches_remaining() // c.gradient_accumulation_steps
            limits.append(self.data_limit)
        if not limits:
            raise ValueError("train.overfit_batch=true needs train.max_steps or train.max_tokens")
        total = min(limits)
        if total < 1:
            raise ValueError(
                f"the train split has too few tokens for one update of {self.tokens_per_update} tokens: "
                "lower train.batch_size, train.seq_len or train.gradient_accumulation_steps"
            )
        return total

    def data_note(self) -> str | None:
        """Where the train split ends the run before train.max_steps / max_tokens would: said before it starts."""
        if self.data_limit is None or self.asked is None or self.data_limit >= self.asked:
            return None
        c = self.config
        asked = f"train.max_steps={c.max_steps}" if c.max_steps == self.asked else f"train.max_tokens={c.max_tokens:,}"
        return (
            f"the train split holds {self.data_limit - self.state.step:,} more updates of this batch "
            f"({self.tokens_per_update:,} tokens each): the run ends at step {self.data_limit:,} (end of data), "
            f"before {asked}; the stream never wraps"
        )

    def done(self) -> str | None:
        """Why the run as planned is over (max_steps, max_tokens, end_of_data), or None while work is left."""
        s, c = self.state, self.config
        if c.max_steps is not None and s.step >= c.max_steps:
            return "max_steps"
        if c.max_tokens is not None and s.tokens >= c.max_tokens:
            return "max_tokens"
        if not c.overfit_batch and self.train_loader.batches_remaining() < c.gradient_accumulation_steps:
            return "end_of_data"
        return None

    def state_dict(self) -> dict:
        return {
            "total_steps": self.total_steps,
            "max_steps": self.config.max_steps,
            "max_tokens": self.config.max_tokens,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore after the counters and the train loader (the Trainer adds this part after them)."""
        same_limits = (state["max_steps"], state["max_tokens"]) == (self.config.max_steps, self.config.max_tokens)
        self.total_steps = state["total_steps"] if same_limits else self._derive_total()
        self.schedule.total_steps = self.total_steps
