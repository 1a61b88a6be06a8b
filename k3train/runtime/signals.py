"""Preemption and time-limit signals, turned into a stop at the next update boundary."""

from __future__ import annotations

import os
import signal
import threading


class StopSignals:
    """While entered, SIGTERM (preemption, `scontrol requeue`, a time limit), SIGUSR1 (the time-limit warning of an
    sbatch script's `--signal=B:USR1@N`) and SIGUSR2 (submitit's time-limit and preemption warning) only raise a
    flag: the loop stops at the next update boundary and the run checkpoints. On exit the previous handlers come
    back and `redeliver()` sends them the first signal (the default ends the process; submitit's requeues the job;
    k3train/runtime/slurm.py decides which). The same signal a second time does not wait: the previous handlers take
    it at once (a step may be stuck). Another of them is only noted in `received_all` (a preemption may send SIGTERM
    and then the warning signal)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self) -> None:
        self.received: signal.Signals | None = None  # the first: it names the end reason
        self.received_all: list[signal.Signals] = []
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if signum not in self.received_all:
            self.received_all.append(signal.Signals(signum))
            self.received = self.received or signal.Signals(signum)
            return
        self._restore()
        os.kill(os.getpid(), signum)

    def __enter__(self) -> StopSignals:
        global _early
        if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
            if _early is not None:  # take over what arrived while the process started, and the handlers before it
                self.received, self.received_all = _early.received, list(_early.received_all)
                self._previous, _early = _early._previous, None
                for sig in self.SIGNALS:
                    signal.signal(sig, self._handle)
            else:
                self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()

    def redeliver(self, sig: signal.Signals | None = None) -> None:
        """Send the previous handlers the first signal received (or `sig`)."""
        if self.received is not None:
            self._restore()
            os.kill(os.getpid(), sig or self.received)


_early: StopSignals | None = None


def catch_early() -> None:
    """From the start of `python -m k3train` until the run's StopSignals takes over: note a stop signal instead of
    dying of it. SLURM may send a time-limit warning up to a minute early, while the job is still importing or
    building; the run then stops with a checkpoint after its first update and the job is requeued."""
    global _early
    if _early is None and threading.current_thread() is threading.main_thread():
        _early = StopSignals().__enter__()
