"""The config `python -m k3train OVERRIDES` would run, composed by Hydra without running it."""

import copy
import functools

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from k3train.config import register_configs

register_configs()


def composed(*overrides: str, return_hydra_config: bool = False) -> DictConfig:
    """A fresh copy the caller may change. Composing takes ~0.1 s, so each override list is composed once."""
    return copy.deepcopy(_compose(overrides, return_hydra_config))


@functools.cache
def _compose(overrides: tuple[str, ...], return_hydra_config: bool) -> DictConfig:
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)


MODEL_BASES = ("k3_base",)  # conf/model/ options that are a form without sizes (???), what others build on: no model


def model_config(name: str) -> DictConfig:
    """conf/model/NAME.yaml as the runner gets it: composed, so a defaults list (k3_mla_only's) is followed."""
    return composed(f"model={name}").model


def built_run(monkeypatch, run_dir, data_dir, *overrides: str, model: str = "smoke_test_lm") -> tuple[DictConfig, dict]:
    """build_parts (k3train/run/build.py) on the composed config, as the runner calls it in one process, for `model`
    (the smoke model unless said; overrides may change its fields) on a tiny prepared dataset. Its process-wide CPU
    set-up (threads, malloc, denormals) is left out; no Hydra state is needed."""
    from omegaconf import OmegaConf

    from k3train.run import build
    from k3train.runtime.distributed import World

    cfg = composed(
        f"model={model}",
        *overrides,
        "data=prepared",
        f"data.path={data_dir}",
        "train.seq_len=16",
        "train.batch_size=2",
        "train.device=cpu",
        return_hydra_config=True,
    )
    monkeypatch.setattr(build, "apply_threads", lambda choice: None)
    monkeypatch.setattr(build, "prepare_cpu_training", lambda keep_freed=True: {})
    world = World()
    device, threads = build.set_up_process(OmegaConf.to_object(cfg.train), world)
    return cfg, build.build_parts(cfg, run_dir, device, world, threads, resuming=False)


# k3_tiny shrunk for in-process runs: Muon + AdamW, the Quantile-Balanced MoE (its bias moves in every training
# forward) and QK-Clip, logging every update, no evals before the end
K3_SHRUNK = (
    "model.d_model=64",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.kda_chunk_size=16",
    "schedule.warmup_steps=0",
    "train.eval_interval=0",
    "train.log_interval=1",
    "train.progress=lines",
)


def fit_k3(monkeypatch, run_dir, data_dir, *overrides: str, resume=None):
    """build_parts' Trainer of the shrunk k3_tiny with `overrides` (a resume from `resume` first), fitted to the end;
    the run directory made as the runner makes it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _, parts = built_run(monkeypatch, run_dir, data_dir, *K3_SHRUNK, *overrides, model="k3_tiny")
    trainer = parts["trainer"]
    if resume is not None:
        trainer.resume(resume)
    trainer.fit()
    return trainer
