"""Preemption and time-limit signals, turned into a stop at the next update boundary."""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional


class StopSignals:
    """While entered, SIGTERM (preemption) and SIGUSR1 (SLURM's time-limit warning) only raise a flag: the loop
    stops at the next update boundary and the run checkpoints. On exit the previous handlers come back and
    `redeliver()` sends them the first signal (the default ends the process; submitit's requeues the job).
    A second signal does not wait: the previous handlers take it at once (a step may be stuck)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: Optional[signal.Signals] = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            return
        self._restore()
        os.kill(os.getpid(), signum)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()

    def redeliver(self) -> None:
        if self.received is not None:
            self._restore()
            os.kill(os.getpid(), self.received)
