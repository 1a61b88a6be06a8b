"""Checkpoint files: atomic writes, safe loads, and the compatibility check a resume must pass.

A checkpoint is a dict of state dicts (model, optimizer, scaler, trainer counters, both loader cursors, RNG)
plus `meta`: the format version and the identities of the model config, recipe, optimizer layout and data.
It is written to a temporary file in the same directory, fsynced and renamed over the old one (files.write_atomic),
so a kill at any moment leaves either the previous checkpoint or the new one, never a torn file under the final name.
Loading uses torch.load(weights_only=True): opening a checkpoint never runs code from it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from k3train.files import write_atomic

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, of another format, or incompatible with this run."""


def save_checkpoint(path: Path, payload: dict) -> int:
    """Atomically write payload to path (see files.write_atomic); returns the file size in bytes."""
    return write_atomic(path, lambda f: torch.save(payload, f))


def load_checkpoint(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist: check the resume= path")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}). It is truncated, corrupt or not a "
            "k3train checkpoint; resume from an earlier one (keep_last_k keeps step_*.pt copies)"
        ) from exc
    if not isinstance(payload, dict) or "meta" not in payload:
        raise CheckpointError(f"{path} is not a k3train checkpoint (no 'meta' entry)")
    version = payload["meta"].get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}; this k3train reads version {FORMAT_VERSION}"
        )
    return payload


def check_compatible(saved: dict, current: dict, path: Path) -> None:
    """Compare two `meta` dicts and name every mismatch that makes a resume wrong."""
    problems = []
    for key, what, fix in (
        ("model_config", "model config", "use the model config the checkpoint was trained with"),
        ("recipe", "training recipe", "restore these train.* / precision settings"),
        ("optimizer_layout", "optimizer param groups", "use the same optim config"),
        ("data", "dataset identity", "point data at the dataset the checkpoint was trained on"),
    ):
        old, new = saved.get(key, {}), current.get(key, {})
        for field in sorted(set(old) | set(new)):
            if old.get(field) != new.get(field):
                problems.append(f"  {what}: {field} was {old.get(field)!r}, now {new.get(field)!r} ({fix})")
    if problems:
        raise CheckpointError(f"cannot resume from {path}; it does not match this run:\n" + "\n".join(problems))


def link_or_copy(checkpoint: Path, copy: Path) -> None:
    """A second name for a checkpoint: a hard link is free, since last.pt is replaced by rename, never rewritten."""
    try:
        os.link(checkpoint, copy)
    except OSError:  # a filesystem without hard links
        shutil.copy2(checkpoint, copy)


def keep_last(run_dir: Path, checkpoint: Path, step: int, k: int) -> None:
    """Besides last.pt, keep hard-linked step_XXXXXXX.pt copies of the last k checkpoints."""
    if k <= 0:
        return
    copy = run_dir / f"step_{step:07d}.pt"
    if not copy.exists():
        link_or_copy(checkpoint, copy)
    for old in sorted(run_dir.glob("step_*.pt"))[:-k]:
        old.unlink()
