"""From a composed Hydra config to a finished run: build the parts, open the run directory, hand over to the Trainer.

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
import sys
import traceback
from pathlib import Path
from typing import Optional

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from k3train.config import RESUME_MAY_CHANGE_MODEL, RESUME_MUST_MATCH, TrainConfig, check_known_keys
from k3train.files import remove_stale_temp_files
from k3train.models.protocol import missing_members
from k3train.optim.summary import format_param_groups, summarize_param_groups
from k3train.train import rundir
from k3train.train.callbacks import Callback
from k3train.train.checkpoint import Checkpointer, CheckpointError
from k3train.train.cpu import ThreadChoice, apply_threads, choose_threads, cpu_runtime
from k3train.train.distributed import World, current_world
from k3train.train.manifest import RunManifest, environment
from k3train.train.metrics import MetricsLogger, MetricsSink
from k3train.train.rng import configure_determinism, seed_everything
from k3train.train.rundir import RunDirError
from k3train.train.trainer import Trainer, TrainingDiverged


# ImportError: an optional dependency a setting needs (model.kda_implementation=fla without flash-linear-attention).
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError, CheckpointError, RunDirError)


class RunFailed(Exception):
    """A job that could not run or diverged; raised (not exited) in a multirun so the sweep goes on."""


class RunFinished(Exception):
    """A resumed run that has nothing left to do."""


class NotOwner:
    """The claim of a rank other than 0: rank 0 holds the run directory's lock and undoes a refused start."""

    def undo(self) -> None:
        pass

    def release(self) -> None:
        pass


def resolve_device(name: str, world: World) -> torch.device:
    """train.device; with several processes per node, CUDA means this process's local GPU."""
    device = _parse_device(name)
    if device.type == "cuda" and world.distributed:
        if device.index is None:
            device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    return device


def _parse_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"train.device={name} is not a device: use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"train.device={name} but CUDA is not available here: use train.device=cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"train.device={name} but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


RUN_FILES = ("last.pt", "run.json", "metrics.jsonl")


