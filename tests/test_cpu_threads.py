"""CpuThreads (k3train/train/cpu_threads.py): the thread rule, the measurement windows on a fake clock and fake CPU
counters, and the real /proc/stat reading beside a busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from k3train.runtime.cpu import cpu_busy_seconds, own_cpu_seconds
from k3train.train.cpu_threads import CpuThreads


class FakeCpus:
    """A clock and CPU counters the test advances: each window, `others` CPUs busy with other processes and `own`
    CPUs busy with this one."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.threads_set: list[int] = []

    def advance(self, seconds: float, others: float, own: float = 2.0) -> None:
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def governor(self, max_threads: int = 2, cpus: int = 2) -> CpuThreads:
        g = CpuThreads(
            max_threads,
            range(cpus),
            interval_s=2.0,
            clock=lambda: self.now,
            busy_seconds=lambda _: self.busy,
            own_seconds=lambda: self.own,
            set_threads=self.threads_set.append,
        )
        g.setup(None, None, None)
        return g


@pytest.mark.parametrize(
    ("current", "others", "wanted"),
    [
        (2, 0.0, 2),
        (2, 0.45, 2),  # less than half a CPU taken: kept
        (2, 0.55, 1),  # more than half: given up
        (2, 1.0, 1),
        (2, 2.0, 1),  # never below one
        (1, 0.6, 1),
        (1, 0.3, 1),  # taken back only when three quarters of it is free
        (1, 0.2, 2),
        (1, 0.0, 2),
    ],
)
def test_thread_rule(current: int, others: float, wanted: int) -> None:
    g = FakeCpus().governor()
    g.threads = current
    assert g.wanted(others) == wanted


def test_rule_on_more_cpus_and_a_smaller_chosen_count() -> None:
    g = FakeCpus().governor(max_threads=8, cpus=8)
    assert g.wanted(2.6) == 5 and g.wanted(0.0) == 8
    g = FakeCpus().governor(max_threads=4, cpus=8)  # chosen 4 of 8 (a quota): others on the rest do not count
    assert g.wanted(3.0) == 1 and g.wanted(0.2) == 4


def test_gives_threads_up_while_others_run_and_takes_them_back_after() -> None:
    fake = FakeCpus()
    g = fake.governor()
    fake.advance(1.0, others=1.0)
    g.after_optimizer_step(1)
    assert fake.threads_set == [] and g.metrics() == {}  # under interval_s since the first update: no window yet
    fake.advance(1.5, others=1.0, own=1.0)
    g.after_optimizer_step(2)
    assert fake.threads_set == [1] and g.threads == 1
    assert g.metrics() == {"threads": 1, "others_cpus": 1.0, "changes": 1}
    fake.advance(2.0, others=1.0, own=1.0)
    g.after_skipped_step(3)
    assert fake.threads_set == [1] and g.metrics() == {"threads": 1, "others_cpus": 1.0, "changes": 0}
    fake.advance(2.0, others=0.0, own=1.0)
    g.after_optimizer_step(4)
    assert fake.threads_set == [1, 2] and g.metrics()["threads"] == 2


def test_unreadable_counters_leave_the_threads_alone() -> None:
    fake = FakeCpus()
    g = fake.governor()
    g.busy_seconds = lambda _: None
    fake.advance(5.0, others=2.0)
    g.tick()
    assert fake.threads_set == [] and g.threads == 2 and g.metrics() == {}


@pytest.mark.slow
@pytest.mark.skipif(cpu_busy_seconds([0]) is None, reason="no /proc/stat: CPU load from other processes is not visible")
def test_proc_stat_sees_another_busy_process() -> None:
    """A busy process beside this (idle) one: the CPUs' busy time minus this process's is about one CPU."""
    g = CpuThreads.for_this_process(max_threads=2)
    assert g is not None and g.cpus
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # the interpreter started
        t0, b0, o0 = time.monotonic(), cpu_busy_seconds(g.cpus), own_cpu_seconds()
        time.sleep(1.5)
        others = (cpu_busy_seconds(g.cpus) - b0 - (own_cpu_seconds() - o0)) / (time.monotonic() - t0)
    finally:
        busy.kill()
        busy.wait()
    # one CPU, less what the machine's other tenants took from it (0.5: well clear of an idle machine's ~0.05)
    assert 0.5 < others < len(g.cpus) + 0.1, others


@pytest.mark.slow
@pytest.mark.skipif(
    CpuThreads.for_this_process(2) is None or len(os.sched_getaffinity(0)) < 2,
    reason="needs /proc/stat and 2 CPUs: CpuThreads is only added where it can see the load and give a thread up",
)
def test_only_adaptive_threads_get_cpu_threads(run_cli, tmp_path) -> None:
    """auto and an explicit count keep their threads (a run's numbers then never depend on the machine's load)."""
    tiny = ["model.d_model=32", "model.n_layers=2", "model.expert_ffn_dim=16", "model.dense_ffn_dim=32"]
    tiny += ["train.batch_size=2", "train.seq_len=32", "train.max_steps=1", "train.eval_batches=1"]
    for setting, added in (("adaptive", True), ("auto", False), ("2", False)):
        proc = run_cli(*tiny, f"train.cpu_threads={setting}", f"hydra.run.dir={tmp_path / setting}")
        assert proc.returncode == 0, proc.stderr
        assert ("cpu threads: up to " in proc.stdout) is added, setting
