"""Everything a run is made of, built from the composed config and checked before anything is written.

`set_up_process` sets what is process-wide (device, threads, CPU memory and denormals, determinism, the seed);
`build_parts` then opens the data and builds the model, optimizer, schedule, callbacks, metrics sinks, Checkpointer
and Trainer from the composed config alone (callable without Hydra: tests and notebooks call it). Neither writes
anything, so a refusal here (a bad value, missing data) leaves no trace; the runner reports it. Resolving and
restoring a checkpoint is run/resume.py's.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from k3train.checkpoint.checkpointer import Checkpointer, GatheredCheckpointer, ShardedCheckpointer
from k3train.config import RESUME_MAY_CHANGE_MODEL, RESUME_MUST_MATCH, TrainConfig
from k3train.data.context_slices import ContextSlices
from k3train.inference.slices import weights_by_slice
from k3train.models.common.context_parallel import ContextParallel, set_context_parallel
from k3train.models.common.init import InitialWeights, WholeModel, materialise
from k3train.models.layout import WHOLE, parameter_layouts
from k3train.models.protocol import Pipelines, missing_members
from k3train.observe.metrics import MetricsLogger, MetricsSink
from k3train.runtime.cpu import ThreadChoice, apply_threads, choose_threads, prepare_cpu_training
from k3train.runtime.devices import device_for_rank
from k3train.runtime.distributed import World
from k3train.runtime.parallel_dims import ParallelDims
from k3train.train.callbacks import Callback
from k3train.train.cpu_threads import CpuThreads
from k3train.train.eval_tasks import TaskEval
from k3train.train.parallel import strategy_missing
from k3train.train.pipeline import Pipeline
from k3train.train.rng import configure_determinism, seed_everything
from k3train.train.step import DataParallelStep, PipelineStep, UpdateStep
from k3train.train.trainer import Loaders, Trainer


def build_meta(
    model, optimizer, train_cfg: TrainConfig, precision, data, world: World, dims: ParallelDims | None = None
) -> dict:
    """The identities a checkpoint pins and a resume must match."""
    data_parallel = world.size if dims is None else dims.dp_size  # ranks reading different rows
    table = parameter_layouts(model)
    split_over = {id(p): table.get(name, WHOLE).expert_parallel for name, p in model.named_parameters()}
    layout = {
        # whole sizes: an expert-parallel shard counts as its whole weight, so any ep can resume the checkpoint
        g.get("name", str(i)): f"{len(g['params'])} tensors, "
        f"{sum(p.numel() * split_over.get(id(p), 1) for p in g['params'])} values"
        for i, g in enumerate(optimizer.param_groups)
    }
    identity = data.identity()
    return {
        "model_config": {k: v for k, v in dataclasses.asdict(model.config).items() if k not in RESUME_MAY_CHANGE_MODEL},
        # What a field means in a checkpoint written before the field existed: its default (the old behaviour).
        "model_config_defaults": {
            f.name: f.default
            for f in dataclasses.fields(model.config)
            if f.default is not dataclasses.MISSING and f.name not in RESUME_MAY_CHANGE_MODEL
        },
        # The global batch, not the per-process one: a resume may split it over another number of processes.
        "recipe": {
            **{f: getattr(train_cfg, f) for f in RESUME_MUST_MATCH},
            "global_batch_size": train_cfg.batch_size * data_parallel,
            "precision": precision.dtype,
            "optimizer": type(optimizer).__name__,
        },
        "optimizer_layout": layout,
        "data": {
            "fingerprint": identity["fingerprint"],
            "val_fingerprint": identity.get("val_fingerprint"),
            "vocab_size": data.vocab_size,
        },
    }


def initial_weights(cfg_model: DictConfig, model: nn.Module, train_cfg: TrainConfig, vocab: dict, resuming: bool):
    """Where the weights of `model` (built on the meta device) come from, as a fill source
    (k3train/models/common/init.py): train.init_from's weights unless `resuming` (whose weights are the
    checkpoint's, restored over these), read by slice (k3train/inference/slices.py), else the model's init rules
    drawn from train.seed, else (a model without init_rules) the model built whole on the CPU by its own __init__."""
    if train_cfg.init_from is not None and not resuming:
        return weights_by_slice(train_cfg.init_from, model)
    if hasattr(model, "init_rules"):
        return InitialWeights(model.init_rules(), train_cfg.seed)
    with torch.device("cpu"):
        return WholeModel(instantiate(cfg_model, **vocab))


def set_up_process(
    train_cfg: TrainConfig, world: World, launcher: dict | None = None, measuring_memory: bool = False
) -> tuple[torch.device, ThreadChoice]:
    """The process-wide state a run needs before anything is built: its device, torch's threads (`launcher`: a
    multirun launcher's settings, which may say how many jobs share the CPUs), a CPU's memory and denormal settings
    (`measuring_memory`: malloc left to return freed memory, so the resident peak is what was held), determinism
    and the seed."""
    device = device_for_rank(train_cfg.device, world)
    threads = choose_threads(train_cfg.cpu_threads, launcher)
    apply_threads(threads)
    if device.type == "cpu":
        prepare_cpu_training(keep_freed=not measuring_memory)
    configure_determinism(train_cfg.deterministic)
    seed_everything(train_cfg.seed)
    return device, threads


def build_parts(
    cfg: DictConfig, run_dir: Path, device: torch.device, world: World, threads: ThreadChoice, resuming: bool
) -> dict:
    """Every part of the run from its composed config, writing nothing (no Hydra state needed): the data, the model
    (sharded by the parallel strategy; from train.init_from's weights unless `resuming`, whose weights are the
    checkpoint's), the optimizer, update step, schedule, callbacks, metrics sinks, Checkpointer and Trainer. A refusal
    here leaves no trace; the runner reports it. Restoring the checkpoint is the caller's (run/resume.py)."""
    train_cfg: TrainConfig = OmegaConf.to_object(cfg.train)
    precision = instantiate(cfg.precision)
    precision.check_device(device)
    parallel, dims = _parallel(cfg, world, device)
    if dims.pp > 1:
        _check_pipelined(train_cfg, precision)
    data = instantiate(cfg.data)
    # vocab_size: null in a model YAML means "the data's"; a value the user set is kept, and check_data refuses a
    # mismatch.
    vocab = {"vocab_size": data.vocab_size} if cfg.model.get("vocab_size") is None else {}
    model = _model_on_meta(cfg, vocab, data, train_cfg)
    weights = initial_weights(cfg.model, model, train_cfg, vocab, resuming)
    loaders = _loaders(data, train_cfg, dims, model)
    model.to(precision.param_dtype)  # still on the meta device: the dtype each rank allocates
    held, optimizer, whole_optimizer = _allocate(cfg, model, parallel, dims, device, train_cfg, weights)
    guard = instantiate(cfg.guard)
    guard.check_run(train_cfg.checkpoint_interval)
    callbacks = _build_named(cfg.callbacks, Callback, "callbacks")
    if device.type == "cpu" and str(train_cfg.cpu_threads) == "adaptive" and threads.threads > 1:
        governor = CpuThreads.for_this_process(threads.threads)  # fewer threads while other processes need the CPUs
        if governor is not None:
            callbacks["cpu_threads"] = governor
    sinks = _build_named(cfg.logger, MetricsSink, "logger", run_dir=str(run_dir))
    task_eval = None
    if train_cfg.eval_tasks:  # found and their data read now: a missing task or file is refused before any write
        include, limit = train_cfg.eval_tasks_include_path, train_cfg.eval_tasks_limit
        task_eval = TaskEval(train_cfg.eval_tasks, include, limit, data.tokenizer(), dims)
    # The log file is opened at its first event, after all checks.
    metrics = MetricsLogger(run_dir / "metrics.jsonl", sinks=list(sinks.values()), enabled=world.is_main)
    meta = build_meta(model, whole_optimizer, train_cfg, precision, data, world, dims)
    checkpointer = checkpointer_for(run_dir, meta, train_cfg, parallel, dims, world)
    trainer = Trainer(
        step=build_step(held, model, whole_optimizer, precision, device, parallel, dims, train_cfg),
        optimizer=optimizer,
        schedule_factory=instantiate(cfg.schedule),
        loaders=loaders,
        config=train_cfg,
        metrics=metrics,
        checkpointer=checkpointer,
        callbacks=callbacks,
        profile=OmegaConf.to_object(cfg.profile),
        task_eval=task_eval,
        guard=guard,
    )
    return {"trainer": trainer, "metrics": metrics, "data": data}


def _parallel(cfg: DictConfig, world: World, device: torch.device):
    """The parallel strategy (parallel=...) and the run's ParallelDims on this world."""
    parallel = instantiate(cfg.parallel)
    lacking = strategy_missing(parallel)
    if lacking:
        raise TypeError(
            f"parallel {cfg.parallel.get('_target_')} built a {type(parallel).__name__}, which lacks "
            f"{', '.join(lacking)}: a strategy implements k3train/train/parallel.py's ParallelStrategy"
        )
    pp = parallel.pipeline.pp
    dims = ParallelDims.for_strategy(
        parallel.name, world.size, world.rank, device.type, parallel.ep, parallel.cp, parallel.dp_replicate, pp
    )
    return parallel, dims


def _model_on_meta(cfg: DictConfig, vocab: dict, data, train_cfg: TrainConfig) -> nn.Module:
    """The model on the meta device (no rank ever holds the whole model: each allocates its part once cut and
    sharded), checked against the data and set to train.activation_checkpointing."""
    with torch.device("meta"):
        model = instantiate(cfg.model, **vocab)
    missing = missing_members(model)
    if missing:
        raise TypeError(
            f"model {cfg.model._target_} built a {type(model).__name__}, which lacks {', '.join(missing)}: "
            "a model implements k3train/models/protocol.py's LanguageModel"
        )
    model.check_data(data.vocab_size, train_cfg.seq_len)
    if train_cfg.activation_checkpointing != "none":
        if not hasattr(model, "set_activation_checkpointing"):
            raise ValueError(
                f"train.activation_checkpointing={train_cfg.activation_checkpointing}: {type(model).__name__} has "
                "no checkpointing; use none"
            )
        model.set_activation_checkpointing(train_cfg.activation_checkpointing)
    return model


def _loaders(data, train_cfg: TrainConfig, dims: ParallelDims, model: nn.Module) -> Loaders:
    """This rank's loaders (its data-parallel rows; under cp its slice of their sequence, the model set to exchange
    the rest), and a mixture's sources each validated alone too (data=mixture: val/<source>/loss)."""
    shape = (train_cfg.batch_size, train_cfg.seq_len)
    train_loader, val_loader = data.loaders(*shape, rank=dims.dp_rank, world_size=dims.dp_size)
    val_sources = (
        data.val_loaders(*shape, rank=dims.dp_rank, world_size=dims.dp_size) if hasattr(data, "val_loaders") else {}
    )
    if dims.cp > 1:
        train_loader, val_loader = (
            ContextSlices(loader, dims.cp_rank, dims.cp) for loader in (train_loader, val_loader)
        )
        val_sources = {name: ContextSlices(loader, dims.cp_rank, dims.cp) for name, loader in val_sources.items()}
        if not set_context_parallel(model, ContextParallel(dims.cp_group)):
            raise ValueError(f"parallel.cp={dims.cp}: {type(model).__name__} has no layer that splits its sequence")
    return Loaders(train_loader, val_loader, val_sources)


def _allocate(cfg: DictConfig, model, parallel, dims: ParallelDims, device, train_cfg: TrainConfig, weights):
    """This rank's part of `model` (on the meta device) spread over its ranks, then allocated and filled from
    `weights`, and its optimizer: (what this rank holds, the optimizer, the optimizer whose layout the checkpoint
    records). Under pp, cut first: each rank spreads only its stages, then allocates them; the whole model's
    optimizer, without state, is the checkpoint's layout."""
    if dims.pp == 1:
        model = parallel.shard(model, device, dims)  # before the optimizer: FSDP2 replaces the parameters
        materialise(model, device, weights)
        optimizer = _build_optimizer(instantiate(cfg.optim), model, dims)
        return model, optimizer, optimizer
    pipeline = _pipeline(model, parallel, dims, device, train_cfg, weights)
    optimizer = _build_optimizer(instantiate(cfg.optim), nn.ModuleList(pipeline.modules), dims)
    whole = _build_optimizer(instantiate(cfg.optim), model, ParallelDims(device_type=device.type))
    return pipeline, optimizer, whole


def build_step(held, model, whole_optimizer, precision, device, parallel, dims: ParallelDims, train_cfg) -> UpdateStep:
    """The run's UpdateStep (k3train/train/step.py): a pipeline's (held: this rank's Pipeline), or every rank the
    whole depth (held: the sharded model)."""
    if dims.pp > 1:
        gather = not sharded_checkpoint(dims)
        return PipelineStep(held, model, whole_optimizer, precision, device, parallel, dims, gather=gather)
    return DataParallelStep(held, precision, device, parallel, dims, compile=train_cfg.compile)


def sharded_checkpoint(dims: ParallelDims) -> bool:
    """Sharded parameters or experts: every rank writes its own (a .dcp directory)."""
    return dims.dp_shard > 1 or dims.ep > 1


def checkpointer_for(run_dir: Path, meta: dict, train_cfg: TrainConfig, parallel, dims: ParallelDims, world: World):
    """The run's Checkpointer: sharded (every rank its own), a pipeline's stages gathered into the whole model's
    file, or one file."""
    keep = train_cfg.keep_last_k
    if sharded_checkpoint(dims):
        # a pipeline's stages hold different tensors: rank 0's pipeline (ranks 0, stage_world, ...) merges what
        # they hold into one tree
        writers_pipeline = dims.pp > 1 and dims.rank % dims.layout.stage_world == 0
        merge = dims.pp_group if writers_pipeline else None
        layouts = parallel.shard_layouts(dims)
        return ShardedCheckpointer(run_dir, meta, keep, layouts, writer=world.is_main, merge_group=merge)
    if dims.pp > 1:  # the stages' state gathered: the whole model's file
        return GatheredCheckpointer(run_dir, meta, keep, writer=world.is_main)
    return Checkpointer(run_dir, meta, keep, writer=world.is_main)


def _check_pipelined(train_cfg: TrainConfig, precision) -> None:
    """What a pipelined run cannot do yet, refused before anything is built."""
    if precision.dtype == "fp16":
        raise ValueError(
            "precision=fp16 with parallel.pp > 1: its loss scaling is not threaded through the pipeline's schedule; "
            "use precision=bf16 or fp32"
        )
    if train_cfg.compile:
        raise ValueError(
            "train.compile=true with parallel.pp > 1: the stages are not compiled; set train.compile=false"
        )


def _pipeline(model, parallel, dims: ParallelDims, device: torch.device, train_cfg: TrainConfig, weights) -> Pipeline:
    """This rank's stages of `model` (on the meta device), each spread over its ranks by the parallel strategy and
    allocated and filled from `weights`, and their schedule (k3train/train/pipeline.py), for updates of
    batch_size x gradient_accumulation_steps rows."""
    settings = parallel.pipeline
    if not isinstance(model, Pipelines):
        raise ValueError(
            f"parallel.pp={dims.pp}: {type(model).__name__} cannot be cut into pipeline stages (it has no "
            "pipeline_stage: k3train/models/protocol.py's Pipelines); use parallel.pp=1"
        )
    rows = train_cfg.batch_size * train_cfg.gradient_accumulation_steps
    n = settings.n_microbatches(rows, train_cfg.gradient_accumulation_steps)
    return Pipeline(
        model,
        settings,
        dims.pp_rank,
        dims.pp_group,
        device,
        n,
        (rows // n, train_cfg.seq_len // dims.cp),  # a micro-batch's rows, and this rank's slice of their sequence
        parallelize=lambda stage: materialise(parallel.shard(stage, device, dims), device, weights),
    )


def _build_optimizer(factory, model, dims: ParallelDims) -> torch.optim.Optimizer:
    """optim's factory applied to the model; one that takes a `process_group` (Muon: distributed Newton-Schulz)
    gets the data-parallel group, so an optimizer that needs none keeps the plain `factory(model)` signature."""
    takes_group = "process_group" in inspect.signature(factory).parameters
    return factory(model, **({"process_group": dims.dp_group} if takes_group else {}))


def _build_named(nodes: DictConfig, kind: type, group: str, **kwargs) -> dict:
    """Instantiate each `name: {_target_: ...}` entry of a config group that lists several (callbacks, logger)
    and check it is a `kind`."""
    built = {}
    for name, node in nodes.items():
        part = instantiate(node, **kwargs)
        if not isinstance(part, kind):
            raise TypeError(
                f"{group}.{name}: {node.get('_target_')} built a {type(part).__name__}, which is not a "
                f"{kind.__name__} ({kind.__module__})"
            )
        built[name] = part
    return built
