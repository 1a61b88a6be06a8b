"""k3train: a Hydra-composed trainer for Kimi K3-style language models (README.md). The one import for notebooks:

import k3train
model = k3train.load_model("outputs/runs/2026-12-01/14-51-14")   # or a checkpoint, an export, a HF directory
logits, _ = model(ids)                                            # ids [B, T] -> logits [B, T, V]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_model(path: str | Path, device: Any = "cpu") -> Any:
    """The model at `path`, in eval mode on `device`, from any format k3train reads: a run directory (its newest
    checkpoint), a checkpoint (.pt or .dcp), a k3train export, or a Hugging Face Kimi Linear / Kimi K3 directory.
    `model(ids)` with ids [B, T] returns (logits [B, T, V], None); k3train.inference.loading.load also gives the
    tokenizer and what the run trained on."""
    from k3train.inference.loading import load  # torch loads here, not at `import k3train`

    return load(path, device).model
