"""k3train's Hydra sweeper plugin: `hydra/sweeper=optuna` (optuna_sweeper.py). Under hydra_plugins/ because Hydra
instantiates only plugins of that package; k3train registers it itself (k3train/config.py register_configs), since
Hydra's scan of the namespace does not see an editable install's portion of it."""
