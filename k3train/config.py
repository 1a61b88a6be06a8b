"""Structured config schemas: the typed shape of conf/config.yaml.

Registered in Hydra's ConfigStore as `config_schema`, which conf/config.yaml lists first in its defaults, so a
misspelt key (`train.batch_szie=4`) or a wrong type (`train.batch_size=abc`) fails at start-up naming the key; the
runner's `check_known_keys` also refuses keys added with `+`/`++`, which Hydra lets into a structured config.
Cross-field checks live in __post_init__ and run when the Trainer's typed config is built
(`OmegaConf.to_object`), before any model or data is touched.

The groups model, optim, schedule, precision, data and parallel are `_target_` nodes, typed by what they build:
k3train/config_targets.py checks each key and value against its target's signature (a model's against its
config_class) at start-up, and the classes check ranges when built; callbacks and logger hold any number of them,
by name, checked the same way.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from k3train.runtime.cpu import parse_threads


@dataclass
class TrainConfig:
    """The training recipe. Fields that change what an update means must match on resume (see RESUME_MUST_MATCH)."""

    batch_size: int = 8  # sequences per micro-batch, per process
    seq_len: int = 256
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer update
    max_steps: int | None = 200  # optimizer updates; null: until the token budget or the data runs out
    max_tokens: int | None = None  # token budget; the run stops at whichever limit comes first
    eval_interval: int = 50  # updates between evaluations (0: only the final one)
    eval_batches: int = 8  # val batches per evaluation, always the same prefix of the val split
    log_interval: int = 10
    checkpoint_interval: int = 100  # updates between checkpoints (0: only the final one)
    # also a checkpoint once this many minutes have passed since the last one began (null: by updates alone)
    checkpoint_interval_minutes: float | None = None
    # write checkpoints in the background, the loop waiting only while the state is copied (docs/checkpoints.md);
    # null: the device's default (CPU: off, as measured in benchmarks/bench_checkpoint_async.py; CUDA: on)
    checkpoint_async: bool | None = None
    keep_last_k: int = 0  # besides last.pt, keep step-numbered copies of the last k checkpoints
    grad_clip: float | None = 1.0  # max global grad norm; null or 0 disables clipping (the norm is still logged)
    max_consecutive_skips: int = 10  # non-finite loss/grad updates in a row before the run stops
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    deterministic: bool = False
    overfit_batch: bool = False  # repeat the first (accumulated) batch forever: a plumbing check
    compile: bool = False
    progress: str = "auto"  # auto (a bar on a terminal, log lines otherwise) | bar | lines
    # torch threads: auto (usable CPUs / local jobs, k3train/runtime/cpu.py), a count, or adaptive: auto's count to
    # start, fewer while other processes use the CPUs (faster on a shared machine; the numbers then depend on the
    # load, so a resumed run is no longer bitwise the uninterrupted one: k3train/train/cpu_threads.py)
    cpu_threads: str = "auto"
    # End this session after this many updates (counted from where the session started) with a checkpoint,
    # leaving the plan (and so the schedule) unchanged; the same command with resume=auto does the next slice.
    stop_after: int | None = None
    # none | block (recompute each Block in the backward) | selective (recompute the attention and MoE cores):
    # less activation memory for more compute (k3train/models/k3/model.py; docs/configuration.md)
    activation_checkpointing: str = "none"
    # Start a new run (step 0, a fresh optimizer) from the weights at this path: a run directory, a checkpoint, a
    # k3train export or a Hugging Face Kimi Linear / Kimi K3 directory; its model must be this run's (model=...).
    init_from: str | None = None
    # Per-device peak FLOP/s that `mfu` divides by; null: a known GPU's datasheet peak, or a CPU calibration matmul
    # (k3train/observe/mfu.py).
    peak_flops: float | None = None
    # Downstream tasks of lm-evaluation-harness (k3train/train/eval_tasks.py) scored every eval_tasks_interval
    # updates (0: only at the end) as eval_tasks events; eval_tasks_include_path: a folder of local task YAMLs;
    # eval_tasks_limit: the first N examples of each task (null: all)
    eval_tasks: list[str] = field(default_factory=list)
    eval_tasks_interval: int = 0
    eval_tasks_include_path: str | None = None
    eval_tasks_limit: int | None = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")

        for name in ("batch_size", "seq_len", "gradient_accumulation_steps", "eval_batches", "log_interval"):
            positive(name)
        for name in ("eval_interval", "checkpoint_interval", "keep_last_k", "eval_tasks_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"train.max_steps must be >= 1 or null, got {self.max_steps}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"train.max_tokens must be >= 1 or null, got {self.max_tokens}")
        if self.grad_clip is not None and self.grad_clip < 0:
            raise ValueError(f"train.grad_clip must be >= 0 or null, got {self.grad_clip}")
        if self.progress not in ("auto", "bar", "lines"):
            raise ValueError(f"train.progress must be auto, bar or lines, got {self.progress!r}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"train.stop_after must be >= 1 or null, got {self.stop_after}")
        if self.cpu_threads not in ("auto", "adaptive"):
            parse_threads(self.cpu_threads)
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(f"train.peak_flops must be > 0 (FLOP/s per device) or null, got {self.peak_flops}")
        if self.activation_checkpointing not in ("none", "block", "selective"):
            raise ValueError(
                "train.activation_checkpointing must be none, block or selective, "
                f"got {self.activation_checkpointing!r}"
            )
        if self.eval_tasks_limit is not None and self.eval_tasks_limit < 1:
            raise ValueError(f"train.eval_tasks_limit must be >= 1 or null, got {self.eval_tasks_limit}")
        if self.checkpoint_interval_minutes is not None and not self.checkpoint_interval_minutes > 0:
            raise ValueError(
                f"train.checkpoint_interval_minutes must be > 0 or null, got {self.checkpoint_interval_minutes}"
            )
        if self.max_consecutive_skips < 1:
            raise ValueError(f"train.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")

    @property
    def asynchronous_checkpoints(self) -> bool:
        """checkpoint_async, or the device's default where it is null: on with CUDA, off on a CPU (measured:
        docs/checkpoints.md)."""
        if self.checkpoint_async is not None:
            return self.checkpoint_async
        return self.device.startswith("cuda") or (self.device == "auto" and _cuda_available())

    @property
    def clip_norm(self) -> float | None:
        return self.grad_clip if self.grad_clip else None


# Recipe fields that define what one update is: a resumed run must agree on them. Everything else (max_steps,
# intervals, eval size, clipping, seed...) may change between sessions.
def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


RESUME_MUST_MATCH = ("seq_len", "gradient_accumulation_steps", "overfit_batch")  # and the global batch (runner)

# Model config fields that choose an implementation, not the function or the parameters: a run may continue
# on other hardware with another one (chunk on a CPU, fla on a GPU).
RESUME_MAY_CHANGE_MODEL = ("kda_implementation", "expert_implementation")


@dataclass
class ProfileConfig:
    """A torch.profiler window; its counters count optimizer attempts (skipped updates included)."""

    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 3

    def __post_init__(self) -> None:
        if self.wait < 0 or self.warmup < 0 or self.active < 1:
            raise ValueError("profile.wait and profile.warmup must be >= 0 and profile.active >= 1")


@dataclass
class PathsConfig:
    """conf/paths/: the output root (runs/, sweeps/ under it) and the cache root (prepared data, calibrations)."""

    outputs: str = "outputs"
    cache: str = "~/.cache/k3train"


@dataclass
class DryRunConfig:
    """`python -m k3train dry_run.world_size=N dry_run.rank=R`: build and step rank R of an N-rank run in one process
    on torch's fake process group (k3train/run/dry_run.py); null: a real run."""

    world_size: int | None = None
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size is None:
            return
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"dry_run.world_size={self.world_size!r} must be a positive integer (the run's ranks)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"dry_run.rank={self.rank} is not a rank of dry_run.world_size={self.world_size}: choose 0 to "
                f"{self.world_size - 1}"
            )


