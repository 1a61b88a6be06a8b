"""The update loop: the update's batches -> the UpdateStep (forward and backward) -> the gradient norm -> the
guard's judgement -> clip -> the optimizer step or its skip -> callbacks; and the cadence of logs, evals and
checkpoints, and a guard's rewinds (k3train/train/guard.py).

The Trainer composes parts built elsewhere (the update step, optimizer, schedule, loaders, metrics, checkpointer,
callbacks) and owns only the loop and its counters. How an update's batches become gradients (micro-batches and
their synchronisation, or a pipeline's schedule) is its UpdateStep's (k3train/train/step.py), and so are the model's
and optimizer's checkpoint parts in that layout. Everything the run needs to continue exactly is a part of its
Checkpointer (registered in __init__). It knows models only through k3train/models/protocol.py and what acts
beside the optimizer only through callbacks (k3train/train/callbacks.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from k3train.checkpoint.checkpointer import Checkpointer
from k3train.config import ProfileConfig, TrainConfig
from k3train.data import EndOfData
from k3train.observe.metrics import MetricsLogger
from k3train.observe.mfu import MFU
from k3train.observe.profile import make_profiler
from k3train.observe.progress import Progress, Window, peak_memory_mb
from k3train.runtime.console import say
from k3train.runtime.distributed import any_across_ranks
from k3train.runtime.signals import StopSignals
from k3train.train.callbacks import Callback
from k3train.train.eval_tasks import TaskEval
from k3train.train.evaluate import evaluate
from k3train.train.guard import Guard, UpdateSnapshot
from k3train.train.parallel import clip_gradients, global_grad_norm
from k3train.train.plan import TrainingPlan
from k3train.train.rng import RNGState
from k3train.train.source_losses import SourceLosses
from k3train.train.state import ConfiguredOptimizer, TrainState
from k3train.train.step import UpdateStep


class TrainingDiverged(RuntimeError):
    """Too many skipped updates in a row, or a spike after the guard's last allowed rewind."""


@runtime_checkable
class ReportsDiagnostics(Protocol):
    """An optimizer with figures for the train events (MuonAdamW: update RMS, orthogonality error)."""

    def diagnostics(self) -> dict: ...


@dataclass
class Loaders:
    """The run's loaders: train, val, and a mixture's sources' val splits by name (val/<source>/loss)."""

    train: Any
    val: Any
    val_sources: dict = field(default_factory=dict)


def _named_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The schedule scales each group's initial_lr; its name labels the log."""
    for i, group in enumerate(optimizer.param_groups):
        group.setdefault("initial_lr", group["lr"])
        group.setdefault("name", str(i))
    return optimizer


