"""From a composed Hydra config to a finished run: claim the run directory, build the parts (build.py), open the
session (run.json, the summary), hand over to the Trainer, and report how it ended.

Setup errors (a bad config value, missing data, an incompatible checkpoint) stop here with a one-line message and
exit status 2, and leave the run directory as they found it (.hydra/ included; a directory that did not exist is
removed again: see rundir.py). A run that has already ended says so and exits 0, touching nothing. A write that
fails during training (a full disk, a read-only directory) ends with one line saying what was kept. In a multirun
the failure is raised instead, so Hydra records it for that job and goes on with the others (a diverged lr must
not end the sweep).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import sys
import traceback
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from k3train.checkpoint.checkpointer import SHARDED_STORE, CheckpointError
from k3train.checkpoint.dcp import remove_stale_temp_links
from k3train.config import TrainConfig, check_known_keys
from k3train.config_targets import check_target_settings
from k3train.files import remove_stale_temp_directories, remove_stale_temp_files
from k3train.models.protocol import takes_document_ids
from k3train.observe.metrics import MetricsLogger
from k3train.observe.run_manifest import RunManifest, environment, read_run_json
from k3train.optim.summary import format_param_groups, summarize_param_groups
from k3train.run import dry_run, rundir
from k3train.run.build import build_parts, set_up_process
from k3train.run.remembered import config_changes
from k3train.run.resume import RunFinished, resolve_resume, restore
from k3train.run.rundir import RunDirError
from k3train.runtime import distributed, slurm
from k3train.runtime.console import notice
from k3train.runtime.cpu import ThreadChoice, cpu_runtime, denormal_setting, malloc_setting
from k3train.runtime.distributed import current_world, rank_zero_decides
from k3train.runtime.signals import Interrupted
from k3train.train.trainer import Trainer, TrainingDiverged

# ImportError: an optional dependency a setting needs (model.kda_implementation=fla without flash-linear-attention).
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError, CheckpointError, RunDirError)


class RunFailed(Exception):
    """A job that could not run or diverged; raised (not exited) in a multirun so the sweep goes on."""


class NotOwner:
    """The claim of a rank other than 0: rank 0 holds the run directory's lock and undoes a refused start."""

    def undo(self) -> None:
        pass

    def release(self) -> None:
        pass


def run(cfg: DictConfig) -> str | None:
    if cfg.dry_run.world_size is not None:  # one rank of a larger run, on a fake process group
        return _dry_run(cfg)
    # A submitit job's tasks run this function directly (not __main__.main): start their process group here.
    own_group = not distributed.several_ranks() and distributed.init_from_env().distributed
    os.environ["K3TRAIN_CACHE"] = str(cfg.paths.cache)  # one cache root for the data, the MFU peaks and children
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    clean = False
    try:
        try:
            claim = (rundir.claimed(run_dir) or rundir.claim(run_dir)) if current_world().is_main else NotOwner()
        except USER_ERRORS as exc:
            return fail(describe_error(exc), 2, multirun)
        try:
            result = _run(cfg, run_dir, claim, multirun)
            clean = True
            return result
        finally:
            claim.release()
    finally:
        if own_group:
            distributed.close(wait_for_others=clean)


def _dry_run(cfg: DictConfig) -> str | None:
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        return dry_run.run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except BaseException as exc:
        cause = exc.__cause__ if isinstance(exc, InstantiationException) else exc
        if not isinstance(cause, (*USER_ERRORS, MissingMandatoryValue)) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        return fail(describe_error(cause), 2, multirun)


