"""What a run shows while it runs: figures gathered between two train events, and a bar or plain log lines."""

from __future__ import annotations

import resource
import sys
import time

import torch

from k3train.config import TrainConfig
from k3train.runtime.console import say


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is KiB on Linux: the process's peak resident memory stands in for device memory on CPU.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def format_duration(seconds: float) -> str:
    """H:MM:SS, hours unbounded (a slow CPU can need more than a day)."""
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class Window:
    """Figures accumulated between two train events."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.losses, self.grad_norms, self.seconds, self.tokens, self.attempts = [], [], 0.0, 0, 0

    def add(self, result: dict, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens
        self.attempts += 1
        if result["skipped"]:
            return
        self.losses.append(result["loss"])
        self.grad_norms.append(result["grad_norm"])

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        n = max(1, len(self.losses))
        return {
            "loss": sum(self.losses) / n,
            "grad_norm": sum(self.grad_norms) / n,
            "grad_norm_max": max(self.grad_norms, default=0.0),
            "tokens_per_s": self.tokens_per_s(),
            "step_time_s": self.seconds / max(1, self.attempts),
        }


class Progress:
    """A tqdm bar on a terminal (or progress=bar), plain log lines otherwise; both give the same ETA.

    The ETA comes from the pace of the session's updates after its first: the first (of a start or of a resume)
    compiles and warms caches, and can take many times a steady update, so an ETA that counted it would be long
    several times over. The pace is wall time from the end of the first update to the latest, over the updates in
    between, so the evals and checkpoints done so far are in it at the rate they came."""

    # tqdm's own remaining time counts from the bar's start, warm-up included: the postfix carries ours instead.
    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

    def __init__(self, config: TrainConfig, start: int, total: int, label: str):
        self.label, self.total, self.log_interval = label, total, config.log_interval
        use_bar = config.progress == "bar" or (config.progress == "auto" and sys.stdout.isatty())
        self.bar = None
        if use_bar:
            from tqdm.auto import tqdm

            desc = label.strip() or "train"
            self.bar = tqdm(
                total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True, bar_format=self.BAR_FORMAT
            )
        self.t_start = time.perf_counter()
        self.first_update: tuple[int, float] | None = None  # (step, time) at the end of the session's first update
        self.latest_update: tuple[int, float] | None = None  # the same for the latest update after it
        self.rewound_at: int | None = None  # a guard rewind's step: the pace is measured again from there

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        now = time.perf_counter()
        if self.first_update is None:
            self.first_update = (step, now)
            self.write(self.first_update_line(step, now - self.t_start))
        else:
            first_steady = self.latest_update is None
            self.latest_update = (step, now)
            if first_steady and self.bar is None and not self._logs_at(step) and self.rewound_at is None:
                self.write(self.first_pace_line(step))
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            eta = self.eta_seconds(step)
            eta = "?" if eta is None else format_duration(eta)
            self.bar.set_postfix({"loss": f"{loss:.4f}", "tok_s": f"{tokens_per_s:,.0f}", "eta": eta}, refresh=False)

    def rewound(self, step: int) -> None:
        """A guard rewind sent the run back to `step`: the pace is measured again from now (the updates redone are
        steady ones, so no warm-up is left out)."""
        if self.first_update is not None:
            self.first_update, self.latest_update, self.rewound_at = (step, time.perf_counter()), None, step

    def seconds_per_update(self) -> float | None:
        """The steady pace: None until an update after the first has ended."""
        if self.first_update is None or self.latest_update is None or self.latest_update[0] == self.first_update[0]:
            return None
        (first_step, first_t), (step, t) = self.first_update, self.latest_update
        return (t - first_t) / (step - first_step)

    def eta_seconds(self, step: int) -> float | None:
        """None while no steady pace exists and updates remain."""
        if step >= self.total:
            return 0.0
        pace = self.seconds_per_update()
        return None if pace is None else pace * (self.total - step)

    def first_update_line(self, step: int, elapsed: float) -> str:
        """Feedback as soon as the session's first update ends, not at the first log_interval (minutes on a slow
        CPU). No ETA yet: that update's time is mostly warm-up, not the pace of the rest."""
        left = self.total - step
        line = f"{self.label}first update took {elapsed:.2f} s"
        if left:
            line += f" (warm-up, left out of the ETA: the next updates set the pace); {left} more to go"
        return line

    def first_pace_line(self, step: int) -> str:
        """The first ETA, at the first update after the warm-up, unless a log line gives it at that step."""
        pace, left = self.seconds_per_update(), self.total - step
        return (
            f"{self.label}after the warm-up {pace:.2f} s/update; {left} more at that pace: "
            f"ETA {format_duration(pace * left)} (evals and checkpoints not included)"
        )

    def _logs_at(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.total  # the trainer's train-event condition

    def log_line(self, record: dict) -> None:
        if self.bar is not None:
            return
        step = record["step"]
        eta = self.eta_seconds(step)
        eta = "ETA after the next update (the first is warm-up)" if eta is None else f"ETA {format_duration(eta)}"
        mfu = f"MFU {record['mfu']:.1%} | " if record.get("mfu") is not None else ""
        say(
            f"{self.label}step {step}/{self.total} | loss {record['loss']:.4f} | grad {record['grad_norm']:.3f} | "
            f"{record['tokens_per_s']:,.0f} tok/s | {mfu}{record['step_time_s']:.3f} s/step | {eta}"
        )

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