class Trainer:
    def __init__(
        self,
        *,
        step: UpdateStep,
        optimizer: torch.optim.Optimizer,
        schedule_factory: Callable,
        loaders: Loaders,
        config: TrainConfig,
        metrics: MetricsLogger,
        checkpointer: Checkpointer,
        callbacks: dict[str, Callback] | None = None,
        profile: ProfileConfig | None = None,
        task_eval: TaskEval | None = None,
        guard: Guard | None = None,
    ):
        self.step, self.model = step, step.model  # the unwrapped, uncompiled module: its state_dict keys stay stable
        self.device, self.dims, self.precision, self.scaler = step.device, step.dims, step.precision, step.scaler
        self.optimizer = _named_groups(optimizer)
        self.train_loader, self.val_loader, self.val_sources = loaders.train, loaders.val, loaders.val_sources
        # a mixture's train loss per source (a loader that says each row's source: MixtureLoader.sources_of)
        self.source_losses = SourceLosses(loaders.train.names) if hasattr(loaders.train, "sources_of") else None
        self.task_eval = task_eval  # train.eval_tasks: lm-evaluation-harness tasks (k3train/train/eval_tasks.py)
        self.config, self.metrics, self.checkpointer, self.run_dir = config, metrics, checkpointer, checkpointer.run_dir
        self.callbacks, self.profile = callbacks or {}, profile or ProfileConfig()
        self.guard = guard or Guard(mode="off")
        self.state, self.session_start_step = TrainState(), 0
        # False: step on a non-finite loss or norm too (a dry run, whose fake collectives leave values meaningless)
        self.skip_non_finite = True
        self.signals = StopSignals()  # the runner installs it around fit(); the loop only reads the flag
        self.label = self.model.log_label
        # Global: every rank's rows of the batch (the loaders' data-parallel view), so plans and logs are per run.
        self.tokens_per_update = loaders.train.global_tokens_per_batch * config.gradient_accumulation_steps
        dtype, world = self.precision.dtype, self.dims.world_size
        self.mfu = MFU.for_model(self.model, config.seq_len, self.device, dtype, config.peak_flops, devices=world)
        self._fixed_batches: list | None = None  # overfit_batch mode
        self.plan = TrainingPlan(config, self.state, loaders.train, self.tokens_per_update, schedule_factory)
        self.schedule, self._optimizer_part = self.plan.schedule, ConfiguredOptimizer(optimizer)
        self._resumed_from: Path | None = None
        self._register_checkpoint_parts()

    def _register_checkpoint_parts(self) -> None:
        parts = {
            "model": self.model,
            "optimizer": self._optimizer_part,
            "scaler": self.scaler,
            "train_loader": self.train_loader,
            "val_loader": self.val_loader,
            "rng": RNGState(),
            "trainer": self.state,
            "plan": self.plan,
        }  # restored in this order: the plan re-derives from the counters and cursor
        for name, part in self.step.checkpoint_parts(parts, self.optimizer).items():
            self.checkpointer.add(name, part)
        self.checkpointer.add("guard", self.guard, optional=True)  # its window: a resume judges as the run would
        self.guard.setup(self.model.config.vocab_size, self.config.seed, self.dims.rank)
        for callback in self.callbacks.values():
            callback.setup(self.model, self.optimizer, self.dims)

    @property
    def total_steps(self) -> int:
        return self.plan.total_steps

    def _stop_reason(self) -> str | None:
        if self.config.stop_after is not None and self.state.step - self.session_start_step >= self.config.stop_after:
            return self.plan.done() or "stop_after"
        return self.plan.done()

    # ---- one update -----------------------------------------------------------------------------------------
    def _micro_batches(self):
        accum = self.config.gradient_accumulation_steps
        if not self.config.overfit_batch:
            for _ in range(accum * self.guard.drops(self.state.step)):  # guard.drop_at: data passed over by hand
                self.train_loader.next_batch()
            return self.guard.inject(self.state.step, [self.train_loader.next_batch() for _ in range(accum)])
        if self._fixed_batches is None:
            # Always the first batches of the split, so a resumed overfit run repeats the same ones.
            cursor = self.train_loader.state_dict()
            self.train_loader.reset()
            self._fixed_batches = [self.train_loader.next_batch() for _ in range(accum)]
            self.train_loader.load_state_dict(cursor)
        return self._fixed_batches

    def train_step(self) -> dict:
        """One optimizer attempt over gradient_accumulation_steps micro-batches. Returns the step's figures."""
        lr_factor = self.schedule.apply(self.optimizer, self.state.step)
        batches = self._micro_batches()
        before = UpdateSnapshot(self.step.buffers())  # what a skip puts back
        result = self.step.forward_backward(batches, per_target=self.source_losses is not None)
        if self.source_losses is not None:  # a mixture's per-target losses, summed by source (source_losses.py)
            first = 0 if self.config.overfit_batch else self.train_loader.batches - len(batches)  # batch 0's index
            sources = torch.cat([self.train_loader.sources_of(first + i) for i in range(len(batches))])
            self.source_losses.add(result.by_target, sources)
        return self._update(result.loss, lr_factor, before)

    def _update(self, loss: float, lr_factor: float, before: UpdateSnapshot) -> dict:
        """The optimizer step after an update's backward: the gradient norm over every rank, the guard's judgement,
        clipping, the step or its skip (a non-finite loss or norm, or a spike the guard holds back), which puts
        back what the update's forwards moved (`before`)."""
        self.state.tokens += self.tokens_per_update
        self.scaler.unscale_(self.optimizer)
        grad_norm = global_grad_norm(self.step.params, self.dims, self.step.expert_shards)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        spike = self.guard.judge(self.state.step, loss, grad_norm) if finite else None
        result = {"loss": loss, "grad_norm": grad_norm, "lr_factor": lr_factor, "spike": spike, "rewind": None}
        held_back = spike is not None and self.guard.holds_back
        if (finite or not self.skip_non_finite) and not held_back:
            if self.config.clip_norm is not None:
                clip_gradients(self.step.params, self.config.clip_norm, grad_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.state.step += 1
            self.state.consecutive_skips = 0
            for callback in self.callbacks.values():
                callback.after_optimizer_step(self.state.step)
            if self.guard.applied(loss, grad_norm, spike, self.checkpointer.latest_step):
                self.checkpointer.mark_good(self.guard.good_step)
            result["skipped"] = False
        else:
            scale = self.scaler.state_dict() if held_back else None
            self.scaler.update()  # fp16: an overflow lowers the loss scale; otherwise a no-op
            if scale:  # a finite update held back leaves the loss scale's growth count as it was
                self.scaler.load_state_dict(scale)
            before.restore()
            if held_back:
                self.guard.spiked()
                result["rewind"] = spike.describe() if self.guard.mode == "rewind" else None
            elif self.guard.not_finite():
                result["rewind"] = f"{self.guard.skips_to_rewind} non-finite updates within {self.guard.window}"
            self.state.skipped_updates += 1
            self.state.consecutive_skips += 1
            for callback in self.callbacks.values():
                callback.after_skipped_step(self.state.step)
            result["skipped"] = True
        if self.source_losses is not None:
            self.source_losses.end_update(result["skipped"])
        self.optimizer.zero_grad(set_to_none=True)
        return result

    # ---- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train until a stop condition; returns the end reason. Final eval and checkpoint on a clean stop."""
        self.session_start_step = self.state.step
        self._last_save_started = time.perf_counter()  # train.checkpoint_interval_minutes counts from here
        if self._resumed_from is not None:
            self._log_resume()
        self._announce()
        c = self.config
        saves = c.checkpoint_interval > 0 or c.checkpoint_interval_minutes is not None
        if c.asynchronous_checkpoints and saves and self.checkpointer.sharded:
            seconds = self.checkpointer.start_background_writers()  # a collective
            say(
                f"{self.label}checkpoint writer processes started in {seconds:.1f} s: saves are written behind training"
            )
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
                if result["spike"] is not None:
                    self._on_spike(result, progress)
                self._checkpoint_written(self.checkpointer.poll())  # an asynchronous save finished meanwhile
                if result["skipped"]:
                    if not (result["rewind"] and self._rewind(result["rewind"], progress)):
                        self._on_skip(result)
                else:
                    self.checkpointer.update_went_on()
                    progress.update(self.state.step, result["loss"], window.tokens_per_s())
                    self._after_update(window, progress)
                # Every rank stops at the same boundary, whichever of them a signal reached.
                received = self.signals.received
                if any_across_ranks(received is not None, self.device, self.dims.world_group):
                    reason = f"signal:{received.name}" if received else "signal:another rank"
                else:
                    reason = self._stop_reason()
        self._finish(reason, progress)
        return reason

    def _announce(self) -> None:
        c = self.config
        line = (
            f"{self.label}training {self.total_steps} updates of {self.tokens_per_update:,} tokens "
            f"(batch {c.batch_size} x seq {c.seq_len} x accum {c.gradient_accumulation_steps}) "
            f"from step {self.state.step} on {self.device}, precision {self.precision.dtype}"
        )
        print(line, flush=True)

    def _on_spike(self, result: dict, progress: Progress) -> None:
        """A `spike` event: the figures that tripped the guard, their thresholds, and what the guard does."""
        spike, action = result["spike"], {"warn": "applied", "skip": "skipped", "rewind": "rewind"}[self.guard.mode]
        self.metrics.log(
            "spike",
            step=spike.step,
            tokens=self.state.tokens,
            loss=result["loss"],
            grad_norm=result["grad_norm"],
            tripped=spike.tripped,
            action=action,
        )
        progress.write(f"{self.label}step {spike.step}: loss spike: {spike.describe()}; update {action}")

    def _on_skip(self, result: dict) -> None:
        s = self.state
        spike = result["spike"]
        self.metrics.log(
            "skip",
            step=s.step,
            tokens=s.tokens,
            loss=result["loss"],
            grad_norm=result["grad_norm"],
            reason="spike" if spike is not None else "non_finite",
            skipped_updates=s.skipped_updates,
            consecutive=s.consecutive_skips,
            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None,
        )
        if spike is None:
            say(
                f"{self.label}step {s.step}: non-finite loss {result['loss']} or grad norm "
                f"{result['grad_norm']}; update skipped ({s.consecutive_skips} in a row)"
            )
        if s.consecutive_skips >= self.config.max_consecutive_skips:
            self.metrics.log("end", step=s.step, tokens=s.tokens, reason="diverged", skipped_updates=s.skipped_updates)
            fix = "lower optim.lr" + (" or train.grad_clip" if self.config.clip_norm else " or enable train.grad_clip")
            what = "spikes the guard held back" if spike is not None else "non-finite updates"
            raise TrainingDiverged(
                f"{s.consecutive_skips} {what} in a row at step {s.step}: the run "
                f"has diverged. {self.checkpointer.set_aside_diverged(s.step, fix)}"
            )

    def _rewind(self, why: str, progress: Progress) -> bool:
        """guard=rewind: every rank restores the last good checkpoint, the train loader moves past the data from it
        to the spike's batches and `rewind_margin` updates beyond, and the loop goes on from there (a `rewind`
        event). False, the update merely skipped, while no checkpoint is good yet."""
        guard, s = self.guard, self.state
        if guard.good_step is None:
            progress.write(f"{self.label}step {s.step}: no checkpoint is good yet to rewind to; update skipped")
            return False
        lasting = guard.lasting()
        lasting["rewinds"] += 1
        if lasting["rewinds"] > guard.max_rewinds:
            self.metrics.log("end", step=s.step, tokens=s.tokens, reason="rewinds_exhausted")
            raise TrainingDiverged(
                f"step {s.step}: {why}, after the {guard.max_rewinds} rewind(s) guard.max_rewinds allows: the run "
                f"keeps spiking. Lower optim.lr, or raise guard.max_rewinds, and resume=auto ({self.checkpointer.path})"
            )
        spike_step, cursor = s.step, self.train_loader.state_dict()  # just past the spike's batches
        to = self.checkpointer.load(self.checkpointer.good_path)
        progress.rewound(to)
        guard.restore_lasting(lasting)
        guard.candidate, guard.clean = None, 0
        self.train_loader.load_state_dict(cursor)
        margin = guard.rewind_margin * self.config.gradient_accumulation_steps
        for _ in range(min(margin, self.train_loader.batches_remaining())):  # the plan stops the run at the end
            self.train_loader.next_batch()
        window = {"from_cursor": cursor["cursor"], "to_cursor": self.train_loader.state_dict()["cursor"]}
        self.metrics.log(
            "rewind",
            step=spike_step,
            to=to,
            tokens=s.tokens,
            rewinds=guard.rewinds,
            skipped_data=window,
            margin_updates=guard.rewind_margin,
            why=why,
        )
        progress.write(
            f"{self.label}step {spike_step}: {why}: rewound to the good checkpoint of step {to} "
            f"({self.checkpointer.good_path.name}), data up to the spike's and {guard.rewind_margin} more "
            f"update(s) skipped (rewind {guard.rewinds} of at most {guard.max_rewinds})"
        )
        return True

    def _after_update(self, window: Window, progress: Progress) -> None:
        s, c = self.state, self.config
        if s.step % c.log_interval == 0 or s.step == self.total_steps:
            figures = window.summary()
            if self.source_losses is not None:
                by_source = self.source_losses.summary(self.device, self.dims.world_group)
                figures.update({f"train/{name}/loss": loss for name, loss in by_source.items()})
            record = self.metrics.log(
                "train",
                step=s.step,
                tokens=s.tokens,
                **figures,
                mfu=self.mfu.of(figures["tokens_per_s"]),
                lr={g["name"]: g["lr"] for g in self.optimizer.param_groups},
                peak_memory_mb=peak_memory_mb(self.device),
                skipped_updates=s.skipped_updates,
                **self._diagnostics(),
            )
            progress.log_line(record)
            window.reset()
        if c.eval_interval and s.step % c.eval_interval == 0 and s.step < self.total_steps:
            self.run_eval(progress)
        if (
            self.task_eval
            and c.eval_tasks_interval
            and s.step % c.eval_tasks_interval == 0
            and s.step < self.total_steps
        ):
            self.run_eval_tasks(progress)
        if s.step < self.total_steps and (
            (c.checkpoint_interval and s.step % c.checkpoint_interval == 0) or self._checkpoint_due_by_time()
        ):
            self.save()

    def _diagnostics(self) -> dict:
        out = {"model": self.model.diagnostics()}
        if isinstance(self.optimizer, ReportsDiagnostics):
            out["optimizer"] = self.optimizer.diagnostics()
        for name, callback in self.callbacks.items():
            figures = callback.metrics()  # since the last train event
            if figures:
                out[name] = figures
        return self.step.figures(out, self.callbacks)  # a pipeline's: every stage's

    def run_eval(self, progress: Progress | None = None) -> dict:
        def val_loss(loader) -> dict:
            args = (self.config.eval_batches, self.precision, self.device, self.dims.dp_group)
            return evaluate(self.model, loader, *args, loss_of=self.step.eval_loss)

        result = val_loss(self.val_loader)
        for name, loader in self.val_sources.items():
            result[f"val/{name}/loss"] = val_loss(loader)["loss"]
        self.metrics.log("eval", step=self.state.step, tokens=self.state.tokens, **result)
        # What it measured, beside the number: `k3train.evaluate` reads the whole split by default (another number).
        msg = (
            f"{self.label}eval step {self.state.step}: val loss {result['loss']:.4f} "
            f"(the first {result['batches']} val batches, {result['val_tokens']:,} tokens)"
        )
        if self.val_sources:
            msg += "; " + ", ".join(f"{name} {result[f'val/{name}/loss']:.4f}" for name in self.val_sources)
        (progress.write if progress else say)(msg)
        return result

    def run_eval_tasks(self, progress: Progress | None = None) -> dict:
        """train.eval_tasks on the model as it is now: an eval_tasks event {step, tokens, task: {metric: value}}."""
        t0 = time.perf_counter()
        max_length = getattr(self.model.config, "max_seq_len", None) or self.config.seq_len  # as lm_eval's HFLM
        result = self.task_eval(self.model, max_length, self.precision, self.device)
        seconds = round(time.perf_counter() - t0, 3)
        self.metrics.log("eval_tasks", step=self.state.step, tokens=self.state.tokens, seconds=seconds, **result)
        shown = "; ".join(
            f"{task} " + ", ".join(f"{metric} {value:.4g}" for metric, value in scores.items())
            for task, scores in result.items()
        )
        (progress.write if progress else say)(f"{self.label}tasks step {self.state.step}: {shown} ({seconds:.1f} s)")
        return result

    def _finish(self, reason: str, progress: Progress) -> None:
        progress.close()
        if reason != "stop_after" and not reason.startswith("signal:") and self.state.step > 0:
            self.run_eval()  # not when time is short (a signal) or the run goes on (stop_after)
            if self.task_eval:
                self.run_eval_tasks()
        self._checkpoint_written(self.checkpointer.wait())  # the save in flight first, on every rank
        if self.checkpointer.saved_step != self.state.step:  # an interval checkpoint may have just saved this step
            self.save(wait=True)
        if self.plan.done() is not None:
            self.checkpointer.update_went_on()  # the run is complete: no update will ever go on from last.pt
        self.metrics.log(
            "end",
            step=self.state.step,
            tokens=self.state.tokens,
            reason=reason,
            skipped_updates=self.state.skipped_updates,
        )
        say(f"{self.label}stopped at step {self.state.step} ({reason}); checkpoint {self.checkpointer.path}")

    # ---- checkpointing ------------------------------------------------------------------------------------------
    def save(self, wait: bool | None = None) -> None:
        """Checkpoint at an update boundary (gradients are already cleared): written now, or with
        train.checkpoint_async (`wait` False) copied now and written in the background, its `checkpoint` event
        logged when the write ends (_checkpoint_written)."""
        self._checkpoint_written(self.checkpointer.wait())  # one save at a time: the one in flight ends first
        t0 = time.perf_counter()
        self._last_save_started = t0
        self.guard.saved(self.state.step)
        in_background = self.config.asynchronous_checkpoints if wait is None else not wait
        size = self.checkpointer.save(self.state.step, wait=not in_background)  # sharded: a collective
        if size is not None:
            seconds = time.perf_counter() - t0
            record = {"step": self.state.step, "path": str(self.checkpointer.path), "bytes": size}
            self._checkpoint_written({**record, "blocked_s": seconds, "background_s": 0.0})

    def _checkpoint_written(self, written: dict | None) -> None:
        """The `checkpoint` event of a save that has ended: `seconds` the loop was blocked (the whole write when
        synchronous, the copy of the state when not) and `background_s` the write behind it."""
        if written is None:
            return
        self.metrics.log(
            "checkpoint",
            step=written["step"],
            tokens=self.state.tokens,
            path=written["path"],
            bytes=written["bytes"],
            seconds=round(written["blocked_s"], 3),
            background_s=round(written["background_s"], 3),
        )

    def _checkpoint_due_by_time(self) -> bool:
        """train.checkpoint_interval_minutes: whether that long has passed since the last save began, the same
        answer on every rank (rank 0's clock decides)."""
        minutes = self.config.checkpoint_interval_minutes
        if minutes is None:
            return False
        due = time.perf_counter() - self._last_save_started >= 60 * minutes
        return any_across_ranks(due and self.dims.rank == 0, self.device, self.dims.world_group)

    def resume(self, path: Path) -> None:
        """Continue from a checkpoint: the Checkpointer checks it against this run and restores every part.
        Optimizer hyperparameters come from the current config (see state.ConfiguredOptimizer)."""
        self.checkpointer.load(path)
        if self.state.step > 0:  # the lr of the last update, as the checkpoint had it (not the configured peak)
            self.schedule.apply(self.optimizer, self.state.step - 1)
        self._resumed_from = Path(path)

    def _log_resume(self) -> None:
        s, path, changed = self.state, str(self._resumed_from), self._optimizer_part.changed
        cursor = self.train_loader.state_dict()["cursor"]
        self.metrics.log(
            "resume",
            step=s.step,
            tokens=s.tokens,
            path=path,
            train_cursor=cursor,
            lr={g["name"]: g["initial_lr"] * self.schedule.factor(s.step) for g in self.optimizer.param_groups},
            total_steps=self.total_steps,
            changed_settings=changed,
        )
        say(
            f"{self.label}resumed from {path} at step {s.step} ({s.tokens:,} tokens), train cursor {cursor}, "
            f"RNG restored" + (f"; settings changed: {changed}" if changed else "")
        )
        self._resumed_from = None
