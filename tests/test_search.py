"""hydra/sweeper=optuna (hydra_plugins/k3train_search/optuna_sweeper.py): the space's checks, the sweep table's
note for a best value near an end of its range, and a real 6-trial search, 2 at a time with the local launcher,
killed partway and started again: its study goes on, the trials it finished are not run again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3train.observe.sweep_table import JobRow, range_edge_notes

optuna = pytest.importorskip("optuna", reason="the search needs optuna (pip install 'k3train[search]')")
from hydra_plugins.k3train_search.optuna_sweeper import check_space  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("space", "words"),
    [
        ({}, "params is empty"),
        ({"optim.lr": {"low": 0.1, "high": 0.01}}, "needs low < high"),
        ({"optim.lr": {"low": 0.0, "high": 0.1, "log": True}}, "low > 0 with log"),
        ({"schedule": {"type": "categorical"}}, "needs choices"),
        ({"optim.lr": {"type": "normal", "low": 0, "high": 1}}, "type: float|int|categorical"),
    ],
)
def test_a_bad_space_names_its_key(space, words) -> None:
    with pytest.raises(ValueError, match=words):
        check_space(space)


def rows(*pairs: tuple[float, float]) -> list[JobRow]:
    made = [JobRow(Path(str(i)), {"optim.lr": repr(lr)}, "max_steps", loss) for i, (lr, loss) in enumerate(pairs)]
    return sorted(made, key=lambda r: r.final_val_loss)


def test_a_best_value_in_the_outer_tenth_of_its_log_range_is_noted_and_one_inside_is_not() -> None:
    space = {"optim.lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}}
    (note,) = range_edge_notes(rows((8e-2, 2.0), (1e-2, 2.5)), space)
    assert "optim.lr=0.08, near the upper end of its search range (0.001..0.1)" in note
    assert range_edge_notes(rows((2e-2, 2.0), (9e-2, 2.5)), space) == []  # 9e-2 was tried, but is not the best
    (note,) = range_edge_notes(rows((1.2e-3, 2.0), (1e-2, 2.5)), space)
    assert "near the lower end" in note


class Finished:
    """A launcher whose jobs leave run directories that ended as `ends` says (trial number -> end reason)."""

    def __init__(self, sweep_dir: Path, ends: dict[int, str]) -> None:
        self.sweep_dir, self.ends = sweep_dir, ends

    def launch(self, batch, initial_job_idx):
        from hydra.core.utils import JobReturn, JobStatus

        results = []
        for number in range(initial_job_idx, initial_job_idx + len(batch)):
            run = self.sweep_dir / str(number)
            run.mkdir(parents=True)
            (run / "run.json").write_text(json.dumps({"sessions": [{"end_reason": self.ends[number]}]}))
            (run / "metrics.jsonl").write_text(json.dumps({"event": "eval", "step": 2, "tokens": 64, "loss": 2.5}))
            results.append(JobReturn(status=JobStatus.COMPLETED, _return_value=None))
        return results


def test_a_trial_stopped_before_its_end_is_no_result_and_ends_the_sweep(tmp_path) -> None:
    from hydra_plugins.k3train_search.optuna_sweeper import OptunaSweeper

    sweeper = OptunaSweeper(params={"optim.lr": {"low": 1e-3, "high": 1e-1, "log": True}}, n_trials=4)
    sweeper.launcher = Finished(tmp_path, {0: "max_steps", 1: "SIGTERM"})
    sweeper.validate_batch_is_legal = lambda batch: None
    study = optuna.create_study()
    trials = [study.ask() for _ in range(2)]
    assert not sweeper._run(study, [(t.number, {"optim.lr": 0.01}) for t in trials], [], tmp_path)
    done, stopped = study.get_trials()
    assert done.state.name == "COMPLETE" and done.value == 2.5
    assert stopped.state.name == "RUNNING"  # the same command resumes it, rather than scoring a partial run


def study_trials(sweep_dir: Path) -> list:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    journal = sweep_dir / "optuna_journal.log"
    if not journal.exists():
        return []
    storage = JournalStorage(JournalFileBackend(str(journal)))
    return optuna.load_study(study_name="k3train", storage=storage).get_trials()


@pytest.mark.slow  # about ten short training runs
def test_a_six_trial_search_killed_partway_resumes_its_study(tmp_path) -> None:
    sweep_dir = tmp_path / "search"
    cmd = [
        sys.executable,
        "-m",
        "k3train",
        "-m",
        "hydra/sweeper=optuna",
        "hydra/launcher=local",
        "hydra.sweeper.n_trials=6",
        "train.max_steps=4",
        "train.batch_size=2",
        "train.eval_interval=0",
        "train.checkpoint_interval=2",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    env = {**os.environ, "K3TRAIN_OUTPUTS": str(tmp_path / "outputs")}
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while sum(t.state.name == "COMPLETE" for t in study_trials(sweep_dir)) < 2:
        assert first.poll() is None and time.monotonic() < deadline, "the first 2 trials did not finish"
        time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)  # the sweep and its trials at once (submitit's local jobs share its group)
    first.wait(timeout=120)
    before = {t.number: t.state.name for t in study_trials(sweep_dir)}
    assert 2 <= sum(s == "COMPLETE" for s in before.values()) < 6, before
    finished_first = [n for n, s in before.items() if s == "COMPLETE"]

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    after = study_trials(sweep_dir)
    assert [t.number for t in after] == list(range(6)) and all(t.state.name == "COMPLETE" for t in after)
    for number in finished_first:  # finished before the kill: one session, never run again
        assert len(json.loads((sweep_dir / str(number) / "run.json").read_text())["sessions"]) == 1
    for trial in after:  # each trial ran the values the study holds for it
        overrides = (sweep_dir / str(trial.number) / ".hydra" / "overrides.yaml").read_text()
        assert f"optim.lr={trial.params['optim.lr']}" in overrides
    table = (sweep_dir / "sweep_summary.md").read_text()
    assert table.count("| max_steps |") == 6
    assert json.loads((sweep_dir / "search_space.json").read_text())["optim.lr"]["log"] is True
