"""train.cpu_threads=adaptive: fewer threads while other processes use this process's CPUs, all of them again when
they leave.

Why: training's OpenMP threads spin between parallel regions when the CPUs are free at start (runtime/cpu.py), which
makes a k3_tiny step ~1.5-2x faster than threads that sleep at once; but when another busy process arrives, a
spinning thread whose partner is descheduled burns its time slice waiting, and two threads ran slower than one
(measured figures: docs/decisions/cpu-runtime.md). The price: a reduction's rounding depends on the thread count,
so with adaptive threads the numbers depend on the machine's load, and a resumed run is no longer bitwise the
uninterrupted one (measured: the fault trials' bitwise resumes failed under load with it on). Off by default.

Every `interval_s` of wall time CpuThreads measures how many CPUs other processes kept busy (the CPUs' busy time in
/proc/stat minus this process's own CPU time, over the wall time) and runs torch on the CPUs they left:

    free = min(threads chosen at start, CPUs) - others
    fewer threads:  floor(free + 0.5)     (a CPU another process holds more than half of is given up)
    more threads:   floor(free + 0.25)    (one is taken back only when three quarters of it is free)

at least 1 and at most the count chosen at start. The two thresholds keep a load near half a CPU from switching
back and forth. Where other processes keep every CPU busy, sleeping threads (OMP_WAIT_POLICY=PASSIVE, set before
start) do better: the scheduler shares CPU time per thread, and two sleeping threads get more of it than one
(measured: 0.50 s per k3_tiny step against 0.97 s beside two busy processes on 2 cores); the notice says so.
build_parts adds CpuThreads to a CPU run whose train.cpu_threads is adaptive (starting at the CPUs' share that auto
takes without OMP_NUM_THREADS, if above 1: runtime/cpu.py's choose_threads); auto and an explicit count keep their
threads.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

import torch

from k3train.runtime.console import notice
from k3train.runtime.cpu import cpu_busy_seconds, own_cpu_seconds
from k3train.train.callbacks import Callback


class CpuThreads(Callback):
    def __init__(
        self,
        max_threads: int,
        cpus: Sequence[int],
        interval_s: float = 2.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        busy_seconds: Callable[[Sequence[int]], float | None] = cpu_busy_seconds,
        own_seconds: Callable[[], float] = own_cpu_seconds,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.max_threads, self.cpus, self.interval_s = max_threads, list(cpus), interval_s
        self.clock, self.set_threads = clock, set_threads
        self.busy_seconds, self.own_seconds = busy_seconds, own_seconds
        self.threads = max_threads
        self.others: float | None = None  # CPUs other processes used in the last window
        self.changes = 0  # since the last metrics()
        self._t, self._busy, self._own = 0.0, None, 0.0

    @classmethod
    def for_this_process(cls, max_threads: int) -> CpuThreads | None:
        """A CpuThreads over this process's CPUs (its affinity), or None where their load cannot be read."""
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if not cpus or cpu_busy_seconds(cpus) is None:
            return None
        return cls(max_threads, cpus)

    def setup(self, model, optimizer, dims) -> None:
        # the first window starts at the first update: start-up's own bursts (other processes' too) are not training
        self._t, self._busy, self._own = self.clock(), self.busy_seconds(self.cpus), self.own_seconds()

    def after_optimizer_step(self, step: int) -> None:
        self.tick()

    def after_skipped_step(self, step: int) -> None:
        self.tick()

    def tick(self) -> None:
        """Measure and adjust once `interval_s` has passed since the last measurement; otherwise nothing."""
        now = self.clock()
        if now - self._t < self.interval_s:
            return
        busy, own = self.busy_seconds(self.cpus), self.own_seconds()
        if busy is None or self._busy is None:
            return
        self.others = max(0.0, ((busy - self._busy) - (own - self._own)) / (now - self._t))
        self._t, self._busy, self._own = now, busy, own
        wanted = self.wanted(self.others)
        if wanted != self.threads:
            full = self.others > len(self.cpus) - 0.5  # where sleeping threads keep a larger share (module docstring)
            hint = "; on a machine others keep this busy, OMP_WAIT_POLICY=PASSIVE at start may be faster"
            notice(
                f"other processes used {self.others:.1f} of this run's {len(self.cpus)} CPUs: "
                f"{wanted} torch thread(s) instead of {self.threads}" + (hint if full else "")
            )
            self.set_threads(wanted)
            self.threads = wanted
            self.changes += 1

    def wanted(self, others: float) -> int:
        """The thread count for `others` CPUs busy with other processes, from the current count (module docstring)."""
        free = min(self.max_threads, len(self.cpus)) - others
        fewer = max(1, min(self.max_threads, math.floor(free + 0.5)))
        more = max(1, min(self.max_threads, math.floor(free + 0.25)))
        return fewer if fewer < self.threads else max(self.threads, more)

    def metrics(self) -> dict:
        if self.others is None:
            return {}
        out = {"threads": self.threads, "others_cpus": round(self.others, 2), "changes": self.changes}
        self.changes = 0
        return out

    def describe(self) -> str:
        return (
            f"cpu threads: up to {self.max_threads}, fewer while other processes use these {len(self.cpus)} CPUs "
            f"(measured every {self.interval_s:g} s)"
        )
