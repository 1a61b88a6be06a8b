"""Health figures a layer gathers over its training forwards between two reads (a train event's window): running
means and minimums kept as tensors on the layer's device, so a forward adds no host sync; `read()` makes the floats
and starts a new window. KDA's gates and each block's residual stream use it (KimiK3.diagnostics reads them)."""

from __future__ import annotations

import torch


class WindowStats:
    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.mins: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def mean(self, name: str, value: torch.Tensor) -> None:
        """Fold a batch's mean (a 0-dim tensor) into `name`'s running mean over the window's forwards."""
        value = value.detach().float()
        self.sums[name] = value if name not in self.sums else self.sums[name] + value
        self.counts[name] = self.counts.get(name, 0) + 1

    @torch.no_grad()
    def min(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.mins[name] = value if name not in self.mins else torch.minimum(self.mins[name], value)

    def read(self) -> dict[str, float]:
        """The window's figures ({} when no training forward ran since the last read); starts a new window."""
        out = {name: (total / self.counts[name]).item() for name, total in self.sums.items()}
        out.update((name, value.item()) for name, value in self.mins.items())
        self.sums, self.counts, self.mins = {}, {}, {}
        return out
