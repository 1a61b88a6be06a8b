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


def model_config(name: str) -> DictConfig:
    """conf/model/NAME.yaml as the runner gets it: composed, so a defaults list (k3_mla_only's) is followed."""
    return composed(f"model={name}").model
