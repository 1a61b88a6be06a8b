"""Hydra callbacks (conf/config.yaml, hydra.callbacks): the run-directory guard, before Hydra writes anything,
and the sweep summary, as each job of a multirun ends."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from k3train.observe.sweep_table import write_sweep_summary
from k3train.run import rundir
from k3train.run.resume import resolve_resume
from k3train.run.runner import USER_ERRORS, describe_error, fail
from k3train.runtime import slurm
from k3train.runtime.distributed import current_world


class RunDirGuard(HydraCallback):
    """Claims a single run's directory (creates it, locks it, notes its .hydra/) before Hydra writes .hydra/ into
    it, and refuses a second writer or a run that would write into another run's files. Multirun jobs are
    claimed and checked in run(), after Hydra has written their (new) job directory."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # run.dir may use ${hydra:...}; run_job sets the same config
        if not current_world().is_main:
            return  # rank 0 owns the directory; the other ranks write nothing to it
        run_dir = Path(config.hydra.run.dir)
        claim = None
        try:
            claim = rundir.claim(run_dir)
            resolve_resume(slurm.resume_setting(config.resume), run_dir)
        except USER_ERRORS as exc:
            if claim is not None:
                claim.undo()
            fail(describe_error(exc), 2, multirun=False)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        world = current_world()
        if world.distributed:
            fail(
                f"a multirun (-m) started as {world.size} processes would run every job in each of them: start "
                "the sweep as one process (its jobs may each use several processes through the submitit launcher)",
                2,
                multirun=False,
            )


class SweepSummary(HydraCallback):
    """Writes the sweep's table (k3train/observe/sweep_table.py) as each job ends, so it is there even when a job
    fails or the sweep is stopped, and prints it when the multirun ends (for every launcher: basic, submitit)."""

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
        if HydraConfig.get().mode == RunMode.MULTIRUN and current_world().is_main and Path(sweep_dir).is_dir():
            write_sweep_summary(Path(sweep_dir))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            print(
                f"sweep {sweep_dir} (also in {sweep_dir / 'sweep_summary.md'} and .csv):\n"
                + write_sweep_summary(sweep_dir),
                end="",
                flush=True,
            )
