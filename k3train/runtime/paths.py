"""The cache root: prepared data (the built-in corpus) and CPU peak calibrations live under it.

`paths.cache` in the config (conf/paths/default.yaml) is $K3TRAIN_CACHE, else ~/.cache/k3train; the runner exports
the composed value as K3TRAIN_CACHE so that every reader in the process and its children agrees on one root.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CACHE = "~/.cache/k3train"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """cache_dir when given, else $K3TRAIN_CACHE, else ~/.cache/k3train; `~` expanded."""
    return Path(cache_dir or os.environ.get("K3TRAIN_CACHE") or DEFAULT_CACHE).expanduser()
