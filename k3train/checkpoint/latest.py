"""The newest checkpoint of a run: what `resume=auto`, generate, evaluate, export and consolidate read from a run
directory.

A run keeps `last.pt` (one file) or, when sharded by FSDP2, `last.dcp` (a directory of shards); a run directory
that once held both (re-run with another parallel setting) continues from the newer, by modification time.
"""

from __future__ import annotations

from pathlib import Path

LATEST_NAMES = ("last.pt", "last.dcp")


def newest_checkpoint(run_dir: Path) -> Path | None:
    """run_dir/last.pt or run_dir/last.dcp, the newer if both exist; None if neither does."""
    own = [run_dir / name for name in LATEST_NAMES if (run_dir / name).exists()]
    return max(own, key=lambda p: p.stat().st_mtime) if own else None