def resolve_resume(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """null: a fresh run; auto: run_dir/last.pt if present, else fresh; otherwise a checkpoint path.

    A run never writes into a directory holding another run's files: a fresh run or a resume from elsewhere is
    refused there, so nobody's checkpoint, metrics or manifest is overwritten or mixed with another run's.
    """
    own = run_dir / "last.pt"
    if resume == "auto":
        return own if own.exists() else None
    path = Path(resume).expanduser() if resume is not None else None
    if path is not None and not path.is_file():
        raise CheckpointError(f"resume={resume}: no such checkpoint file")
    if path is not None and path.resolve().parent == run_dir.resolve():
        return path  # this run's own last.pt or an earlier step_*.pt of it: continuing the same run
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if existing:
        raise ValueError(f"{run_dir} already holds a run ({', '.join(existing)}): pass resume=auto to continue "
                         "that run, or choose another hydra.run.dir")
    return path


class RunDirGuard(HydraCallback):
    """Claims a single run's directory (creates it, locks it, notes its .hydra/) before Hydra writes .hydra/ into
    it, and refuses a second writer or a run that would write into another run's files. Multirun jobs are
    claimed and checked in run(), after Hydra has written their (new) job directory."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # run.dir may use ${hydra:...}; run_job sets the same config
        if not current_world().is_main:
            return  # rank 0 owns the directory; the other ranks write nothing to it
        run_dir = Path(config.hydra.run.dir)
        claim = None
        try:
            claim = rundir.claim(run_dir)
            resolve_resume(config.resume, run_dir)
        except USER_ERRORS as exc:
            if claim is not None:
                claim.undo()
            _fail(_describe(exc), 2, multirun=False)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        world = current_world()
        if world.distributed:
            _fail(f"a multirun (-m) started as {world.size} processes would run every job in each of them: start "
                  "the sweep as one process (its jobs may each use several processes through the submitit launcher)",
                  2, multirun=False)


def build_meta(model, optimizer, train_cfg: TrainConfig, precision, data, world: World) -> dict:
    """The identities a checkpoint pins and a resume must match."""
    layout = {
        g.get("name", str(i)): f"{len(g['params'])} tensors, {sum(p.numel() for p in g['params'])} values"
        for i, g in enumerate(optimizer.param_groups)
    }
    identity = data.identity()
    return {
        "model_config": {k: v for k, v in dataclasses.asdict(model.config).items()
                         if k not in RESUME_MAY_CHANGE_MODEL},
        # The global batch, not the per-process one: a resume may split it over another number of processes.
        "recipe": {**{f: getattr(train_cfg, f) for f in RESUME_MUST_MATCH},
                   "global_batch_size": train_cfg.batch_size * world.size, "precision": precision.dtype,
                   "optimizer": type(optimizer).__name__},
        "optimizer_layout": layout,
        "data": {"fingerprint": identity["fingerprint"], "val_fingerprint": identity.get("val_fingerprint"),
                 "vocab_size": data.vocab_size},
    }


def run(cfg: DictConfig) -> Optional[str]:
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        claim = (rundir.claimed(run_dir) or rundir.claim(run_dir)) if current_world().is_main else NotOwner()
    except USER_ERRORS as exc:
        return _fail(_describe(exc), 2, multirun)
    try:
        return _run(cfg, run_dir, claim, multirun)
    finally:
        claim.release()


def _run(cfg: DictConfig, run_dir: Path, claim: rundir.RunDirClaim, multirun: bool) -> Optional[str]:
    try:
        parts = _build(cfg, run_dir)
    except BaseException as exc:
        claim.undo()  # nothing of this start stays: .hydra/ back as it was, a new directory removed
        if isinstance(exc, RunFinished):
            # A writer killed after the final checkpoint (writing run.json, say) may have left a temporary file;
            # the lock is ours, so it is dead: its temporary file is no user's data.
            if current_world().is_main:
                remove_stale_temp_files(run_dir)
            print(f"k3train: {exc}", flush=True)
            return "finished"
        cause = exc.__cause__ if isinstance(exc, InstantiationException) else exc
        if not isinstance(cause, (*USER_ERRORS, MissingMandatoryValue)) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        return _fail(_describe(cause), 2, multirun)
    removed = remove_stale_temp_files(run_dir) if current_world().is_main else []  # the lock is ours: their
    # writers are dead
    if removed:
        print(f"removed {len(removed)} temporary file(s) left by an interrupted writer: "
              + ", ".join(p.name for p in removed), flush=True)
    trainer = parts["trainer"]
    try:
        manifest, metrics = _open_session(cfg, run_dir, **parts)
    except OSError as exc:
        return _fail(_write_failed(exc, trainer), 1, multirun)
    failure = None
    with trainer.signals:  # SIGTERM/SIGUSR1 now stop at an update boundary instead of killing the process
        try:
            reason = trainer.fit()
        except TrainingDiverged as exc:
            reason, failure = "diverged", str(exc)
        except OSError as exc:  # a full disk, a read-only directory: say what was kept, no traceback
            reason, failure = f"error: {exc}", _write_failed(exc, trainer)
        except BaseException as exc:
            _close(trainer, metrics, manifest, f"error: {type(exc).__name__}: {exc}")
            if trainer.signals.received is not None:  # a preemption must still reach the scheduler's handler
                traceback.print_exc()
                trainer.signals.redeliver()
            raise
        close_error = _close(trainer, metrics, manifest, reason)
        if failure is None and close_error is not None:
            failure = _write_failed(close_error, trainer)
    if trainer.signals.received is not None:  # checkpointed: now let the signal do what it would have done
        print(f"k3train: stopped by {trainer.signals.received.name} at step {trainer.state.step}; continue in the "
              "same output directory with resume=auto", file=sys.stderr, flush=True)
        trainer.signals.redeliver()
    if failure is not None:
        return _fail(failure, 1, multirun)
    return reason


def _close(trainer: Trainer, metrics: MetricsLogger, manifest: Optional[RunManifest],
           reason: str) -> Optional[OSError]:
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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, MissingMandatoryValue):
        return f"{exc.full_key} is not set: add {exc.full_key}=... to the command"
    if isinstance(exc, RunDirError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _write_failed(exc: OSError, trainer: Trainer) -> str:
    path = exc.filename or trainer.run_dir
    saved = trainer.checkpointer.saved_step
    if saved is not None:
        kept = f"last.pt of step {saved} is kept"
    elif trainer.checkpointer.path.exists():
        kept = "last.pt is kept as it was"
    else:
        kept = "no checkpoint was written yet"
    if exc.errno == errno.ENOSPC:
        fix = "free disk space"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = f"make {trainer.run_dir} writable"
    else:
        fix = "fix the cause"
    return (f"writing {path} failed at step {trainer.state.step} ({exc.strerror or exc}); {kept}; {fix}, then "
            "continue with resume=auto")


def _fail(message: str, status: int, multirun: bool) -> None:
    print(f"k3train: error: {message}", file=sys.stderr, flush=True)
    if multirun:
        raise RunFailed(message)
    sys.exit(status)


def _build(cfg: DictConfig, run_dir: Path) -> dict:
    """Every check and every part, writing nothing: a refusal here leaves no trace."""
    check_known_keys(cfg)
    train_cfg: TrainConfig = OmegaConf.to_object(cfg.train)
    profile_cfg = OmegaConf.to_object(cfg.profile)
    world = current_world()
    device = resolve_device(train_cfg.device, world)
    precision = instantiate(cfg.precision)
    precision.check_device(device)
    resume_path = resolve_resume(cfg.resume, run_dir)
    hydra_cfg = HydraConfig.get()
    threads = choose_threads(train_cfg.cpu_threads, hydra_cfg.launcher if hydra_cfg.mode == RunMode.MULTIRUN
                             else None)
    apply_threads(threads)

    configure_determinism(train_cfg.deterministic)
    seed_everything(train_cfg.seed)
    data = instantiate(cfg.data)
    # vocab_size: null in a model YAML means "the data's"; a value the user set is kept, and check_data refuses a
    # mismatch.
    model = instantiate(cfg.model, **({"vocab_size": data.vocab_size} if cfg.model.get("vocab_size") is None else {}))
    missing = missing_members(model)
    if missing:
        raise TypeError(f"model {cfg.model._target_} built a {type(model).__name__}, which lacks {', '.join(missing)}: "
                        "a model implements k3train/models/protocol.py's LanguageModel")
    model.check_data(data.vocab_size, train_cfg.seq_len)
    train_loader, val_loader = data.loaders(train_cfg.batch_size, train_cfg.seq_len, rank=world.rank,
                                            world_size=world.size)
    model.to(device)
    optimizer = instantiate(cfg.optim)(model)
    callbacks = _build_named(cfg.callbacks, Callback, "callbacks")
    sinks = _build_named(cfg.logger, MetricsSink, "logger", run_dir=str(run_dir))

    # The log file is opened at its first event, after all checks.
    metrics = MetricsLogger(run_dir / "metrics.jsonl", sinks=list(sinks.values()), enabled=world.is_main)
    checkpointer = Checkpointer(run_dir, build_meta(model, optimizer, train_cfg, precision, data, world),
                                train_cfg.keep_last_k, writer=world.is_main)
    trainer = Trainer(model=model, optimizer=optimizer, schedule_factory=instantiate(cfg.schedule),
                      precision=precision, train_loader=train_loader, val_loader=val_loader, config=train_cfg,
                      device=device, metrics=metrics, checkpointer=checkpointer, callbacks=callbacks,
                      parallel=instantiate(cfg.parallel), profile=profile_cfg)
    if resume_path is not None:
        trainer.resume(resume_path)
        done = trainer.plan.done()
        if done is not None:
            raise RunFinished(_finished_message(resume_path, done, trainer))
    return {"trainer": trainer, "metrics": metrics, "data": data, "resume_path": resume_path, "threads": threads}


def _build_named(nodes: DictConfig, kind: type, group: str, **kwargs) -> dict:
    """Instantiate each `name: {_target_: ...}` entry of a config group that lists several (callbacks, logger)
    and check it is a `kind`."""
    built = {}
    for name, node in nodes.items():
        part = instantiate(node, **kwargs)
        if not isinstance(part, kind):
            raise TypeError(f"{group}.{name}: {node.get('_target_')} built a {type(part).__name__}, which is not a "
                            f"{kind.__name__} ({kind.__module__})")
        built[name] = part
    return built


def _finished_message(resume_path: Path, reason: str, trainer: Trainer) -> str:
    step = trainer.state.step
    if reason == "end_of_data":
        return f"{resume_path} is a finished run (its train split is used up at step {step}); nothing to do"
    limit = f"train.{reason}"
    return (f"{resume_path} is a finished run (it reached {limit}={getattr(trainer.config, reason)} at step {step}); "
            f"nothing to do. To train on, raise {limit} and resume=auto")


def _open_session(cfg: DictConfig, run_dir: Path, *, trainer: Trainer, metrics: MetricsLogger, data,
                  resume_path: Optional[Path], threads: ThreadChoice) -> tuple[Optional[RunManifest], MetricsLogger]:
    if not current_world().is_main:
        return None, metrics  # rank 0 writes run.json and shows the summary
    model, optimizer = trainer.model, trainer.optimizer
    manifest = RunManifest(run_dir)
    manifest.start_session(
        config=OmegaConf.to_container(cfg, resolve=True), overrides=list(HydraConfig.get().overrides.task),
        model={"class": type(model).__name__, "config": dataclasses.asdict(model.config),
               "params": model.param_counts()},
        data=data.identity(), optimizer=summarize_param_groups(optimizer.param_groups),
        env={**environment(trainer.device), "cpu": cpu_runtime(threads)},
        resume_from=str(resume_path) if resume_path else None,
        resume_step=trainer.state.step if resume_path else None)
    metrics.log("session", session=manifest.session["session"], step=trainer.state.step,
                run_dir=str(run_dir), resume_from=manifest.session["resume_from"])
    _print_summary(run_dir, trainer, threads)
    return manifest, metrics


def _print_summary(run_dir: Path, trainer: Trainer, threads: ThreadChoice) -> None:
    model, optimizer, schedule = trainer.model, trainer.optimizer, trainer.schedule
    counts = model.param_counts()
    lines = [
        f"{trainer.label}run directory: {run_dir}",
        f"  model: {type(model).__name__}  params total {counts['total']:,}, active {counts['active']:,}, "
        f"embedding {counts['embedding']:,}",
        f"  optimizer: {type(optimizer).__name__}",
    ]
    if trainer.device.type == "cpu":
        lines.insert(2, f"  cpu: {threads.describe()}")
    lines += ["    " + row for row in format_param_groups(optimizer.param_groups).splitlines()]
    lines.append(f"  parallel: {trainer.parallel.describe()}")
    lines.append(f"  schedule: {schedule.describe()}")
    lines += [f"  {callback.describe()}" for callback in trainer.callbacks.values()]
    lines.append(f"  token plan: {trainer.tokens_per_update:,} tokens per nominal update x {trainer.total_steps} "
                 f"= {trainer.tokens_per_update * trainer.total_steps:,} tokens (a plan, not a measurement)")
    print("\n".join(lines), flush=True)
