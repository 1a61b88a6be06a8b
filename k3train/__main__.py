"""`python -m k3train [overrides]`: compose the config with Hydra and hand it to the runner. Nothing else."""

import hydra
from omegaconf import DictConfig

from k3train.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://k3train.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from k3train.train.runner import run

    run(cfg)


if __name__ == "__main__":
    main()
