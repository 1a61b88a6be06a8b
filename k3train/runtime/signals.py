"""Preemption and time-limit signals, and Ctrl-C, turned into a stop at the next update boundary."""

from __future__ import annotations

import os
import signal
import threading

CTRL_C_NOTICE = (
    b"\nk3train: Ctrl-C: stopping after this update with a checkpoint (Ctrl-C again exits at once, keeping the "
    b"last checkpoint)\n"
)


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C: leave now, without the checkpoint of the update in flight (the last one stays as it was:
    every checkpoint write is atomic, k3train/files.py)."""


class StopSignals:
    """While entered, SIGTERM (preemption, `scontrol requeue`, a time limit), SIGUSR1 (the time-limit warning of an
    sbatch script's `--signal=B:USR1@N`) and SIGUSR2 (submitit's time-limit and preemption warning) only raise a
    flag: the loop stops at the next update boundary and the run checkpoints. On exit the previous handlers come
    back and `redeliver()` sends them the first signal (the default ends the process; submitit's requeues the job;
    k3train/runtime/slurm.py decides which). The same signal a second time does not wait: the previous handlers take
    it at once (a step may be stuck). Another of them is only noted in `received_all` (a preemption may send SIGTERM
    and then the warning signal).

    SIGINT (Ctrl-C at a terminal) is caught the same way, with a one-line notice when it arrives; a second Ctrl-C
    raises Interrupted, which the runner turns into a one-line exit. It is not caught while the process starts
    (`catch_early`): a Ctrl-C before the first update ends the start at once, nothing of it kept. Its redelivery
    ends the process by SIGINT (status 130 in a shell), not by Python's KeyboardInterrupt and its traceback. A
    process started with SIGINT ignored (nohup, a background job of a script) keeps ignoring it."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
    EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self) -> None:
        self.received: signal.Signals | None = None  # the first: it names the end reason
        self.received_all: list[signal.Signals] = []
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if signum not in self.received_all:
            self.received_all.append(signal.Signals(signum))
            self.received = self.received or signal.Signals(signum)
            if signum == signal.SIGINT:
                os.write(2, CTRL_C_NOTICE)  # not print(): a handler may interrupt a print to the same stream
            return
        self._restore()
        if signum == signal.SIGINT:
            raise Interrupted()
        os.kill(os.getpid(), signum)

    def __enter__(self) -> StopSignals:
        global _early
        if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
            if _early is not None:  # take over what arrived while the process started, and the handlers before it
                self.received, self.received_all = _early.received, list(_early.received_all)
                self._previous, _early = dict(_early._previous), None
            for sig in self.SIGNALS:
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # started with Ctrl-C ignored (nohup, `cmd &` in a script): it stays ignored
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()

    def redeliver(self, sig: signal.Signals | None = None) -> None:
        """Send the previous handlers the first signal received (or `sig`). SIGINT goes to the default action, so
        the process ends by it, as a shell expects of a Ctrl-C, instead of raising KeyboardInterrupt."""
        if self.received is not None:
            self._restore()
            sig = sig or self.received
            if sig == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), sig)


_early: StopSignals | None = None
CTRL_C_WHILE_IMPORTING = b"\nk3train: interrupted by Ctrl-C while starting; nothing was written\n"


def catch_early() -> None:
    """From the start of `python -m k3train` until the run's StopSignals takes over: note a stop signal instead of
    dying of it. SLURM may send a time-limit warning up to a minute early, while the job is still importing or
    building; the run then stops with a checkpoint after its first update and the job is requeued. A Ctrl-C while
    the CLI's modules import (torch: seconds) ends the process by SIGINT with one line instead of a
    KeyboardInterrupt traceback from inside an import; `imports_done()` hands Ctrl-C back to the CLI's own handling."""
    global _early
    if _early is None and threading.current_thread() is threading.main_thread():
        _early = StopSignals()
        _early._previous = {sig: signal.signal(sig, _early._handle) for sig in StopSignals.EARLY_SIGNALS}
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored SIGINT stays ignored
            signal.signal(signal.SIGINT, _end_while_importing)


def _end_while_importing(signum, frame) -> None:
    os.write(2, CTRL_C_WHILE_IMPORTING)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def imports_done() -> None:
    """From here a Ctrl-C raises KeyboardInterrupt again, which the CLI turns into its one line (it may have written
    something by then that a clean exit removes)."""
    if signal.getsignal(signal.SIGINT) is _end_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)
