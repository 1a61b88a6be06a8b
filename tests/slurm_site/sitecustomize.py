"""Imported at start-up by every Python process of a SLURM test (it is first on their PYTHONPATH), including the
jobs that submitit and sbatch start, where no wrapper script runs: with K3TRAIN_STEP_DELAY_S set, each update of the
first session (SLURM_RESTART_COUNT 0 or unset) takes that much longer, so a test can signal a tiny run mid-way."""

import os
import time

_delay = float(os.environ.get("K3TRAIN_STEP_DELAY_S") or 0)
if _delay > 0 and int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
    from k3train.train.trainer import Trainer

    _train_step = Trainer.train_step

    def _slow_train_step(self):
        time.sleep(_delay)  # before the update: a signal lands between two update boundaries
        return _train_step(self)

    Trainer.train_step = _slow_train_step
