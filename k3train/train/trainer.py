"""The update loop: batch -> forward -> loss / accumulation -> backward -> clip -> step (+ QK-Clip) -> schedule.

The Trainer composes parts built elsewhere (model, optimizer, schedule, precision, loaders, metrics) and owns
only the loop and its counters. Everything it needs to continue exactly is in `checkpoint_payload()`.

Accumulation: each micro-batch's mean loss is divided by the number of micro-batches, so k micro-batches of
B/k sequences give the gradient of one batch of B (every micro-batch has the same token count). For a MoE with
Quantile Balancing this is arithmetic, not a promise of identical routing: the router bias changes on every
training forward pass, so k micro-batches see k bias updates where one big batch would see one.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from k3train.config import ProfileConfig, TrainConfig
from k3train.data import EndOfData
from k3train.optim import qk_clip
from k3train.train.checkpoint import check_compatible, keep_last, link_or_copy, save_checkpoint
from k3train.train.evaluate import evaluate
from k3train.train.metrics import MetricsWriter
from k3train.train.precision import Precision
from k3train.train.profile import make_profiler
from k3train.train.progress import Progress, Window, peak_memory_mb, say
from k3train.train.rng import capture_rng_state, restore_rng_state


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


class TrainingDiverged(RuntimeError):
    """Too many non-finite updates in a row."""


@dataclass
class TrainState:
    step: int = 0  # successful optimizer updates: the schedule's position
    tokens: int = 0  # training tokens consumed, skipped updates included (they consumed data)
    skipped_updates: int = 0
    consecutive_skips: int = 0


class Trainer:
    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 schedule_factory: Callable, precision: Precision, train_loader, val_loader,
                 config: TrainConfig, device: torch.device, metrics: MetricsWriter, run_dir: Path,
                 meta: dict, profile: Optional[ProfileConfig] = None):
        self.model = model  # the uncompiled module: its state_dict keys stay stable
        self.forward = torch.compile(model) if config.compile else model
        self.optimizer = optimizer
        self.precision = precision
        self.scaler = precision.make_scaler(device)
        self.train_loader, self.val_loader = train_loader, val_loader
        self.config, self.device, self.metrics = config, device, metrics
        self.run_dir = Path(run_dir)
        self.checkpoint_path = self.run_dir / "last.pt"
        # The checkpoint last.pt replaced, until an update goes on from the new one (see save()).
        self.previous_path = self.run_dir / "previous.pt"
        self.meta = meta
        self.profile = profile or ProfileConfig()
        self.state = TrainState()
        self.session_start_step = 0
        self.signals = StopSignals()  # the runner installs it around fit(); the loop only reads the flag
        self.saved_step: Optional[int] = None  # the step of the checkpoint in last.pt, when this session knows it
        self._previous_step: Optional[int] = None
        # Whether previous.pt is on disk (a killed session's counts too), so the loop checks a flag, not the disk.
        self._previous_kept = self.previous_path.exists()
        self.label = "[plumbing: smoke_test_lm] " if getattr(model, "is_plumbing_check", False) else ""
        self.tokens_per_update = train_loader.tokens_per_batch * config.gradient_accumulation_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._fixed_batches: Optional[list] = None  # overfit_batch mode
        has_mla = qk_clip.set_max_logit_tracking(model, config.qk_clip_tau is not None) > 0
        self.qk_clip_tau = config.qk_clip_tau if has_mla else None
        self.total_steps = self._plan_total_steps()
        self.schedule = schedule_factory(total_steps=self.total_steps)

    # ---- planning -------------------------------------------------------------------------------------------
    def _plan_total_steps(self) -> int:
        limits = []
        if self.config.max_steps is not None:
            limits.append(self.config.max_steps)
        if self.config.max_tokens is not None:
            limits.append(math.ceil(self.config.max_tokens / self.tokens_per_update))
        if not self.config.overfit_batch:
            remaining = self.train_loader.batches_remaining() // self.config.gradient_accumulation_steps
            limits.append(self.state.step + remaining)
        if not limits:
            raise ValueError("train.overfit_batch=true needs train.max_steps or train.max_tokens")
        total = min(limits)
        if total < 1:
            raise ValueError(
                f"the train split has too few tokens for one update of {self.tokens_per_update} tokens: "
                "lower train.batch_size, train.seq_len or train.gradient_accumulation_steps"
            )
        return total

    def plan_done(self) -> Optional[str]:
        """Why the run as planned is over (max_steps, max_tokens, end_of_data), or None while work is left."""
        s, c = self.state, self.config
        if c.max_steps is not None and s.step >= c.max_steps:
            return "max_steps"
        if c.max_tokens is not None and s.tokens >= c.max_tokens:
            return "max_tokens"
        if not c.overfit_batch and self.train_loader.batches_remaining() < c.gradient_accumulation_steps:
            return "end_of_data"
        return None

    def _stop_reason(self) -> Optional[str]:
        if self.config.stop_after is not None and self.state.step - self.session_start_step >= self.config.stop_after:
            return self.plan_done() or "stop_after"
        return self.plan_done()

    # ---- one update -----------------------------------------------------------------------------------------
    def _micro_batches(self):
        accum = self.config.gradient_accumulation_steps
        if not self.config.overfit_batch:
            return [self.train_loader.next_batch() for _ in range(accum)]
        if self._fixed_batches is None:
            # Always the first batches of the split, so a resumed overfit run repeats the same ones.
            cursor = self.train_loader.state_dict()
            self.train_loader.reset()
            self._fixed_batches = [self.train_loader.next_batch() for _ in range(accum)]
            self.train_loader.load_state_dict(cursor)
        return self._fixed_batches

    def train_step(self) -> dict:
        """One optimizer attempt over gradient_accumulation_steps micro-batches. Returns the step's figures."""
        accum = self.config.gradient_accumulation_steps
        lr_factor = self.schedule.apply(self.optimizer, self.state.step)
        losses = []
        for x, y in self._micro_batches():
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.precision.autocast(self.device):
                _, loss = self.forward(x, targets=y)
            self.scaler.scale(loss / accum).backward()
            losses.append(loss.detach().float())
        self.state.tokens += self.tokens_per_update
        loss = torch.stack(losses).mean().item()

        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads).item() if grads else 0.0
        result = {"loss": loss, "grad_norm": grad_norm, "lr_factor": lr_factor}
        if math.isfinite(loss) and math.isfinite(grad_norm):
            if self.config.clip_norm is not None:
                # Scales each parameter's .grad in place (it must be given the parameters, not the gradients).
                torch.nn.utils.clip_grads_with_norm_(self.params, self.config.clip_norm, torch.tensor(grad_norm))
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.qk_clip_tau is not None:
                result["qk_clip"] = qk_clip.qk_clip_(self.model, self.qk_clip_tau)
            self.state.step += 1
            self.state.consecutive_skips = 0
            result["skipped"] = False
        else:
            self.scaler.update()  # fp16: an overflow lowers the loss scale; otherwise a no-op
            if self.qk_clip_tau is not None:
                qk_clip.reset_max_logits(self.model)  # measured by the failed forward: never act on it
            self.state.skipped_updates += 1
            self.state.consecutive_skips += 1
            result["skipped"] = True
        self.optimizer.zero_grad(set_to_none=True)
        return result

    # ---- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train until a stop condition; returns the end reason. Final eval and checkpoint on a clean stop."""
        self.session_start_step = self.state.step
        self._announce()
        progress = Progress(self.config, self.state.step, self.total_steps, self.label)
        window = Window()
        reason = self._stop_reason()
        with make_profiler(self.profile, self.run_dir, self.device) as profiler:
            while reason is None:
                t0 = time.perf_counter()
                try:
                    result = self.train_step()
                except EndOfData:  # a loader that ran dry despite the plan: stop at the last update boundary
                    self.optimizer.zero_grad(set_to_none=True)
                    reason = "end_of_data"
                    break
                window.add(result, time.perf_counter() - t0, self.tokens_per_update)
                profiler.step()
                if result["skipped"]:
                    self._on_skip(result)
                else:
                    self._drop_previous()  # an update went on from last.pt: it is a good checkpoint
                    progress.update(self.state.step, result["loss"], window.tokens_per_s())
                    self._after_update(window, progress)
                received = self.signals.received
                reason = f"signal:{received.name}" if received else self._stop_reason()
        self._finish(reason, progress)
        return reason

    def _announce(self) -> None:
        c = self.config
        line = (f"{self.label}training {self.total_steps} updates of {self.tokens_per_update:,} tokens "
                f"(batch {c.batch_size} x seq {c.seq_len} x accum {c.gradient_accumulation_steps}) "
                f"from step {self.state.step} on {self.device}, precision {self.precision.dtype}")
        print(line, flush=True)

    def _on_skip(self, result: dict) -> None:
        s = self.state
        self.metrics.log("skip", step=s.step, tokens=s.tokens, loss=result["loss"], grad_norm=result["grad_norm"],
                         skipped_updates=s.skipped_updates, consecutive=s.consecutive_skips,
                         loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None)
        say(f"{self.label}step {s.step}: non-finite loss {result['loss']} or grad norm "
            f"{result['grad_norm']}; update skipped ({s.consecutive_skips} in a row)")
        if s.consecutive_skips >= self.config.max_consecutive_skips:
            self.metrics.log("end", step=s.step, tokens=s.tokens, reason="diverged",
                             skipped_updates=s.skipped_updates)
            raise TrainingDiverged(f"{s.consecutive_skips} non-finite updates in a row at step {s.step}: the run "
                                   f"has diverged. {self._keep_good_checkpoint()}")

    def _keep_good_checkpoint(self) -> str:
        """Leave in last.pt a checkpoint an update went on from, and say which one it is and what to do."""
        fix = "lower optim.lr" + (" or train.grad_clip" if self.config.clip_norm else " or enable train.grad_clip")
        last, step = self.checkpoint_path, self.state.step
        if not last.exists():
            return f"No checkpoint was written: {fix} and start again"
        if self.saved_step is None:
            return f"{last} is from an earlier session: {fix} and resume from a checkpoint before the failures"
        if self.saved_step != step:
            return f"{last} (step {self.saved_step}) is good (updates went on from it): {fix} and resume=auto"
        # last.pt holds the very weights that failed: one finite update blew them up, then every step overflowed
        if not self.previous_path.exists():
            return (f"{last} (step {step}) holds the weights that failed and no earlier checkpoint is kept: {fix} "
                    "and start again")
        failed = self.run_dir / f"diverged_step_{step:07d}.pt"
        os.replace(last, failed)
        os.replace(self.previous_path, last)
        self.saved_step, self._previous_kept = self._previous_step, False
        at = f" (step {self._previous_step})" if self._previous_step is not None else ""
        return (f"{last} is back to the checkpoint before it{at}, which updates went on from (the step-{step} one "
                f"holds the weights that failed: kept as {failed.name}): {fix} and resume=auto")

    def _after_update(self, window: Window, progress: Progress) -> None:
        s, c = self.state, self.config
        if s.step % c.log_interval == 0 or s.step == self.total_steps:
            record = self.metrics.log("train", step=s.step, tokens=s.tokens, **window.summary(),
                                      lr={g.get("name", str(i)): g["lr"]
                                          for i, g in enumerate(self.optimizer.param_groups)},
                                      peak_memory_mb=peak_memory_mb(self.device),
                                      skipped_updates=s.skipped_updates, **self._diagnostics())
            progress.log_line(record)
            window.reset()
        if c.eval_interval and s.step % c.eval_interval == 0 and s.step < self.total_steps:
            self.run_eval(progress)
        if c.checkpoint_interval and s.step % c.checkpoint_interval == 0 and s.step < self.total_steps:
            self.save()

    def _diagnostics(self) -> dict:
        out = {}
        if hasattr(self.model, "diagnostics"):
            out["model"] = self.model.diagnostics()
        if hasattr(self.optimizer, "diagnostics"):
            out["optimizer"] = self.optimizer.diagnostics()
        return out

    def run_eval(self, progress: Optional[Progress] = None) -> dict:
        result = evaluate(self.model, self.val_loader, self.config.eval_batches, self.precision, self.device)
        self.metrics.log("eval", step=self.state.step, tokens=self.state.tokens, **result)
        msg = f"{self.label}eval step {self.state.step}: val loss {result['loss']:.4f} ({result['batches']} batches)"
        (progress.write if progress else say)(msg)
        return result

    def _finish(self, reason: str, progress: Progress) -> None:
        progress.close()
        if reason != "stop_after" and self.signals.received is None and self.state.step > 0:
            self.run_eval()  # not when time is short (a signal) or the run goes on (stop_after)
        if self.saved_step != self.state.step:  # an interval checkpoint may have just saved this step
            self.save()
        if self.plan_done() is not None:
            self._drop_previous()  # the run is complete: no update will ever go on from last.pt
        self.metrics.log("end", step=self.state.step, tokens=self.state.tokens, reason=reason,
                         skipped_updates=self.state.skipped_updates)
        say(f"{self.label}stopped at step {self.state.step} ({reason}); checkpoint {self.checkpoint_path}")

    # ---- checkpointing --------------------------------------------------------------------------------------
    def checkpoint_payload(self) -> dict:
        return {
            "meta": self.meta,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "trainer": asdict(self.state),
            # The plan the schedule was built for, and the limits it came from: a resume keeps it unless they
            # change (skipped updates consume data, so re-deriving it from the data left would shift the lr).
            "schedule": {"total_steps": self.total_steps, "max_steps": self.config.max_steps,
                         "max_tokens": self.config.max_tokens},
            "loaders": {"train": self.train_loader.state_dict(), "val": self.val_loader.state_dict()},
            "rng": capture_rng_state(),
        }

    def save(self) -> None:
        """Checkpoint at an update boundary (gradients are already cleared).

        An update can blow the weights up and still be finite; only the non-finite steps after it show it. So the
        checkpoint last.pt replaces stays as previous.pt (a hard link: free) until an update goes on from the new
        one, and a divergence right after a save puts it back (_keep_good_checkpoint)."""
        t0 = time.perf_counter()
        self.previous_path.unlink(missing_ok=True)
        self._previous_kept = False
        if self.saved_step is not None and self.checkpoint_path.exists():  # last.pt is this line's (not a later
            # one left behind by a resume from an earlier step_*.pt)
            link_or_copy(self.checkpoint_path, self.previous_path)
            self._previous_step, self._previous_kept = self.saved_step, True
        size = save_checkpoint(self.checkpoint_path, self.checkpoint_payload())
        self.saved_step = self.state.step
        keep_last(self.run_dir, self.checkpoint_path, self.state.step, self.config.keep_last_k)
        self.metrics.log("checkpoint", step=self.state.step, tokens=self.state.tokens,
                         path=str(self.checkpoint_path), bytes=size, seconds=round(time.perf_counter() - t0, 3))

    def _drop_previous(self) -> None:
        if self._previous_kept:
            self.previous_path.unlink(missing_ok=True)
            self._previous_step, self._previous_kept = None, False

    def restore(self, payload: dict, path: Path) -> dict:
        """Continue from a checkpoint: validate compatibility first, then restore every stateful part.

        Optimizer hyperparameters (lr, weight decay, betas, momentum...) come from the current config, not the
        checkpoint, so a resume may change them on purpose; returns {"group.setting": [old, new]} for each change.
        """
        check_compatible(payload["meta"], self.meta, path)
        current = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        changed = {}
        for group, settings in zip(self.optimizer.param_groups, current):
            for key, value in settings.items():
                if key != "lr" and group.get(key) != value:  # lr is re-derived from initial_lr every update
                    changed[f"{group.get('name', '?')}.{key}"] = [group.get(key), value]
            group.update(settings)
        self.scaler.load_state_dict(payload["scaler"])
        self.train_loader.load_state_dict(payload["loaders"]["train"])
        self.val_loader.load_state_dict(payload["loaders"]["val"])
        self.state = TrainState(**payload["trainer"])
        restore_rng_state(payload["rng"])
        plan = payload["schedule"]
        if (plan.get("max_steps"), plan.get("max_tokens")) == (self.config.max_steps, self.config.max_tokens) \
                and "total_steps" in plan:
            self.total_steps = plan["total_steps"]
        else:
            self.total_steps = self._plan_total_steps()
        self.schedule.total_steps = self.total_steps
        if self.state.step > 0:  # the lr of the last update, as the checkpoint had it (not the configured peak)
            self.schedule.apply(self.optimizer, self.state.step - 1)
        if Path(path).resolve() == self.checkpoint_path.resolve():
            self.saved_step = self.state.step  # continuing from last.pt itself
        self.resumed = {"path": str(path), "changed": changed}
        return changed

    def log_resume(self) -> None:
        """The resume event and line (after the session has opened its log)."""
        s, path, changed = self.state, self.resumed["path"], self.resumed["changed"]
        cursor = self.train_loader.state_dict()["cursor"]
        self.metrics.log("resume", step=s.step, tokens=s.tokens, path=path, train_cursor=cursor,
                         lr={g.get("name", str(i)): g["initial_lr"] * self.schedule.factor(s.step)
                             for i, g in enumerate(self.optimizer.param_groups)},
                         total_steps=self.total_steps, changed_settings=changed)
        say(f"{self.label}resumed from {path} at step {s.step} ({s.tokens:,} tokens), train cursor {cursor}, "
               f"RNG restored" + (f"; settings changed: {changed}" if changed else ""))


