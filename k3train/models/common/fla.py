"""flash-linear-attention (FLA), an optional dependency, as the code that calls its Triton kernels sees it: whether
it is installed and whether a tensor can go to its kernels. Shared by the KDA layer (k3train/models/kda/fla.py) and
the LM head's loss (loss.py); each imports FLA itself, on first use."""

from __future__ import annotations

import importlib.util
import os

from torch import Tensor

# Looked up once: the loss runs inside a compiled forward under train.compile, where an import lookup would break the
# graph.
FLA_INSTALLED = importlib.util.find_spec("fla") is not None


def fla_runs_on(x: Tensor) -> bool:
    """Whether FLA's Triton kernels can take x: a CUDA tensor, or any tensor under Triton's interpreter
    (TRITON_INTERPRET=1, which tests/fla runs them in on CPU tensors)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
