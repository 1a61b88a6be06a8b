"""Where a run continues from, and continuing it: `resolve_resume` turns `resume=` into a checkpoint path (or None
for a fresh run), refusing to write into another run's directory; `restore` loads that checkpoint into the built
Trainer and says when the run has nothing left to do (RunFinished). A refusal names how the resumed run was started
(run/remembered.py reads its recorded overrides).
"""

from __future__ import annotations

from pathlib import Path

from k3train.checkpoint.checkpointer import CheckpointError
from k3train.checkpoint.latest import LATEST_NAMES, newest_checkpoint
from k3train.observe.run_manifest import RUN_JSON
from k3train.run.remembered import layout_overrides, recorded_overrides, started_with
from k3train.train.trainer import Trainer


class RunFinished(Exception):
    """A resumed run that has nothing left to do."""


RUN_FILES = (*LATEST_NAMES, RUN_JSON, "metrics.jsonl")


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """null: a fresh run; auto: run_dir/last.pt (last.dcp for a sharded one; the newer if both) if present, else
    fresh; otherwise a checkpoint path (a file, or a sharded checkpoint's directory) or a run directory (its newest
    checkpoint; `python -m k3train resume=DIR` alone continues in DIR: run/remembered.py).

    A run never writes into a directory holding another run's files: a fresh run or a resume from elsewhere is
    refused there, so nobody's checkpoint, metrics or manifest is overwritten or mixed with another run's.
    """
    if resume == "auto":
        return newest_checkpoint(run_dir)
    path = Path(resume).expanduser() if resume is not None else None
    if path is not None and not path.exists():
        raise CheckpointError(f"resume={resume}: no such checkpoint")
    if path is not None and path.is_dir() and newest_checkpoint(path) is not None:
        path = newest_checkpoint(path)  # a run directory: its newest checkpoint, as generate and evaluate read it
    if path is not None and path.resolve().parent == run_dir.resolve():
        return path  # this run's own last.pt or an earlier step_*.pt of it: continuing the same run
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if existing:
        raise ValueError(
            f"{run_dir} already holds a run ({', '.join(existing)}): pass resume=auto to continue "
            "that run, or choose another hydra.run.dir"
        )
    return path


def restore(trainer: Trainer, path: Path) -> None:
    """Load the checkpoint at path into trainer (every part, checked against the run first); RunFinished where the
    restored run has already reached its end."""
    try:
        trainer.resume(path)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}{_how_it_was_started(path.parent)}") from exc
    done = trainer.plan.done()
    if done is not None:
        raise RunFinished(_finished_message(path, done, trainer))


def _how_it_was_started(run_dir: Path) -> str:
    recorded = recorded_overrides(run_dir)
    if recorded is None:
        return ""
    started = " ".join(started_with(recorded)) or "no overrides"
    line = (
        f"; that run was started with: {started} (a resume in its directory composes these itself: give only what "
        "changes, or start a new run in another hydra.run.dir)"
    )
    layout = layout_overrides(recorded)
    if layout:  # not composed where the processes differ: the one part a resume may have to give again
        line += f"; its layout was {' '.join(layout)}: give those overrides again to resume with it"
    return line


def _finished_message(resume_path: Path, reason: str, trainer: Trainer) -> str:
    step = trainer.state.step
    if reason == "end_of_data":
        return f"{resume_path} is a finished run (its train split is used up at step {step}); nothing to do"
    limit = f"train.{reason}"
    return (
        f"{resume_path} is a finished run (it reached {limit}={getattr(trainer.config, reason)} at step {step}); "
        f"nothing to do. To train on, raise {limit} and resume=auto"
    )
