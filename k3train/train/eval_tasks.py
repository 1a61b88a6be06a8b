"""Downstream tasks in the loop: lm-evaluation-harness tasks (train.eval_tasks) scored on the model being trained.

Every train.eval_tasks_interval updates (and after the last) the Trainer hands the model to TaskEval, which wraps
it in k3train's lm_eval adapter (k3train/inference/lm_eval.py) and runs the tasks; their scores become an
`eval_tasks` event, {step, tokens, <task>: {<metric>: value}}. The tasks are found and their data read when the
run is built, so a task that does not exist or a data file that is missing is refused before anything is written.

Every rank runs the same tasks on its own replica (under DDP the same weights, so the same scores; under FSDP the
forwards' all-gathers happen on every rank in step); rank 0's metrics logger writes the event. pp, cp or ep > 1
split the model or its sequence across ranks, and TaskEval refuses them. The model's mode and every RNG state are
restored afterwards, as for the val loss (k3train/train/evaluate.py), so the tasks never change what training does.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from pathlib import Path

import torch

from k3train.train.rng import capture_rng_state, restore_rng_state

# lm_eval's result keys are "<metric>,<filter>"; the default filter's suffix is dropped from the event
DEFAULT_FILTER = ",none"


class TaskEval:
    def __init__(self, tasks: list[str], include_path: str | None, limit: int | None, tokenizer, dims=None):
        if dims is not None and (dims.pp > 1 or dims.cp > 1 or dims.ep > 1):
            raise ValueError(
                "train.eval_tasks runs each rank's whole model: it needs parallel.pp, cp and ep of 1 "
                f"(got pp {dims.pp}, cp {dims.cp}, ep {dims.ep}); score a checkpoint with python -m k3train.lm_eval"
            )
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local tasks only: nothing is downloaded
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from lm_eval.tasks import TaskManager
        except ImportError as exc:
            raise ValueError(
                f"train.eval_tasks needs lm-evaluation-harness ({exc}): pip install 'k3train[eval]'"
            ) from None
        if include_path is not None and not Path(include_path).is_dir():
            raise ValueError(f"train.eval_tasks_include_path={include_path} is not a directory of task YAMLs")
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        self.tasks, self.limit, self.tokenizer = list(tasks), limit, tokenizer
        # The local YAMLs alone first: indexing lm_eval's own ~15,000 tasks takes 10-30 s, at start-up and again
        # in every rank; only a task the local folder lacks needs them.
        self.manager = None
        if include_path is not None:
            self.manager = TaskManager(include_path=include_path, include_defaults=False)
        if self.manager is None or any(t not in self.manager.all_tasks for t in self.tasks):
            self.manager = TaskManager(include_path=include_path)
        unknown = [t for t in self.tasks if t not in self.manager.all_tasks]
        if unknown:
            where = f" or in {include_path}" if include_path else " (train.eval_tasks_include_path: local YAMLs)"
            broken = _unparsable_yamls(Path(include_path)) if include_path else []
            why = "".join(f"; {path} does not parse ({error})" for path, error in broken)  # lm_eval skips them
            raise ValueError(f"train.eval_tasks: no task named {', '.join(unknown)} in lm_eval{where}{why}")
        self._task_dict()  # reads every task's data now: a missing file is refused before the run starts

    def _task_dict(self) -> dict:
        from lm_eval.tasks import get_task_dict

        try:
            with _bars_held_back():
                if hasattr(self.manager, "load"):  # lm_eval 0.4.10 on; get_task_dict before
                    return self.manager.load(self.tasks)
                return get_task_dict(self.tasks, self.manager)
        except Exception as exc:  # datasets' and lm_eval's own errors, of many types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"train.eval_tasks: reading the tasks' data failed: {first}") from None

    @torch.no_grad()
    def __call__(self, model, max_length: int, precision, device: torch.device) -> dict[str, dict[str, float]]:
        """{task: {metric: value}} for the model as it is now; its mode and all RNG states are left as they were."""
        from lm_eval import evaluator

        from k3train.inference.lm_eval import K3TrainLM

        was_training, rng = model.training, capture_rng_state()
        model.eval()
        try:
            lm = K3TrainLM.from_model(model, self.tokenizer, max_length=max_length)
            with precision.autocast(device), _bars_held_back():
                out = evaluator.evaluate(
                    lm, self._task_dict(), limit=self.limit, bootstrap_iters=0, log_samples=False, verbosity="ERROR"
                )
        finally:
            restore_rng_state(rng)
            model.train(was_training)
        return {task: scores(out["results"][task]) for task in self.tasks}

    def describe(self) -> str:
        limit = f", the first {self.limit} examples of each" if self.limit else ""
        return f"downstream tasks: {', '.join(self.tasks)}{limit}"


def _unparsable_yamls(folder: Path) -> list[tuple[Path, str]]:
    """The task YAMLs under folder that YAML cannot read (lm_eval's own tags, !function and the like, allowed), each
    with the first line of why: lm_eval leaves such a file out without a word, so its task looks missing."""
    import yaml

    class TaskLoader(yaml.SafeLoader):
        pass

    TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
    broken = []
    for path in sorted(folder.rglob("*.yaml")):
        try:
            yaml.load(path.read_text(encoding="utf-8"), Loader=TaskLoader)  # noqa: S506 - a SafeLoader subclass
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            broken.append((path, str(exc).strip().splitlines()[0]))
    return broken


@contextlib.contextmanager
def _bars_held_back():
    """lm_eval's and datasets' progress bars (tqdm, on stderr) kept out of the training log: stderr is held while
    the tasks are read or scored, and shown only if that fails."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise


def scores(result: dict) -> dict[str, float]:
    """One task's lm_eval result -> its metrics ('acc': 0.5), without stderrs, aliases and other filters' suffix."""
    out = {}
    for key, value in result.items():
        if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool) or "_stderr" in key:
            continue
        out[key.removesuffix(DEFAULT_FILTER)] = float(value)
    return out
