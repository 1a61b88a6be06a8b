"""`hydra/sweeper=optuna`: a search whose trials are ordinary k3train runs, its study kept in the sweep directory.

    python -m k3train -m hydra/sweeper=optuna hydra.sweeper.n_trials=6 hydra/launcher=local train.max_steps=200

Each trial is one job of the configured launcher (local processes, SLURM), in <sweep dir>/<trial number>/ with
resume=auto, scored by its final val loss (what the sweep table sorts by); `n_jobs` trials run at a time (the local
preset's K3TRAIN_LOCAL_JOBS when set). The study is Optuna's, in a journal file beside the trials
(<sweep dir>/optuna_journal.log; TPE, seeded), so the same command with the same hydra.sweep.dir goes on where it
stopped: finished trials count, and a trial that was running when the sweep stopped is launched again under its own
number and parameters, its run resuming from its last checkpoint. The space (`params`) is written beside it
(<sweep dir>/search_space.json), from which the sweep table notes a best value near an end of its range.

params, one entry per override key:
    optim.lr: {type: float, low: 1.0e-4, high: 3.0e-2, log: true}
    schedule.warmup_steps: {type: int, low: 0, high: 100}
    schedule: {type: categorical, choices: [warmup_cosine, wsd]}
Values given on the command line are fixed for every trial; a comma-separated grid there is refused (search it).
Optuna: Akiba et al., "Optuna: A Next-generation Hyperparameter Optimization Framework", KDD 2019.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from k3train.observe.sweep_table import SEARCH_SPACE, read_job

log = logging.getLogger(__name__)

JOURNAL = "optuna_journal.log"
PLANNED_ENDS = ("max_steps", "max_tokens", "end_of_data")  # how a run ends when it has done what it was asked
TYPES = ("float", "int", "categorical")


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        params: dict[str, Any],
        n_trials: int = 6,
        n_jobs: int = 2,
        seed: int = 0,
        study_name: str = "k3train",
        max_batch_size: int | None = None,
    ) -> None:
        try:
            import optuna  # noqa: F401
        except ImportError as exc:
            raise ImportError("hydra/sweeper=optuna needs optuna: pip install 'k3train[search]'") from exc
        self.space = check_space(
            OmegaConf.to_container(params, resolve=True) if isinstance(params, DictConfig) else params
        )
        if int(n_trials) < 1:
            raise ValueError(f"hydra.sweeper.n_trials={n_trials} must be >= 1")
        self.n_trials, self.seed, self.study_name = int(n_trials), int(seed), study_name
        self.n_jobs = int(max_batch_size or n_jobs)
        if self.n_jobs < 1:
            raise ValueError(f"hydra.sweeper.n_jobs={n_jobs} must be >= 1")

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        import optuna
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend
        from optuna.trial import TrialState

        fixed = fixed_overrides(arguments, self.hydra_context)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        check_same_space(sweep_dir / SEARCH_SPACE, self.space)
        (sweep_dir / SEARCH_SPACE).write_text(json.dumps(self.space, indent=2) + "\n")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=JournalStorage(JournalFileBackend(str(sweep_dir / JOURNAL))),
            sampler=optuna.samplers.TPESampler(seed=self.seed),
            direction="minimize",
            load_if_exists=True,
        )
        stale = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
        done = sum(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in study.get_trials(deepcopy=False))
        if done or stale:
            log.info(f"study {sweep_dir / JOURNAL}: {done} trial(s) done, {len(stale)} to finish, of {self.n_trials}")
        for trial in stale:  # one at a time: each keeps its own number, so its run directory
            if not self._run(study, [(trial.number, trial.params)], fixed, sweep_dir):
                return
        while (
            done := sum(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in study.get_trials())
        ) < self.n_trials:
            asked = [study.ask(distributions(self.space)) for _ in range(min(self.n_jobs, self.n_trials - done))]
            if not self._run(study, [(t.number, t.params) for t in asked], fixed, sweep_dir):
                return
        finished = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
        if finished:
            best = min(finished, key=lambda t: t.value)
            log.info(f"best trial {best.number}: val loss {best.value:.4f} at {best.params}")

    def _run(self, study, trials: list[tuple[int, dict]], fixed: list[str], sweep_dir: Path) -> bool:
        """Launch trials numbered consecutively (or one) as one batch and tell the study each one's final val loss.
        A run stopped before its planned end (a stop signal, a time limit) is no result: its trial stays running in
        the study, the sweep ends, and the same command resumes it. False then."""
        from optuna.trial import TrialState

        batch = [[*fixed, *(f"{key}={value}" for key, value in params.items()), "resume=auto"] for _, params in trials]
        self.validate_batch_is_legal(batch)
        results = self.launcher.launch(batch, initial_job_idx=trials[0][0])
        stopped = []
        for (number, _), result in zip(trials, results):
            row = read_job(sweep_dir / str(number))
            try:
                _ = result.return_value  # raises the job's exception if it failed
            except Exception as exc:  # noqa: BLE001 - one trial's failure is a result, not the sweep's end
                log.warning(f"trial {number} failed: {exc}")
                study.tell(number, state=TrialState.FAIL)
                continue
            if row.end not in PLANNED_ENDS:
                stopped.append(f"{number} ({row.end})")
            elif row.final_val_loss is None or not math.isfinite(row.final_val_loss):
                study.tell(number, state=TrialState.FAIL)
            else:
                study.tell(number, row.final_val_loss)
        if stopped:
            log.warning(
                f"trial(s) {', '.join(stopped)} stopped before their last update: the study keeps them running, and "
                f"the same command with hydra.sweep.dir={sweep_dir} resumes them and goes on"
            )
        return not stopped


def check_space(space: dict[str, Any]) -> dict[str, dict]:
    """The search space, each entry checked; ValueError naming the key otherwise."""
    if not space:
        raise ValueError("hydra.sweeper.params is empty: name what to search (conf/hydra/sweeper/optuna.yaml)")
    checked = {}
    for key, spec in space.items():
        kind = spec.get("type", "float") if isinstance(spec, dict) else None
        if kind not in TYPES:
            raise ValueError(f"hydra.sweeper.params.{key}: give {{type: float|int|categorical, ...}}, got {spec!r}")
        if kind == "categorical":
            if not spec.get("choices"):
                raise ValueError(f"hydra.sweeper.params.{key}: a categorical needs choices: [a, b, ...]")
            checked[key] = {"type": kind, "choices": list(spec["choices"])}
            continue
        low, high, log_scale = spec.get("low"), spec.get("high"), bool(spec.get("log", False))
        if low is None or high is None or not low < high or (log_scale and low <= 0):
            raise ValueError(f"hydra.sweeper.params.{key}: needs low < high (and low > 0 with log: true), got {spec}")
        checked[key] = {"type": kind, "low": low, "high": high, "log": log_scale}
    return checked


def check_same_space(path: Path, space: dict) -> None:
    """A study resumed under another space would mix trials drawn from two: refuse, naming both."""
    if path.exists():
        before = json.loads(path.read_text())
        if before != space:
            raise ValueError(
                f"{path} holds this study's space {before}, and this sweep's is {space}: give another "
                "hydra.sweep.dir for a new search, or the same params to go on with this one"
            )


def distributions(space: dict[str, dict]) -> dict:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    made = {}
    for key, spec in space.items():
        if spec["type"] == "categorical":
            made[key] = CategoricalDistribution(spec["choices"])
        elif spec["type"] == "int":
            made[key] = IntDistribution(int(spec["low"]), int(spec["high"]), log=spec["log"])
        else:
            made[key] = FloatDistribution(float(spec["low"]), float(spec["high"]), log=spec["log"])
    return made


def fixed_overrides(arguments: list[str], hydra_context: HydraContext) -> list[str]:
    """The command line's overrides, each one value: a sweep over them belongs in params."""
    parser = OverridesParser.create(config_loader=hydra_context.config_loader)
    fixed = []
    for override in parser.parse_overrides(arguments):
        if override.is_sweep_override():
            raise ValueError(
                f"{override.input_line}: the optuna sweeper searches hydra.sweeper.params; give one value here, "
                f"or add {override.get_key_element()} to the params"
            )
        fixed.append(override.input_line)
    return fixed