@dataclass
class Config:
    model: Any = MISSING
    optim: Any = MISSING
    schedule: Any = MISSING
    precision: Any = MISSING
    data: Any = MISSING
    parallel: Any = MISSING
    guard: Any = MISSING  # k3train.train.guard.Guard: loss-spike detection and what a spike does (conf/guard/)
    callbacks: Any = field(default_factory=dict)  # name -> `_target_` node of a k3train.train.callbacks.Callback
    logger: Any = field(default_factory=dict)  # name -> `_target_` node of a metrics sink, besides metrics.jsonl
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    dry_run: DryRunConfig = field(default_factory=DryRunConfig)
    # null: a fresh run | auto: continue from this output directory's checkpoint if there is one | a path
    resume: str | None = None


def check_known_keys(cfg, schema: type = Config, prefix: str = "") -> None:
    """Refuse keys the schema does not have. Hydra refuses `train.max_stpes=5` while composing, but `+key` and
    `++key` (the form its own error hint suggests) add a key to a structured config without a word."""
    hints = get_type_hints(schema)
    known = {f.name for f in fields(schema)}
    for key in cfg.keys():
        if key == "hydra" and not prefix:
            continue
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ValueError(f"unknown key {prefix}{key}{hint}: the schema in k3train/config.py has no such setting")
        if is_dataclass(hints[key]):
            check_known_keys(cfg[key], hints[key], f"{prefix}{key}.")


def model_option(name: str):
    """conf/model/NAME.yaml as a run composes it, its defaults list followed (k3_tiny is k3_base plus its sizes), as a
    plain DictConfig the caller may change: what benchmarks and notebooks build a model from without a run."""
    return option("model", name)


def option(group: str, name: str):
    """conf/GROUP/NAME.yaml as a run composes it (model_option for any group)."""
    from hydra import compose, initialize_config_module

    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        node = compose("config", overrides=[f"{group}={name}"])[group]
    return OmegaConf.create(OmegaConf.to_container(node))


def register_plugins() -> None:
    """k3train's own Hydra plugins (hydra_plugins/k3train_search: hydra/sweeper=optuna), registered by name: Hydra
    finds plugins by scanning the hydra_plugins namespace package, and an editable install's portion of a namespace
    is importable but not listed to that scan."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.k3train_search.optuna_sweeper import OptunaSweeper

    Plugins.instance().register(OptunaSweeper)


def register_configs() -> None:
    # The resolvers read the launcher's environment (runtime/: torch.distributed, SLURM): imported here, so that
    # the schema alone imports no torch.
    from k3train.runtime.distributed import run_start
    from k3train.runtime.slurm import run_name

    ConfigStore.instance().store(name="config_schema", node=Config)
    # hydra.run.dir's timestamp: the same in every process of a multi-process run (k3train/runtime/distributed.py)
    OmegaConf.register_new_resolver("run_start", run_start, replace=True)
    # hydra.run.dir's name: the job id in a SLURM job (a requeued job finds its run), else the start time
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)
