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
    """A tqdm bar on a terminal (or progress=bar), plain log lines otherwise."""

    def __init__(self, config: TrainConfig, start: int, total: int, label: str):
        self.label, self.total = label, total
        use_bar = config.progress == "bar" or (config.progress == "auto" and sys.stdout.isatty())
        self.bar = None
        if use_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc=label.strip() or "train", unit="step", dynamic_ncols=True)
        self.t_start, self.start = time.perf_counter(), start
        self.first_reported = False

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.first_reported:
            self.first_reported = True
            self.write(self.first_update_line(step, time.perf_counter() - self.t_start))
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def first_update_line(self, step: int, elapsed: float) -> str:
        """Feedback as soon as the session's first update ends, not at the first log_interval (minutes on a slow
        CPU): its time and the ETA at that pace (the first update also warms up caches, so the ETA errs long)."""
        done, left = step - self.start, self.total - step
        eta = elapsed / max(1, done) * left
        return (
            f"{self.label}first update took {elapsed:.2f} s; {left} more at that pace: ETA {format_duration(eta)} "
            "(evals and checkpoints not included)"
        )

    def log_line(self, record: dict) -> None:
        if self.bar is not None:
            return
        step = record["step"]
        elapsed = time.perf_counter() - self.t_start
        done = step - self.start
        eta = elapsed / done * (self.total - step) if done else 0.0
        mfu = f"MFU {record['mfu']:.1%} | " if record.get("mfu") is not None else ""
        say(
            f"{self.label}step {step}/{self.total} | loss {record['loss']:.4f} | grad {record['grad_norm']:.3f} | "
            f"{record['tokens_per_s']:,.0f} tok/s | {mfu}{record['step_time_s']:.3f} s/step | "
            f"ETA {format_duration(eta)}"
        )

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