def _run(cfg: DictConfig, run_dir: Path, claim: rundir.RunDirClaim, multirun: bool) -> str | None:
    job = slurm.current_job()
    if slurm.resume_setting(cfg.resume) != cfg.resume:
        print(f"k3train: job {job.name} was requeued (restart {job.restart_count}): resume=auto", flush=True)
        cfg.resume = "auto"
    try:
        parts = _build_and_restore(cfg, run_dir)
    except BaseException as exc:
        claim.undo()  # nothing of this start stays: .hydra/ back as it was, a new directory removed
        if isinstance(exc, RunFinished):
            # A writer killed after the final checkpoint (writing run.json, say) may have left a temporary file;
            # the lock is ours, so it is dead: its temporary file is no user's data.
            if current_world().is_main:
                _remove_stale_temp_files(run_dir)
            print(f"k3train: {exc}", flush=True)
            return "finished"
        cause = exc.__cause__ if isinstance(exc, InstantiationException) else exc
        if not isinstance(cause, (*USER_ERRORS, MissingMandatoryValue)) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        return fail(describe_error(cause), 2, multirun)
    removed = _remove_stale_temp_files(run_dir) if current_world().is_main else []  # the lock is ours: their
    # writers are dead
    if removed:
        print(
            f"removed {len(removed)} temporary file(s) left by an interrupted writer: "
            + ", ".join(p.name for p in removed),
            flush=True,
        )
    with slurm.job_log(run_dir if job and current_world().is_main else None):
        return _train(cfg, run_dir, parts, multirun)


def _remove_stale_temp_files(run_dir: Path) -> list[Path]:
    """The temporary files, and sharded checkpoints' temporary links and directories, that dead writers left in
    run_dir, deleted."""
    stale = remove_stale_temp_files(run_dir) + remove_stale_temp_links(run_dir)
    return stale + remove_stale_temp_directories(run_dir / SHARDED_STORE)  # asynchronous sharded saves' half-written


def _build_and_restore(cfg: DictConfig, run_dir: Path) -> dict:
    """Check the settings, resolve the resume, set the process up, build every part and restore the checkpoint:
    all before anything is written (a refusal anywhere leaves no trace)."""
    check_known_keys(cfg)
    check_target_settings(cfg)
    train_cfg: TrainConfig = OmegaConf.to_object(cfg.train)  # its checks, before any work
    world = current_world()
    resume_path = rank_zero_decides(lambda: resolve_resume(cfg.resume, run_dir))  # one answer, before anyone writes
    hydra_cfg = HydraConfig.get()
    launcher = hydra_cfg.launcher if hydra_cfg.mode == RunMode.MULTIRUN else None
    device, threads = set_up_process(train_cfg, world, launcher)
    parts = build_parts(cfg, run_dir, device, world, threads, resuming=resume_path is not None)
    if resume_path is not None:
        restore(parts["trainer"], resume_path)
    return {**parts, "resume_path": resume_path, "threads": threads}


def _train(cfg: DictConfig, run_dir: Path, parts: dict, multirun: bool) -> str | None:
    trainer = parts["trainer"]
    failure = None
    # From here SIGTERM/SIGUSR1/SIGUSR2/SIGINT stop the run at an update boundary instead of killing it: run.json's
    # session, once opened, always gets its end.
    with trainer.signals:
        try:
            manifest, metrics = _open_session(cfg, run_dir, **parts)
        except OSError as exc:
            return fail(_write_failed(exc, trainer), 1, multirun)
        try:
            reason = trainer.fit()
        except TrainingDiverged as exc:
            reason, failure = "diverged", str(exc)
        except OSError as exc:  # a full disk, a read-only directory: say what was kept, no traceback
            _settle_save_in_flight(trainer)
            reason, failure = f"error: {exc}", _write_failed(exc, trainer)
        except Interrupted:  # a second Ctrl-C: out now, in one line
            _close(trainer, metrics, manifest, "interrupted")
            print(f"k3train: interrupted at step {trainer.state.step}; {_kept(trainer)}", file=sys.stderr, flush=True)
            trainer.signals.redeliver(signal.SIGINT)
            raise
        except BaseException as exc:
            _close(trainer, metrics, manifest, f"error: {type(exc).__name__}: {exc}")
            if trainer.signals.received is not None:  # a preemption must still reach the scheduler's handler
                _report_before_redelivery(exc)
                trainer.signals.redeliver()
            raise
        close_error = _close(trainer, metrics, manifest, reason)
        if failure is None and close_error is not None:
            failure = _write_failed(close_error, trainer)
    if trainer.signals.received is not None:  # checkpointed: requeue, or let the signal do what it would have done
        stopped_by = "Ctrl-C" if trainer.signals.received == signal.SIGINT else trainer.signals.received.name
        print(
            f"k3train: stopped by {stopped_by} at step {trainer.state.step} with a checkpoint; continue with "
            f"resume=auto in {run_dir} (or resume={run_dir} from anywhere)",
            file=sys.stderr,
            flush=True,
        )
        slurm.end_after_signal(trainer.signals)
    slurm.ignore_late_warnings()
    if failure is not None:
        return fail(failure, 1, multirun)
    return reason


