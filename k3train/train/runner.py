"""From a composed Hydra config to a finished run: build the parts, open the run directory, hand over to the Trainer.

Setup errors (a bad config value, missing data, an incompatible checkpoint) stop here with a one-line message and
exit status 2, before anything in the run directory is touched.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from k3train.config import RESUME_MUST_MATCH, TrainConfig
from k3train.optim.param_groups import format_partition
from k3train.train.checkpoint import FORMAT_VERSION, CheckpointError, load_checkpoint
from k3train.train.manifest import RunManifest, environment
from k3train.train.metrics import MetricsWriter
from k3train.train.rng import configure_determinism, seed_everything
from k3train.train.trainer import Trainer, TrainingDiverged


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name} but CUDA is not available here: use train.device=cpu or auto")
    return device


def resolve_resume(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """null: fresh run (refused if run_dir already holds one); auto: run_dir/last.pt if present; else a path."""
    own = run_dir / "last.pt"
    if resume is None:
        if own.exists():
            raise ValueError(f"{run_dir} already holds a checkpoint: pass resume=auto to continue that run, "
                             "or choose another hydra.run.dir")
        return None
    if resume == "auto":
        return own if own.exists() else None
    path = Path(resume).expanduser()
    if not path.is_file():
        raise CheckpointError(f"resume={resume}: no such checkpoint file")
    return path


def build_meta(model, optimizer, train_cfg: TrainConfig, precision, data) -> dict:
    """The identities a checkpoint pins and a resume must match."""
    layout = {
        g.get("name", str(i)): f"{len(g['params'])} tensors, {sum(p.numel() for p in g['params'])} values"
        for i, g in enumerate(optimizer.param_groups)
    }
    identity = data.identity()
    return {
        "format_version": FORMAT_VERSION,
        "model_config": dataclasses.asdict(model.config),
        "recipe": {**{f: getattr(train_cfg, f) for f in RESUME_MUST_MATCH}, "precision": precision.dtype,
                   "optimizer": type(optimizer).__name__},
        "optimizer_layout": layout,
        "data": {"fingerprint": identity["fingerprint"], "val_fingerprint": identity.get("val_fingerprint"),
                 "vocab_size": data.vocab_size},
    }


def run(cfg: DictConfig) -> str:
    try:
        trainer, manifest, metrics, resume_path = _setup(cfg)
    except (ValueError, FileNotFoundError, CheckpointError, InstantiationException) as exc:
        print(f"k3train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        reason = trainer.fit()
    except TrainingDiverged as exc:
        metrics.log("end", step=trainer.state.step, tokens=trainer.state.tokens, reason="diverged")
        manifest.end_session("diverged", trainer.state.step, trainer.state.tokens)
        print(f"k3train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except BaseException as exc:
        manifest.end_session(f"error: {type(exc).__name__}: {exc}", trainer.state.step, trainer.state.tokens)
        raise
    finally:
        metrics.close()
    manifest.end_session(reason, trainer.state.step, trainer.state.tokens)
    return reason


def _setup(cfg: DictConfig):
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    train_cfg: TrainConfig = OmegaConf.to_object(cfg.train)
    profile_cfg = OmegaConf.to_object(cfg.profile)
    device = resolve_device(train_cfg.device)
    precision = instantiate(cfg.precision)
    precision.check_device(device)
    resume_path = resolve_resume(cfg.resume, run_dir)

    configure_determinism(train_cfg.deterministic)
    seed_everything(train_cfg.seed)
    data = instantiate(cfg.data)
    if cfg.model.get("vocab_size") is None:
        cfg.model.vocab_size = data.vocab_size
    model = instantiate(cfg.model)
    model.check_data(data.vocab_size, train_cfg.seq_len)
    train_loader, val_loader = data.loaders(train_cfg.batch_size, train_cfg.seq_len)
    model.to(device)
    optimizer = instantiate(cfg.optim)(model)
    meta = build_meta(model, optimizer, train_cfg, precision, data)

    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    trainer = Trainer(model=model, optimizer=optimizer, schedule_factory=instantiate(cfg.schedule),
                      precision=precision, train_loader=train_loader, val_loader=val_loader, config=train_cfg,
                      device=device, metrics=metrics, run_dir=run_dir, meta=meta, profile=profile_cfg)
    resume_step = None
    if resume_path is not None:
        trainer.restore(load_checkpoint(resume_path), resume_path)
        resume_step = trainer.state.step
    manifest = RunManifest(run_dir)
    manifest.start_session(
        config=OmegaConf.to_container(cfg, resolve=True), overrides=list(hydra_cfg.overrides.task),
        model={"class": type(model).__name__, "config": meta["model_config"], "params": model.param_counts()},
        data=data.identity(), optimizer=_optimizer_summary(optimizer), env=environment(device),
        resume_from=str(resume_path) if resume_path else None, resume_step=resume_step)
    metrics.log("session", session=manifest.session["session"], step=trainer.state.step,
                run_dir=str(run_dir), resume_from=manifest.session["resume_from"])
    _print_summary(run_dir, trainer, model, optimizer, cfg)
    return trainer, manifest, metrics, resume_path


# The settings a reader needs to compare runs; torch's implementation flags (foreach, capturable...) are left out.
_SUMMARY_SETTINGS = ("kind", "initial_lr", "weight_decay", "betas", "eps", "momentum", "nesterov", "ns_steps",
                     "rms_match")


def _optimizer_summary(optimizer) -> list[dict]:
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        settings = {k: g[k] for k in _SUMMARY_SETTINGS if k in g}
        groups.append({"name": g.get("name", str(i)), "tensors": len(g["params"]),
                       "values": sum(p.numel() for p in g["params"]), **settings})
    return groups


def _print_summary(run_dir: Path, trainer: Trainer, model, optimizer, cfg: DictConfig) -> None:
    counts = model.param_counts()
    lines = [
        f"{trainer.label}run directory: {run_dir}",
        f"  model: {type(model).__name__}  params total {counts['total']:,}, active {counts['active']:,}, "
        f"embedding {counts['embedding']:,}",
        f"  optimizer: {type(optimizer).__name__}",
    ]
    lines += ["    " + row for row in format_partition(optimizer.param_groups).splitlines()]
    lines.append(f"  schedule: {cfg.schedule.decay}, warmup {cfg.schedule.warmup_steps}, "
                 f"{trainer.total_steps} updates; QK-Clip tau: {trainer.qk_clip_tau}")
    lines.append(f"  token plan: {trainer.tokens_per_update:,} tokens per nominal update x {trainer.total_steps} "
                 f"= {trainer.tokens_per_update * trainer.total_steps:,} tokens (a plan, not a measurement)")
    print("\n".join(lines), flush=True)
