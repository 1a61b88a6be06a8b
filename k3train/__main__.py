"""`python -m k3train [overrides]`: compose the config with Hydra and hand it to the runner. Nothing else."""

from k3train.train.cpu import configure_openmp

configure_openmp()  # before anything imports torch: OpenMP reads its wait policy once, when it loads

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from k3train.config import register_configs  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://k3train.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from k3train.train.runner import run

    run(cfg)


if __name__ == "__main__":
    main()
