"""The update loop: batch -> forward -> loss / accumulation -> backward -> grad clip -> step -> callbacks.

The Trainer composes parts built elsewhere (model, optimizer, schedule, precision, loaders, metrics, checkpointer,
callbacks) and owns only the loop and its counters. Everything it needs to continue exactly is a part of its
Checkpointer (registered in __init__). It knows models only through k3train/models/protocol.py and what acts
beside the optimizer only through callbacks (k3train/train/callbacks.py).

Accumulation: each micro-batch's mean loss is divided by the number of micro-batches, so k micro-batches of
B/k sequences give the gradient of one batch of B (every micro-batch has the same token count). For a model whose
training forward pass changes its own state (a router bias, say) this is arithmetic, not a promise of identical
results: k micro-batches see k state changes where one big batch would see one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.nn import ModuleList

from k3train.checkpoint.checkpointer import Checkpointer
from k3train.checkpoint.expert_shards import expert_sharded_model, expert_sharded_optimizer, with_expert_shards
from k3train.config import ProfileConfig, TrainConfig
from k3train.data import EndOfData
from k3train.models.common.loss import recording_target_losses
from k3train.models.layout import expert_shards
from k3train.models.protocol import LanguageModel, document_inputs
from k3train.observe.metrics import MetricsLogger
from k3train.observe.mfu import MFU
from k3train.observe.profile import make_profiler
from k3train.observe.progress import Progress, Window, peak_memory_mb
from k3train.runtime.console import say
from k3train.runtime.distributed import any_across_ranks, mean_across_ranks
from k3train.runtime.parallel_dims import ParallelDims
from k3train.runtime.parallel_layout import owner_of
from k3train.runtime.signals import StopSignals
from k3train.train.callbacks import Callback
from k3train.train.eval_tasks import TaskEval
from k3train.train.evaluate import evaluate
from k3train.train.parallel import DDP, clip_gradients, global_grad_norm
from k3train.train.pipeline import Pipeline
from k3train.train.pipeline_state import PipelineModel, PipelineOptimizer, merge_stage_figures
from k3train.train.plan import TrainingPlan
from k3train.train.precision import Precision
from k3train.train.rng import RNGState
from k3train.train.source_losses import SourceLosses
from k3train.train.state import ConfiguredOptimizer, TrainState


class TrainingDiverged(RuntimeError):
    """Too many non-finite updates in a row."""


@runtime_checkable
class ReportsDiagnostics(Protocol):
    """An optimizer with figures for the train events (MuonAdamW: update RMS, orthogonality error)."""

    def diagnostics(self) -> dict: ...


class Trainer:
    def __init__(
        self,
        *,
        model: LanguageModel,
        optimizer: torch.optim.Optimizer,
        schedule_factory: Callable,
        precision: Precision,
        train_loader,
        val_loader,
        config: TrainConfig,
        device: torch.device,
        metrics: MetricsLogger,
        checkpointer: Checkpointer,
        callbacks: dict[str, Callback] | None = None,
        parallel: DDP | None = None,
        dims: ParallelDims | None = None,
        profile: ProfileConfig | None = None,
        pipeline: Pipeline | None = None,
        whole_optimizer: torch.optim.Optimizer | None = None,
        val_sources: dict | None = None,
        task_eval: TaskEval | None = None,
    ):
        self.model = model  # the unwrapped, uncompiled module: its state_dict keys stay stable
        self.parallel = parallel or DDP()
        self.dims = dims or ParallelDims(device_type=device.type)
        self.replicated = self.parallel.wrap(model, device, self.dims)  # the model itself in one process
        # Compile outside DDP, as torch recommends: its DDPOptimizer splits the graph at the gradient buckets.
        self.forward = torch.compile(self.replicated) if config.compile else self.replicated
        self.optimizer = optimizer
        for i, group in enumerate(optimizer.param_groups):  # the schedule scales initial_lr; names label the log
            group.setdefault("initial_lr", group["lr"])
            group.setdefault("name", str(i))
        self.precision = precision
        self.scaler = precision.make_scaler(device)
        self.train_loader, self.val_loader = train_loader, val_loader
        # A mixture's sources, each's val split read as val_loader is, logged as val/<source>/loss beside the mixture's
        self.val_sources = val_sources or {}
        # ... and its train loss per source (a loader that says each row's source: MixtureLoader.sources_of)
        self.source_losses = SourceLosses(train_loader.names) if hasattr(train_loader, "sources_of") else None
        self.task_eval = task_eval  # train.eval_tasks: lm-evaluation-harness tasks (k3train/train/eval_tasks.py)
        self.config, self.device, self.metrics = config, device, metrics
        self.checkpointer = checkpointer
        self.run_dir = checkpointer.run_dir
        self.callbacks = callbacks or {}
        self.profile = profile or ProfileConfig()
        self.state = TrainState()
        self.session_start_step = 0
        # False: step on a non-finite loss or norm too (a dry run, whose fake collectives leave values meaningless)
        self.skip_non_finite = True
        self.signals = StopSignals()  # the runner installs it around fit(); the loop only reads the flag
        self.label = model.log_label
        # Global: every rank's rows of the batch (the loaders' data-parallel view), so plans and logs are per run.
        self.tokens_per_update = train_loader.global_tokens_per_batch * config.gradient_accumulation_steps
        # parallel.pp > 1: this rank's stages of the model, run by the pipeline's schedule (k3train/train/pipeline.py)
        self.pipeline = pipeline
        held = pipeline.parameters() if pipeline is not None else model.parameters()
        self.params = [p for p in held if p.requires_grad]
        self.expert_shards = frozenset(id(p) for p in expert_shards(model))  # each rank's own: norms sum over ep
        self.mfu = MFU.for_model(
            model, config.seq_len, device, precision.dtype, config.peak_flops, devices=self.dims.world_size
        )
        self._fixed_batches: list | None = None  # overfit_batch mode
        self.plan = TrainingPlan(config, self.state, train_loader, self.tokens_per_update, schedule_factory)
        self.schedule = self.plan.schedule
        self._optimizer_part = ConfiguredOptimizer(optimizer)
        self._resumed_from: Path | None = None
        parts = {
            "model": model,
            "optimizer": self._optimizer_part,
            "scaler": self.scaler,
            "train_loader": train_loader,
            "val_loader": val_loader,
            "rng": RNGState(),
            "trainer": self.state,
            "plan": self.plan,
        }  # restored in this order: the plan re-derives from the counters and cursor
        if pipeline is not None:  # the whole model's checkpoint: gathered from the stages, or sharded by stage
            gather = not checkpointer.sharded
            stages = [expert_sharded_model(m, self.dims) for m in pipeline.modules]
            held = expert_sharded_optimizer(self._optimizer_part, optimizer, ModuleList(pipeline.modules), self.dims)
            parts["model"] = PipelineModel(model, pipeline.modules, self.dims.pp_group, gather, parts=stages)
            parts["optimizer"] = PipelineOptimizer(held, optimizer, whole_optimizer, model, self.dims.pp_group, gather)
        else:
            parts = with_expert_shards(parts, model, optimizer, self.dims)
        for name, part in parts.items():
            checkpointer.add(name, part)
        for callback in self.callbacks.values():
            callback.setup(model, optimizer, self.dims)

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
        batches = self._micro_batches()
        if self.pipeline is not None:
            return self._update(self._pipelined_loss(batches), lr_factor)
        for i, (x, y, document_ids) in enumerate(batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            documents = document_inputs(self.model, document_ids, self.device)  # {} without boundaries
            last = i == len(batches) - 1  # only its backward all-reduces the gradients across ranks
            with self.parallel.no_sync(self.replicated) if not last else contextlib.nullcontext():
                with self.precision.autocast(self.device), self._recording_sources([i]):
                    _, loss = self.forward(x, targets=y, **documents)
                self.scaler.scale(loss / accum).backward()
            losses.append(loss.detach().double())  # exact for fp32 and fp64 losses alike
        self.parallel.finish_gradients(self.model, self.dims)  # e.g. expert-parallel weights, which DDP leaves out
        # The global batch's loss, so every rank takes the same skip-or-step decision (a NaN anywhere is NaN here).
        loss = mean_across_ranks(torch.stack(losses).mean().item(), self.device, self.dims.dp_group)
        return self._update(loss, lr_factor)

    def _pipelined_loss(self, batches: list) -> float:
        """The update's micro-batches through the pipeline (one schedule step: every forward and backward), the
        stages' gradients averaged over their data-parallel ranks; the global batch's loss on every rank."""
        x = torch.cat([b[0] for b in batches]).to(self.device)
        y = torch.cat([b[1] for b in batches]).to(self.device)
        ids = [b[2] for b in batches]
        documents = None
        if any(d is not None for d in ids):  # a micro-batch without boundaries is one document a row
            documents = torch.cat([torch.zeros_like(b[0]) if d is None else d for b, d in zip(batches, ids)])
            documents = documents.to(self.device)
        with self.precision.autocast(self.device), self._recording_sources(range(len(batches))):
            loss = self.pipeline.step(x, y, documents)
        self.pipeline.reduce_gradients(self.dims.dp_group)
        for stage in self.pipeline.modules:  # e.g. expert-parallel weights, which the pipeline's average leaves out
            self.parallel.finish_gradients(stage, self.dims)
        loss = self._from_last_stage(loss)
        return mean_across_ranks(loss, self.device, self.dims.dp_group)

    @contextlib.contextmanager
    def _recording_sources(self, micro_batches):
        """A mixture's per-target losses of the forwards inside, summed by source (k3train/train/source_losses.py);
        micro_batches: the update's micro-batches (0..accum-1) whose rows those forwards take, in order."""
        if self.source_losses is None:
            yield
            return
        accum = self.config.gradient_accumulation_steps
        first = 0 if self.config.overfit_batch else self.train_loader.batches - accum  # loader's index of batch 0
        with recording_target_losses() as recorded:
            yield
        sources = torch.cat([self.train_loader.sources_of(first + i) for i in micro_batches])
        self.source_losses.add(recorded, sources)

    def _from_last_stage(self, loss: float | None) -> float:
        """A figure of the last stage's rank, on every rank of its pipeline."""
        t = torch.tensor([math.nan if loss is None else loss], dtype=torch.float64, device=self.device)
        src = owner_of(self.pipeline.settings.n_stages - 1, self.pipeline.settings)
        dist.broadcast(t, group=self.dims.pp_group, group_src=src)
        return t.item()

    def _update(self, loss: float, lr_factor: float) -> dict:
        """The optimizer step after an update's backward: the gradient norm over every rank, clipping, the step or
        its skip (a non-finite loss or norm)."""
        self.state.tokens += self.tokens_per_update
        self.scaler.unscale_(self.optimizer)
        grad_norm = global_grad_norm(self.params, self.dims, self.expert_shards)
        result = {"loss": loss, "grad_norm": grad_norm, "lr_factor": lr_factor}
        if not self.skip_non_finite or (math.isfinite(loss) and math.isfinite(grad_norm)):
            if self.config.clip_norm is not None:
                clip_gradients(self.params, self.config.clip_norm, grad_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.state.step += 1
            self.state.consecutive_skips = 0
            for callback in self.callbacks.values():
                callback.after_optimizer_step(self.state.step)
            result["skipped"] = False
        else:
            self.scaler.update()  # fp16: an overflow lowers the loss scale; otherwise a no-op
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
        if self._resumed_from is not None:
            self._log_resume()
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

    def _on_skip(self, result: dict) -> None:
        s = self.state
        self.metrics.log(
            "skip",
            step=s.step,
            tokens=s.tokens,
            loss=result["loss"],
            grad_norm=result["grad_norm"],
            skipped_updates=s.skipped_updates,
            consecutive=s.consecutive_skips,
            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None,
        )
        say(
            f"{self.label}step {s.step}: non-finite loss {result['loss']} or grad norm "
            f"{result['grad_norm']}; update skipped ({s.consecutive_skips} in a row)"
        )
        if s.consecutive_skips >= self.config.max_consecutive_skips:
            self.metrics.log("end", step=s.step, tokens=s.tokens, reason="diverged", skipped_updates=s.skipped_updates)
            fix = "lower optim.lr" + (" or train.grad_clip" if self.config.clip_norm else " or enable train.grad_clip")
            raise TrainingDiverged(
                f"{s.consecutive_skips} non-finite updates in a row at step {s.step}: the run "
                f"has diverged. {self.checkpointer.set_aside_diverged(s.step, fix)}"
            )

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
        if c.checkpoint_interval and s.step % c.checkpoint_interval == 0 and s.step < self.total_steps:
            self.save()

    def _diagnostics(self) -> dict:
        out = {"model": self.model.diagnostics()}
        if isinstance(self.optimizer, ReportsDiagnostics):
            out["optimizer"] = self.optimizer.diagnostics()
        for name, callback in self.callbacks.items():
            figures = callback.metrics()  # since the last train event
            if figures:
                out[name] = figures
        if self.pipeline is not None:  # each rank measured its own stages' layers: the log has every stage's
            parts = [None] * dist.get_world_size(self.dims.pp_group)
            dist.all_gather_object(parts, out, group=self.dims.pp_group)
            out = merge_stage_figures(parts, self.callbacks)
        return out

    def run_eval(self, progress: Progress | None = None) -> dict:
        loss_of = None
        if self.pipeline is not None:

            def loss_of(x, y, document_ids):
                return self._from_last_stage(self.pipeline.forward_loss(x, y, document_ids))

        def val_loss(loader) -> dict:
            args = (self.config.eval_batches, self.precision, self.device, self.dims.dp_group)
            return evaluate(self.model, loader, *args, loss_of=loss_of)

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
        if self.checkpointer.saved_step != self.state.step:  # an interval checkpoint may have just saved this step
            self.save()
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
    def save(self) -> None:
        """Checkpoint at an update boundary (gradients are already cleared)."""
        t0 = time.perf_counter()
        size = self.checkpointer.save(self.state.step)  # sharded: every rank writes its own, a collective
        self.metrics.log(
            "checkpoint",
            step=self.state.step,
            tokens=self.state.tokens,
            path=str(self.checkpointer.path),
            bytes=size,
            seconds=round(time.perf_counter() - t0, 3),
        )

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
