"""The sweep table reads each job's files as they are: finished, crashed, running, torn or resumed."""

import csv
import fcntl
import json

from k3train.observe.sweep_table import main, sweep_table, write_sweep_summary


def _job(sweep, num, overrides, evals, *, end_reason="max_steps", torn=False, redone=False):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    lines = [{"event": "session", "step": 0}]
    for i, loss in enumerate(evals, 1):
        lines.append({"event": "train", "step": 10 * i, "tokens": 100 * i, "loss": 9.0, "tokens_per_s": 50.0 * i})
        lines.append({"event": "eval", "step": 10 * i, "tokens": 100 * i, "loss": loss, "val_tokens": 64})
    if redone:  # a killed session's eval at step 20 that the resumed session (started from step 10) redid
        lines.append({"event": "session", "step": 10})
        lines.append({"event": "train", "step": 20, "tokens": 200, "loss": 9.0, "tokens_per_s": 100.0})
        lines.append({"event": "eval", "step": 20, "tokens": 200, "loss": 0.5})
    text = "".join(json.dumps(e) + "\n" for e in lines) + ('{"event": "train", "st' if torn else "")
    (job / "metrics.jsonl").write_text(text)
    session = {"session": 0, "overrides": overrides}
    if end_reason:
        session["end_reason"] = end_reason
    (job / "run.json").write_text(json.dumps({"sessions": [session]}))
    return job


def test_rows_sorted_by_final_val_loss_with_only_the_overrides_that_differ(tmp_path):
    _job(tmp_path, 0, ["optim.lr=1e-3", "train.max_steps=20"], [3.0, 2.5])
    _job(tmp_path, 1, ["optim.lr=3e-3", "train.max_steps=20"], [2.8, 2.9], torn=True)
    _job(tmp_path, 2, ["optim.lr=1e-2", "train.max_steps=20"], [2.0, 1.0], redone=True)
    crashed = _job(tmp_path, 3, ["optim.lr=3e-2", "train.max_steps=20"], [], end_reason=None)
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")  # a file, not a job

    keys, rows = sweep_table(tmp_path)
    assert keys == ["optim.lr"]
    assert [r.overrides["optim.lr"] for r in rows] == ["1e-2", "1e-3", "3e-3", "3e-2"]
    best = rows[0]
    assert (best.final_val_loss, best.best_val_loss, best.step) == (0.5, 0.5, 20)  # the redone step counts once
    assert rows[2].final_val_loss == 2.9 and rows[2].best_val_loss == 2.8  # the torn last line is skipped
    assert rows[3].run_dir == crashed and rows[3].final_val_loss is None
    assert rows[3].end == "stopped without an end" and rows[0].end == "max_steps"


def test_a_job_whose_lock_is_held_is_running(tmp_path):
    job = _job(tmp_path, 0, ["optim.lr=1e-3"], [2.0], end_reason=None)
    with open(job / ".lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert sweep_table(tmp_path)[1][0].end == "running"
    assert sweep_table(tmp_path)[1][0].end == "stopped without an end"


def test_summary_files_hold_the_same_table(tmp_path, capsys):
    _job(tmp_path, 0, ["optim.lr=1e-3"], [2.0])
    _job(tmp_path, 1, ["optim.lr=3e-3"], [1.5])
    assert main([str(tmp_path)]) == 0
    markdown = (tmp_path / "sweep_summary.md").read_text()
    assert markdown == capsys.readouterr().out == write_sweep_summary(tmp_path)
    assert markdown.splitlines()[2].startswith("| 3e-3 | 1.5000 |")
    table = list(csv.DictReader((tmp_path / "sweep_summary.csv").open()))
    assert [(r["optim.lr"], r["final val loss"], r["val tokens"], r["run dir"]) for r in table] == [
        ("3e-3", "1.5000", "64", "1"),  # val tokens: what the final val loss averaged over
        ("1e-3", "2.0000", "64", "0"),
    ]


def test_a_missing_sweep_directory_is_one_clear_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "no sweep directory" in capsys.readouterr().err


def test_a_best_value_at_the_edge_of_its_grid_is_flagged_under_the_table(tmp_path):
    """3e-2 is the largest lr swept and the best: the optimum may be beyond; in the middle, no note."""
    for i, (lr, loss) in enumerate([("1e-3", 3.0), ("3e-3", 2.5), ("1e-2", 2.2), ("3e-2", 2.0)]):
        _job(tmp_path / "edge", i, [f"optim.lr={lr}", "model=k3_tiny"], [loss])
    markdown = write_sweep_summary(tmp_path / "edge")
    assert markdown.splitlines()[-1] == (
        "**Note:** best final val loss at optim.lr=3e-2, the largest value swept (0.001..0.03): the optimum may lie "
        "beyond it; extend the grid past it before choosing."
    )
    for i, (lr, loss) in enumerate([("1e-3", 3.0), ("3e-3", 2.0), ("1e-2", 2.2)]):
        _job(tmp_path / "middle", i, [f"optim.lr={lr}"], [loss])
    assert "Note" not in write_sweep_summary(tmp_path / "middle")
