"""The run's guard against loss spikes (conf/guard/: off, warn, skip, rewind): what the update loop asks before it
applies an update, and what it does when the answer is no.

Detection: each applied update's loss and gradient norm (before clipping) join a trailing window of `window`
updates. Once the window holds `warmup` of them, an update whose loss or norm stands more than `loss_threshold` /
`grad_norm_threshold` robust standard deviations above the window's median trips it: (x - median) / (1.4826 MAD),
MAD the median absolute deviation (1.4826 MAD estimates the standard deviation of normal noise, and one outlier in
the window moves neither). OLMo-core judges the same two figures by mean and standard deviation over 128 updates
(olmo_core/train/train_module/transformer/train_module.py); a median is not dragged up by the spike it is looking
for. The loss is the global batch's (the last pipeline stage's, averaged over data-parallel ranks) and the norm is
over every rank's gradients, so every rank holds the same figures, the same window and takes the same decision with
no collective of its own.

What a spike does, by mode:
    off     nothing is measured
    warn    a `spike` event, the update applied
    skip    a `spike` event, the update not applied (the Trainer's skip: see below), its batch consumed
    rewind  a `spike` event, then every rank restores the last good checkpoint, the loaders move past the data from
            the spike's batches to `rewind_margin` updates beyond them, and training goes on (a `rewind` event); after
            `max_rewinds` rewinds the next one stops the run. A checkpoint is good once `good_after` updates went on
            from it without a spike or skip (the `last_good` name, Checkpointer.mark_good). Non-finite updates
            trigger a rewind too once `skips_to_rewind` of them fall within `window` attempts.
A skipped update leaves the run as if its batch had never been served: no optimizer step (Muon's momentum, AdamW's
moments), the step counter the schedule reads unmoved, the buffers its forwards moved (Quantile Balancing's bias)
and every RNG put back, QK-Clip not run.

`inject_at` is a testing aid: the batches of the updates attempted at those steps are uniform random tokens, so a
spike is caused rather than mocked (each fires once per run, a rewind's replay included). `drop_at` passes over data
by hand, as Megatron-LM's --iterations-to-skip does after a restart: before the update attempted at each listed step,
one update's batches are drawn and dropped (list a step n times to drop n updates' worth). It is also how a test
builds the run a skip or a rewind must equal: the same data, minus what the guard passed over.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

from k3train.train.rng import capture_rng_state, restore_rng_state

MODES = ("off", "warn", "skip", "rewind")
MAD_TO_SIGMA = 1.4826  # the standard deviation of normal noise per unit of its median absolute deviation


@dataclass
class Spike:
    """An update the detector tripped on: its step and, per figure that tripped, its value, the window's median,
    scale (1.4826 MAD) and how many scales above the median it stands."""

    step: int
    tripped: dict

    def describe(self) -> str:
        parts = [
            f"{name} {t['value']:.4g} is {t['sigmas']:.1f} sigma above the median {t['median']:.4g} "
            f"(threshold {t['threshold']:g})"
            for name, t in self.tripped.items()
        ]
        return "; ".join(parts)


class SpikeDetector:
    """A trailing window of applied updates' figures and the robust test above (module docstring)."""

    def __init__(self, window: int, warmup: int, thresholds: dict[str, float]):
        self.window, self.warmup, self.thresholds = window, warmup, thresholds
        self.figures = {name: deque(maxlen=window) for name in thresholds}

    def judge(self, step: int, figures: dict[str, float]) -> Spike | None:
        """The update's figures against the window (not added: `add` them once the update is applied)."""
        tripped = {}
        for name, threshold in self.thresholds.items():
            seen = self.figures[name]
            if len(seen) < self.warmup:
                return None
            median = statistics.median(seen)
            mad = statistics.median(abs(v - median) for v in seen)
            # a window of equal values has no spread: a thousandth of the median stands in for it
            scale = max(MAD_TO_SIGMA * mad, 1e-3 * abs(median), 1e-12)
            sigmas = (figures[name] - median) / scale
            if sigmas > threshold:
                tripped[name] = {
                    "value": figures[name],
                    "median": median,
                    "scale": scale,
                    "sigmas": sigmas,
                    "threshold": threshold,
                }
        return Spike(step, tripped) if tripped else None

    def add(self, figures: dict[str, float]) -> None:
        for name in self.thresholds:
            self.figures[name].append(float(figures[name]))

    def state_dict(self) -> dict:
        return {name: list(seen) for name, seen in self.figures.items()}

    def load_state_dict(self, state: dict) -> None:
        for name in self.thresholds:
            self.figures[name] = deque(state.get(name, []), maxlen=self.window)