def _settle_save_in_flight(trainer: Trainer) -> None:
    """A write that failed while an asynchronous save was in flight (a full disk, met by the metrics log first):
    that save is put in place if its own write completed, or its temporary file or directory removed if it failed
    too, so the run ends with what the message names (_kept) and nothing half-written. No collective: each rank
    waits for its own writer."""
    try:
        trainer.checkpointer.wait()
    except Exception:  # noqa: BLE001 - it failed too (the same full disk): its temporary files are removed
        pass


def _report_before_redelivery(exc: BaseException) -> None:
    """Say what ended a run that a signal is about to end (Hydra never gets to print it). A rank that lost its peer
    after the launcher's SIGTERM (torchrun sends it to the survivors of a rank that died) says so in its one line;
    anything else is unforeseen and gets its traceback."""
    line = distributed.failure_line(exc, current_world())
    if line is not None and distributed.lost_peer(exc) and os.environ.get("HYDRA_FULL_ERROR") != "1":
        print(line, file=sys.stderr, flush=True)
    else:
        traceback.print_exc()


def _close(trainer: Trainer, metrics: MetricsLogger, manifest: RunManifest | None, reason: str) -> OSError | None:
    """End the session's log and manifest entry; a write that fails is returned (the run is already over)."""
    error = None
    closes = [metrics.close]
    if manifest is not None:
        closes.append(lambda: manifest.end_session(reason, trainer.state.step, trainer.state.tokens))
    for close in closes:
        try:
            close()
        except OSError as exc:
            error = error or exc
    return error


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, MissingMandatoryValue):
        return f"{exc.full_key} is not set: add {exc.full_key}=... to the command"
    return str(exc)  # k3train's messages say what was wrong and what to do; a class name adds nothing to them


def _kept(trainer: Trainer) -> str:
    """Which checkpoint a run that ends now leaves, in words."""
    name = trainer.checkpointer.path.name
    saved = trainer.checkpointer.saved_step
    if saved is not None:
        return f"{name} of step {saved} is kept"
    if trainer.checkpointer.path.exists():
        return f"{name} is kept as it was"
    return "no checkpoint was written yet"


def _write_failed(exc: OSError, trainer: Trainer) -> str:
    path = exc.filename or trainer.run_dir
    kept = _kept(trainer)
    if exc.errno == errno.ENOSPC:
        fix = "free disk space"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = f"make {trainer.run_dir} writable"
    else:
        fix = "fix the cause"
    return (
        f"writing {path} failed at step {trainer.state.step} ({exc.strerror or exc}); {kept}; {fix}, then "
        "continue with resume=auto"
    )


def fail(message: str, status: int, multirun: bool) -> None:
    notice(f"error: {message}")  # every rank of a launch refuses a bad setting alike: once where they share stderr
    if multirun:
        raise RunFailed(message)
    sys.exit(status)


