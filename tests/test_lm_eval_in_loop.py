"""train.eval_tasks: lm-evaluation-harness tasks scored during training (k3train/train/eval_tasks.py), on a local
multiple-choice task the test writes (right answers: text of the built-in corpus; wrong ones: its bytes shuffled),
offline; `python -m k3train.lm_eval` on the run directory; a missing task or task file refused at start-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3train.data.builtin import builtin_documents
from k3train.data.tokenizers import ByteTokenizer
from k3train.inference.loading import build_model, load
from k3train.observe.metrics import read_metrics
from k3train.train.eval_tasks import TaskEval
from k3train.train.precision import Precision

from helpers.local_task import TASK, write_local_task

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# The quickstart model (k3_tiny on the built-in corpus) shrunk: every layer kind, about 20 s of training on 2 cores.
SHRUNK = (
    "model=k3_tiny model.d_model=64 model.expert_ffn_dim=32 model.dense_ffn_dim=64 model.kda_chunk_size=16 "
    "train.batch_size=8 train.seq_len=64 train.max_steps=60 train.eval_interval=0 train.eval_batches=2 "
    "train.checkpoint_interval=0 train.progress=lines schedule.warmup_steps=5"
).split()


def python_m(module: str, *args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "K3TRAIN_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    return write_local_task(tmp_path_factory.mktemp("tasks"), "\n".join(builtin_documents()), n=24)


@pytest.fixture(scope="module")
def run_dir(k3_cache, tasks, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("in-loop") / "run"
    in_loop = [f"train.eval_tasks=[{TASK}]", f"train.eval_tasks_include_path={tasks}", "train.eval_tasks_interval=30"]
    proc = python_m("k3train", *SHRUNK, *in_loop, f"hydra.run.dir={run}", cache=k3_cache)
    assert proc.returncode == 0, proc.stderr
    assert "it/s]" not in proc.stderr and "examples/s]" not in proc.stderr  # lm_eval's, datasets' bars held back
    return run


def test_task_scores_are_eval_tasks_events_and_the_trained_model_beats_a_random_one(run_dir, tasks):
    events = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "eval_tasks"]
    assert [e["step"] for e in events] == [30, 60]
    trained = events[-1][TASK]["acc"]
    # the same architecture at its initial weights, scored by the same code
    loaded = load(run_dir)
    torch.manual_seed(1337)
    fresh = build_model(loaded.model_target, dict(loaded.model.config.__dict__), torch.device("cpu"))
    scorer = TaskEval([TASK], str(tasks), None, ByteTokenizer())
    length = fresh.config.max_seq_len  # as the loop scores
    untrained = scorer(fresh, length, Precision("fp32"), torch.device("cpu"))[TASK]["acc"]
    assert trained > untrained + 0.25, (trained, untrained)
    assert trained >= 0.75


def test_python_m_k3train_lm_eval_scores_the_run_as_the_loop_did(run_dir, tasks, k3_cache, tmp_path):
    args = ["run", "--model", "k3train", "--model_args", f"path={run_dir}", "--tasks", TASK]
    proc = python_m(
        "k3train.lm_eval", *args, "--include_path", str(tasks), "--output_path", str(tmp_path), cache=k3_cache
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batch_size: 8" in proc.stdout + proc.stderr  # the adapter's default, not lm_eval's CLI's 1
    (result,) = tmp_path.rglob("results_*.json")
    acc = json.loads(result.read_text())["results"][TASK]["acc,none"]
    final = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "eval_tasks"][-1]
    assert acc == pytest.approx(final[TASK]["acc"], abs=1e-9)


@pytest.mark.parametrize("bad", ["missing_task", "missing_file", "unparsable_yaml"])
def test_a_missing_task_or_task_file_is_refused_in_one_line_before_anything_is_written(bad, k3_cache, tasks, tmp_path):
    where = tasks
    if bad in ("missing_file", "unparsable_yaml"):
        where = write_local_task(tmp_path / "tasks", "\n".join(builtin_documents()), n=4)
    if bad == "missing_file":
        (where / f"{TASK}.jsonl").unlink()
    if bad == "unparsable_yaml":  # lm_eval leaves it out silently: the refusal says why the task is missing
        (broken,) = where.glob("*.yaml")
        broken.write_text(broken.read_text() + "\ndoc_to_choice: [unclosed\n")
    name = "no_such_task" if bad == "missing_task" else TASK
    run = tmp_path / "run"
    overrides = [f"train.eval_tasks=[{name}]", f"train.eval_tasks_include_path={where}", f"hydra.run.dir={run}"]
    proc = python_m("k3train", *SHRUNK, *overrides, cache=k3_cache)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "train.eval_tasks" in errors[0], proc.stderr[-3000:]
    if bad == "unparsable_yaml":
        assert f"{broken} does not parse (" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not run.exists()


def test_the_report_draws_each_tasks_scores_by_step(run_dir, tmp_path):
    from k3train.report.cli import write_report
    from k3train.report.figures import run_charts
    from k3train.report.runs import load_run

    charts = {chart.name: chart for chart in run_charts(load_run(run_dir))}
    events = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "eval_tasks"]
    (panel,) = charts["tasks"].panels
    assert panel.ylabel == "acc" and panel.data() == {TASK: ([30.0, 60.0], [e[TASK]["acc"] for e in events])}
    write_report([run_dir], tmp_path / "out")
    assert (tmp_path / "out" / "tasks.png").read_bytes() == charts["tasks"].png


def test_scoring_tasks_leaves_training_exactly_as_without_them(builtin_data, tasks, tmp_path):
    from helpers.trainer import make_trainer, smoke

    def train(name: str, with_tasks: bool) -> tuple[list, dict]:
        model = smoke(builtin_data.vocab_size)
        trainer = make_trainer(tmp_path / name, builtin_data, model, max_steps=4, eval_tasks_interval=2)
        if with_tasks:
            trainer.task_eval = TaskEval([TASK], str(tasks), 4, ByteTokenizer())
        trainer.fit()
        events = read_metrics(tmp_path / name / "metrics.jsonl")
        return events, {k: v.clone() for k, v in model.state_dict().items()}

    plain, plain_weights = train("plain", False)
    scored, scored_weights = train("scored", True)
    assert [e["step"] for e in scored if e["event"] == "eval_tasks"] == [2, 4]
    assert [e["loss"] for e in scored if e["event"] == "train"] == [e["loss"] for e in plain if e["event"] == "train"]
    assert all(torch.equal(plain_weights[k], scored_weights[k]) for k in plain_weights)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_under_ddp_and_fsdp_every_rank_scores_and_the_event_is_the_final_weights_score(
    parallel, tasks, k3_cache, tmp_path
):
    """2 gloo ranks (FSDP2: the forwards' all-gathers in step on both ranks): the run ends, its eval_tasks events
    are at the interval and the end, and the last one's score is that of the final checkpoint scored in one
    process."""
    from helpers.distributed_runs import launch

    run = tmp_path / "run"
    in_loop = [f"train.eval_tasks=[{TASK}]", f"train.eval_tasks_include_path={tasks}", "train.eval_tasks_interval=2"]
    shape = ["train.max_steps=4", "train.batch_size=4", "train.cpu_threads=1", "train.eval_tasks_limit=8"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = launch(k3_cache, *SHRUNK, *shape, *in_loop, f"parallel={parallel}", f"hydra.run.dir={run}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [r for r in read_metrics(run / "metrics.jsonl") if r["event"] == "eval_tasks"]
    assert [e["step"] for e in events] == [2, 4]
    loaded = load(run)
    scorer = TaskEval([TASK], str(tasks), 8, ByteTokenizer())
    alone = scorer(loaded.model, loaded.model.config.max_seq_len, Precision("fp32"), torch.device("cpu"))[TASK]
    assert events[-1][TASK] == pytest.approx(alone, abs=1e-9)
