"""The two ways k3train talks to a person: `say` for what a run reports as it goes (stdout: progress, summaries,
how it ended), `notice` for the framework's own word about the process (stderr, prefixed `k3train:`: a stop
signal, a requeue), so that piping stdout keeps the run's record and stderr its interruptions. Both flush at once:
a job killed a moment later must have said it."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    print(message, flush=True)


def notice(message: str) -> None:
    print(f"k3train: {message}", file=sys.stderr, flush=True)