def _open_session(
    cfg: DictConfig,
    run_dir: Path,
    *,
    trainer: Trainer,
    metrics: MetricsLogger,
    data,
    resume_path: Path | None,
    threads: ThreadChoice,
) -> tuple[RunManifest | None, MetricsLogger]:
    if not current_world().is_main:
        return None, metrics  # rank 0 writes run.json and shows the summary
    model, optimizer = trainer.model, trainer.optimizer
    config = OmegaConf.to_container(cfg, resolve=True)
    changes = _changed_since_last_session(run_dir, config) if resume_path else []
    manifest = RunManifest(run_dir)
    manifest.start_session(
        config=config,
        overrides=list(HydraConfig.get().overrides.task),
        model={
            "class": type(model).__name__,
            "config": dataclasses.asdict(model.config),
            "params": model.param_counts(),
        },
        data=data.identity(),
        optimizer=summarize_param_groups(optimizer.param_groups),
        env={**environment(trainer.device), "cpu": cpu_runtime(threads)},
        resume_from=str(resume_path) if resume_path else None,
        resume_step=trainer.state.step if resume_path else None,
        slurm=job.describe() if (job := slurm.current_job()) else None,
        flops=trainer.mfu.as_dict(),
        world_size=current_world().size,
    )
    metrics.log(
        "session",
        session=manifest.session["session"],
        step=trainer.state.step,
        run_dir=str(run_dir),
        resume_from=manifest.session["resume_from"],
    )
    _print_summary(run_dir, trainer, threads, changes)
    return manifest, metrics


def _changed_since_last_session(run_dir: Path, config: dict) -> list[str]:
    """What this session's composed config changes of the last one's (run.json's top level), `resume` aside."""
    last = read_run_json(run_dir).get("config")
    if not isinstance(last, dict):
        return []
    before = {key: value for key, value in last.items() if key != "resume"}
    return config_changes(before, {key: value for key, value in config.items() if key != "resume"})


def _print_summary(run_dir: Path, trainer: Trainer, threads: ThreadChoice, changes: list[str]) -> None:
    model, optimizer, schedule = trainer.model, trainer.optimizer, trainer.schedule
    counts = model.param_counts()
    lines = [
        f"{trainer.label}run directory: {run_dir}",
        f"  model: {type(model).__name__}  params total {counts['total']:,}, active {counts['active']:,}, "
        f"embedding {counts['embedding']:,}",
        f"  optimizer: {type(optimizer).__name__}",
    ]
    if changes:
        lines.insert(1, "  changed since the last session: " + "; ".join(changes))
    if trainer.device.type == "cpu":
        lines.insert(2, f"  cpu: {threads.describe()}; malloc: {malloc_setting()}; denormals: {denormal_setting()}")
    lines += ["    " + row for row in format_param_groups(optimizer.param_groups).splitlines()]
    lines.append(f"  parallel: {trainer.dims.describe()}")
    lines.append(f"  documents: {_describe_documents(trainer)}")
    lines.append(f"  schedule: {schedule.describe()}")
    lines += [f"  {callback.describe()}" for callback in trainer.callbacks.values()]
    lines.append(f"  {trainer.guard.describe()}")
    lines.append(f"  {trainer.mfu.describe()}")
    lines.append(
        f"  token plan: {trainer.tokens_per_update:,} tokens per nominal update x {trainer.total_steps} "
        f"= {trainer.tokens_per_update * trainer.total_steps:,} tokens (a plan, not a measurement)"
    )
    if (note := trainer.plan.data_note()) is not None:
        lines.append(f"  data: {note}")
    print("\n".join(lines), flush=True)


def _describe_documents(trainer: Trainer) -> str:
    """The summary's word on document masking: whether the documents packed in a row are kept apart."""
    eod_id = getattr(trainer.train_loader, "eod_id", None)
    if eod_id is None:
        return "not masked (data.document_masking=false): each row is one sequence"
    if not takes_document_ids(trainer.model):
        return (
            f"not masked: {type(trainer.model).__name__}.forward takes no document_ids, so each row is one sequence "
            "(data.document_masking has no effect on it)"
        )
    return f"masked: each document (ended by token {eod_id}) attends only within itself"
