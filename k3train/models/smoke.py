"""SmokeTestLM: a plumbing check, not a language model.

Token-local embedding followed by a linear vocabulary head: logits at position t depend on token t alone, so
there is no attention, no sequence mixing and nothing of the Kimi K3 architecture. It exists to test the data,
trainer, checkpoint and metrics plumbing quickly; its losses must never be reported as model results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3train.models.common.init import InitialWeights, Normal, fill
from k3train.models.common.loss import TargetLosses


@dataclass
class SmokeTestConfig:
    vocab_size: int | None = None
    d_model: int = 64
    max_seq_len: int = 4096
    model_type: str = "smoke_test_lm"

    def __post_init__(self) -> None:
        if self.model_type != "smoke_test_lm":
            raise ValueError(f"SmokeTestConfig.model_type must be 'smoke_test_lm', got {self.model_type!r}")


class SmokeTestLM(nn.Module):
    log_label = "[plumbing: smoke_test_lm] "  # its numbers must never be read as model results
    config_class = SmokeTestConfig  # what from_fields builds (k3train/config_targets.py checks model.* by it)

    def __init__(self, config: SmokeTestConfig):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("SmokeTestLM needs vocab_size (model.vocab_size=null is filled from the dataset)")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if self.embed.weight.device.type != "meta":  # built whole here: drawn as any layout draws it
            fill(self, InitialWeights(self.init_rules(), torch.initial_seed()))

    def init_rules(self) -> dict[str, Normal]:
        """Normal(0.02) for both tables, drawn by counter (k3train/models/common/init.py)."""
        return {"embed.weight": Normal(0.02), "lm_head.weight": Normal(0.02)}

    @classmethod
    def from_fields(cls, **fields) -> SmokeTestLM:
        return cls(SmokeTestConfig(**fields))

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        target_losses: TargetLosses | None = None,
    ):
        """x: [B, T] token ids -> logits [B, T, V]; loss: mean cross-entropy over all B*T targets (fp32);
        target_losses: each target's loss added to it (a mixture's loss per source: k3train/models/common/loss.py).

        document_ids is taken and needs nothing done: logits at t read token t alone, so no document ever sees
        another; documents packed in a row are already masked from each other."""
        logits = self.lm_head(self.embed(x))
        loss = None
        if targets is not None:
            flat_logits, flat_targets = logits.float().view(-1, logits.size(-1)), targets.reshape(-1)
            loss = F.cross_entropy(flat_logits, flat_targets)
            if target_losses is not None:
                target_losses.add(F.cross_entropy(flat_logits, flat_targets, reduction="none"), flat_targets)
        return logits, loss

    def check_data(self, vocab_size: int, seq_len: int) -> None:
        if vocab_size != self.config.vocab_size:
            raise ValueError(
                f"model vocab_size {self.config.vocab_size} != dataset vocab_size {vocab_size}: "
                "set model.vocab_size=null to take it from the dataset"
            )
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"train.seq_len={seq_len} exceeds model.max_seq_len={self.config.max_seq_len}")

    def diagnostics(self) -> dict:
        return {}

    def param_counts(self) -> dict:
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "active": total, "embedding": self.embed.weight.numel()}
