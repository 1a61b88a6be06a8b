"""The console's progress (k3train/observe/progress.py): the ETA comes from the updates after the session's first,
whose compile and cache warm-up would make it long several times over; the bar and the log lines agree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from k3train.config import TrainConfig
from k3train.observe import progress as progress_module
from k3train.observe.progress import Progress, format_duration


class FakeClock:
    """perf_counter for progress.py: it moves only when the test says an update took so long."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.now = 1000.0
        monkeypatch.setattr(progress_module, "time", SimpleNamespace(perf_counter=lambda: self.now))

    def advance(self, seconds: float) -> None:
        self.now += seconds


def record(step: int) -> dict:
    """A train event as the trainer logs it, with the figures the log line shows."""
    return {"step": step, "loss": 3.0, "grad_norm": 1.0, "tokens_per_s": 1000.0, "step_time_s": 0.5, "mfu": None}


def run_updates(progress: Progress, clock: FakeClock, steps: range, warm_up_s: float, pace_s: float, log_interval):
    for step in steps:
        clock.advance(warm_up_s if step == steps[0] else pace_s)
        progress.update(step, loss=3.0, tokens_per_s=1000.0)
        if step % log_interval == 0:
            progress.log_line(record(step))


@pytest.mark.parametrize(
    "start, total, warm_up_s, pace_s, eta_at_last",
    [
        (0, 30, 5.6, 0.4, "0:00:08"),  # a start, at step 10: 20 left at 0.4 s (counting the first: 0:00:18)
        (10, 210, 60.0, 2.0, "0:06:20"),  # a resume from 10, at step 20: 190 left at 2 s (counting the first: 0:24:42)
    ],
)
def test_the_eta_leaves_out_the_first_update(capsys, monkeypatch, start, total, warm_up_s, pace_s, eta_at_last):
    clock = FakeClock(monkeypatch)
    progress = Progress(TrainConfig(progress="lines", log_interval=5), start=start, total=total, label="")
    run_updates(progress, clock, range(start + 1, start + 11), warm_up_s, pace_s, log_interval=5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith(f"step {start + 10}/{total} |") and lines[-1].endswith(f"ETA {eta_at_last}")
    first, pace, *logged = lines
    assert len(logged) == 2
    assert first == (
        f"first update took {warm_up_s:.2f} s (warm-up, left out of the ETA: the next updates set the pace); "
        f"{total - start - 1} more to go"
    )
    left = total - start - 2
    assert pace.startswith(f"after the warm-up {pace_s:.2f} s/update; {left} more at that pace: ETA ")
    assert pace.split("ETA ")[1].startswith(format_duration(pace_s * left))


def test_a_log_line_at_the_first_update_says_the_eta_comes_next(capsys, monkeypatch):
    clock = FakeClock(monkeypatch)
    progress = Progress(TrainConfig(progress="lines", log_interval=1), start=0, total=30, label="")
    run_updates(progress, clock, range(1, 3), warm_up_s=5.6, pace_s=0.4, log_interval=1)
    first, log_1, log_2 = capsys.readouterr().out.splitlines()  # no pace line: step 2's log line has the ETA
    assert first.startswith("first update took 5.60 s (warm-up, left out of the ETA") and "ETA 0" not in first
    assert log_1.endswith("| ETA after the next update (the first is warm-up)")
    assert log_2.endswith("| ETA 0:00:11")  # 28 x 0.4 s


def test_the_bar_shows_the_same_eta(capsys, monkeypatch):
    clock = FakeClock(monkeypatch)
    progress = Progress(TrainConfig(progress="bar"), start=0, total=30, label="")
    run_updates(progress, clock, range(1, 2), warm_up_s=5.6, pace_s=0.4, log_interval=5)
    assert progress.bar.postfix.endswith("eta=?")
    run_updates(progress, clock, range(2, 6), warm_up_s=0.4, pace_s=0.4, log_interval=5)
    assert progress.bar.postfix.endswith("eta=0:00:10")  # 25 x 0.4 s, as the log line would say
    progress.close()
    assert "{remaining}" not in progress.bar.bar_format  # tqdm's own counts the warm-up


def test_a_one_update_run_needs_no_eta(capsys, monkeypatch):
    clock = FakeClock(monkeypatch)
    progress = Progress(TrainConfig(progress="lines", log_interval=5), start=0, total=1, label="")
    run_updates(progress, clock, range(1, 2), warm_up_s=5.6, pace_s=0.4, log_interval=1)
    first, logged = capsys.readouterr().out.splitlines()
    assert first == "first update took 5.60 s" and logged.endswith("| ETA 0:00:00")


def test_a_guard_rewind_measures_the_pace_again_from_the_step_it_went_back_to(capsys):
    """The fault trials' guarded run found it: back at the first update's own step, the pace divided by zero."""
    progress = Progress(TrainConfig(progress="lines", log_interval=100), start=0, total=10, label="")
    progress.update(3, 5.0, 100.0)
    progress.update(4, 5.0, 100.0)
    progress.rewound(3)
    assert progress.eta_seconds(3) is None  # no pace measured since the rewind yet
    progress.update(3, 5.0, 100.0)
    assert progress.eta_seconds(3) is None  # the same step again: still no pace, not a division by zero
    progress.update(5, 5.0, 100.0)
    assert progress.eta_seconds(5) > 0
