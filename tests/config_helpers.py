"""The config `python -m k3train OVERRIDES` would run, composed by Hydra without running it."""

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from k3train.config import register_configs

register_configs()


def composed(*overrides: str, return_hydra_config: bool = False) -> DictConfig:
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)


def model_config(name: str) -> DictConfig:
    """conf/model/NAME.yaml as the runner gets it: composed, so a defaults list (k3_mla_only's) is followed."""
    return composed(f"model={name}").model