@dataclass(eq=False)
class Guard:
    """conf/guard/<mode>.yaml (module docstring)."""

    mode: str = "warn"
    window: int = 128  # applied updates whose figures are the baseline
    warmup: int = 20  # figures the window holds before any update is judged
    loss_threshold: float = 6.0  # robust standard deviations above the window's median
    grad_norm_threshold: float = 6.0
    good_after: int = 10  # clean updates after a checkpoint before a rewind may return to it
    rewind_margin: int = 0  # updates' worth of data skipped beyond the spike's own batches on a rewind
    max_rewinds: int = 3  # rewinds per run; the next spike after them stops the run
    skips_to_rewind: int = 3  # non-finite updates within `window` attempts that trigger a rewind (mode rewind)
    inject_at: list[int] = field(default_factory=list)  # testing aid: random-token batches at these steps
    drop_at: list[int] = field(default_factory=list)  # one update's batches dropped before each listed step

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"guard.mode={self.mode!r} is not one of {', '.join(MODES)} (conf/guard/)")
        for name in ("loss_threshold", "grad_norm_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"guard.{name}={getattr(self, name)} must be > 0 (robust standard deviations)")
        for name in ("window", "warmup", "skips_to_rewind"):
            if getattr(self, name) < 1:
                raise ValueError(f"guard.{name}={getattr(self, name)} must be >= 1")
        for name in ("good_after", "rewind_margin", "max_rewinds"):
            if getattr(self, name) < 0:
                raise ValueError(f"guard.{name}={getattr(self, name)} must be >= 0")
        if self.window < self.warmup:
            raise ValueError(
                f"guard.window={self.window} is shorter than guard.warmup={self.warmup}: the window could never "
                "hold the figures judging needs; raise guard.window or lower guard.warmup"
            )
        self.inject_at, self.drop_at = [int(k) for k in self.inject_at], [int(k) for k in self.drop_at]
        for name in ("inject_at", "drop_at"):
            if any(step < 0 for step in getattr(self, name)):
                raise ValueError(f"guard.{name}={getattr(self, name)}: steps are >= 0")
        thresholds = {"loss": self.loss_threshold, "grad_norm": self.grad_norm_threshold}
        self.detector = SpikeDetector(self.window, self.warmup, thresholds)
        self.rewinds = 0
        self.injected: list[int] = []  # inject_at steps already served (once each, a rewind's replay included)
        self.dropped: list[int] = []  # drop_at steps already served
        self.attempts = 0  # update attempts, applied or not
        self.skipped_attempts: deque[int] = deque()  # attempts skipped for non-finite figures, within the window
        self.candidate: int | None = None  # the step of last.pt while it waits to be marked good
        self.clean = 0  # updates applied without a spike or skip since the candidate was saved
        self.good_step: int | None = None  # the step of the checkpoint named last_good
        self.vocab_size, self.seed, self.rank = 0, 0, 0

    @property
    def measures(self) -> bool:
        return self.mode != "off"

    @property
    def holds_back(self) -> bool:
        """Whether a spike's update is left unapplied (skip, rewind) rather than applied (warn)."""
        return self.mode in ("skip", "rewind")

    def check_run(self, checkpoint_interval: int) -> None:
        """Refuse what this run's settings make impossible, before anything is written."""
        if self.mode == "rewind" and not checkpoint_interval:
            raise ValueError(
                "guard=rewind returns to a checkpoint and train.checkpoint_interval=0 writes none before the end: "
                "set train.checkpoint_interval (e.g. 100), or use guard=skip"
            )

    def setup(self, vocab_size: int, seed: int, rank: int) -> None:
        self.vocab_size, self.seed, self.rank = vocab_size, seed, rank

    def describe(self) -> str:
        if not self.measures:
            return "guard: off"
        line = (
            f"guard: {self.mode} on a loss > {self.loss_threshold:g} or grad norm > {self.grad_norm_threshold:g} "
            f"robust sigmas above the last {self.window} updates' median (after {self.warmup})"
        )
        if self.mode == "rewind":
            line += f"; at most {self.max_rewinds} rewinds, margin {self.rewind_margin} updates"
        if self.inject_at:
            line += f"; injecting random-token batches at steps {self.inject_at} (testing aid)"
        if self.drop_at:
            line += f"; dropping one update's batches before each of steps {self.drop_at}"
        return line

    # ---- the loop's questions ---------------------------------------------------------------------------------
    def drops(self, step: int) -> int:
        """How many updates' batches to draw and drop before the update attempted at `step` (once per run)."""
        if step not in self.drop_at or step in self.dropped:
            return 0
        self.dropped.append(step)
        return self.drop_at.count(step)

    def inject(self, step: int, batches: list) -> list:
        """The update's batches, or at an `inject_at` step not yet served, as many of uniform random tokens."""
        if step not in self.inject_at or step in self.injected:
            return batches
        self.injected.append(step)
        out = []
        for i, (x, y, _) in enumerate(batches):
            # its own generator, seeded by run, step, rank and micro-batch: the run's RNG streams are not touched
            generator = torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 10_007 + self.rank) * 101 + i)
            tokens = torch.randint(0, self.vocab_size, (x.shape[0], x.shape[1] + 1), generator=generator)
            out.append((tokens[:, :-1].to(x.dtype).contiguous(), tokens[:, 1:].to(y.dtype).contiguous(), None))
        return out

    def judge(self, step: int, loss: float, grad_norm: float) -> Spike | None:
        """A finite update's figures: a Spike when they trip the detector (never in mode off)."""
        self.attempts += 1
        if not self.measures:
            return None
        return self.detector.judge(step, {"loss": loss, "grad_norm": grad_norm})

    def applied(self, loss: float, grad_norm: float, spike: Spike | None, last_saved: int | None = None) -> bool:
        """An update went on with these figures (`spike`: it tripped the detector in mode warn); whether last.pt
        (holding step `last_saved`) has now earned its `last_good` name."""
        if not self.measures:
            return False
        self.detector.add({"loss": loss, "grad_norm": grad_norm})
        self.clean = 0 if spike is not None else self.clean + 1
        if self.mode != "rewind" or self.candidate is None or self.clean < self.good_after:
            return False
        # a resume from an earlier checkpoint than last.pt leaves last.pt another one: never name that one good
        good = self.candidate == last_saved
        self.good_step, self.candidate = (self.candidate if good else self.good_step), None
        return good

    def not_finite(self) -> bool:
        """An update skipped for a non-finite loss or norm (attempted already); whether it calls for a rewind."""
        self.clean = 0
        self.skipped_attempts.append(self.attempts)
        while self.skipped_attempts and self.skipped_attempts[0] <= self.attempts - self.window:
            self.skipped_attempts.popleft()
        return self.mode == "rewind" and len(self.skipped_attempts) >= self.skips_to_rewind

    def spiked(self) -> None:
        self.clean = 0

    def saved(self, step: int) -> None:
        """last.pt is about to hold `step` (called before the save, so the checkpoint holds the state after it): a
        candidate for last_good once `good_after` clean updates went on from it."""
        self.candidate, self.clean = step, 0

    # ---- a checkpoint part --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "detector": self.detector.state_dict(),
            "lasting": self.lasting(),
            "candidate": self.candidate,
            "clean": self.clean,
        }

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.restore_lasting(state["lasting"])
        self.candidate, self.clean = state["candidate"], state["clean"]

    def lasting(self) -> dict:
        """What a rewind keeps across the checkpoint it restores: how many rewinds, which injections fired, and the
        recent non-finite attempts."""
        return {
            "rewinds": self.rewinds,
            "good_step": self.good_step,
            "injected": list(self.injected),
            "dropped": list(self.dropped),
            "attempts": self.attempts,
            "skipped_attempts": list(self.skipped_attempts),
        }

    def restore_lasting(self, lasting: dict) -> None:
        self.rewinds, self.good_step = lasting["rewinds"], lasting["good_step"]
        self.injected, self.dropped = list(lasting["injected"]), list(lasting["dropped"])
        self.attempts, self.skipped_attempts = lasting["attempts"], deque(lasting["skipped_attempts"])


class UpdateSnapshot:
    """What an update's forwards move besides the gradients, taken before them so a skip can put it back: the
    persistent buffers of the modules this rank runs (a MoE's balancing bias) and every RNG stream."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = [(b, b.detach().clone()) for b in buffers]
        self.rng = capture_rng_state()

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        restore_rng_state(self.rng)
