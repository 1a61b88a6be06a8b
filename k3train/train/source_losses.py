"""A mixture's train loss per source: `train/<source>/loss` in the train events, beside the mixture's own loss.

The loss function adds each target's loss to the TargetLosses the update step hands the model's forward
(k3train/models/common/loss.py; k3train/train/step.py returns them: on the chunked path the same bits as the mean it
returns, no second pass); the loader says which source each row came from (MixtureLoader.sources_of). Per source,
the targets' losses and their count are summed over the updates of a log window (a skipped update's are dropped, as
the window's loss drops its) and over every rank: each token is on exactly one rank's rows (data-parallel ranks hold
other rows, context-parallel ranks other slices of the same rows, and only a pipeline's last stage computes losses).
So a source's figure is the mean loss of its tokens in the window, as the train loss is the mixture's; weighted by
the sources' token counts the figures give back the window's loss (tests/test_data_mixture.py checks it). A source
with no token in the window has no figure.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SourceLosses:
    def __init__(self, names: list[str]):
        self.names = list(names)
        # [loss sums, target counts] of the window and of the update in progress, on the losses' device from the
        # first update: summed there, so the update loop never waits on a copy to the host (summary() does, once
        # per log line)
        self._window: torch.Tensor | None = None
        self._update: torch.Tensor | None = None

    def add(self, recorded: list[tuple[torch.Tensor, torch.Tensor]], sources: torch.Tensor) -> None:
        """recorded: the (losses, kept) of an update's forwards, in the order of its rows; sources: each row's
        source index, int64 [rows]. A recording that does not cover the rows (a model that records nothing) adds
        nothing rather than a guess."""
        if not recorded:
            return
        losses = torch.cat([loss for loss, _ in recorded]).double()
        kept = torch.cat([k for _, k in recorded]).double()
        if losses.numel() % len(sources) != 0:
            raise ValueError(
                f"the recorded losses ({losses.numel()} targets) do not split into the update's {len(sources)} rows"
            )
        if self._update is None:
            self._window = torch.zeros(2, len(self.names), dtype=torch.float64, device=losses.device)
            self._update = torch.zeros_like(self._window)
        sources = sources.to(losses.device, non_blocking=True)
        self._update[0].index_add_(0, sources, losses.view(len(sources), -1).sum(1))
        self._update[1].index_add_(0, sources, kept.view(len(sources), -1).sum(1))

    def end_update(self, skipped: bool) -> None:
        """The update's sums into the window, or dropped with a skipped update."""
        if self._update is None:  # nothing recorded on this rank (a pipeline stage before the last)
            return
        if not skipped:
            self._window += self._update
        self._update.zero_()

    def summary(self, device: torch.device, group=None) -> dict[str, float]:
        """{source: mean target loss} over the window and every rank of `group`; a source with no token in the
        window is left out. Resets the window. A collective: every rank of the group calls it."""
        if self._window is None:
            sums = torch.zeros(2, len(self.names), dtype=torch.float64, device=device)
        else:
            sums = self._window.to(device, copy=True)  # a copy: the window is zeroed below
            self._window.zero_()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, group=group)
        sums = sums.cpu()
        return {name: (sums[0, i] / sums[1, i]).item() for i, name in enumerate(self.names) if sums[1, i] > 0}
