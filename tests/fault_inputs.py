"""Bad input, each class once: the exit status, the key words of the message, no traceback, and nothing of the
user's changed: every file already in the run directory (.hydra/ included) keeps its sha256, nothing is added,
and a run that never started leaves no directory behind.

Shared by tests/test_fault_inputs.py and benchmarks/fault_trials.py (which counts the classes tried)."""

from __future__ import annotations

import hashlib
import importlib.util
import pickle
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import fault_harness as fh
import torch

# The finished run every "existing" case starts from (a copy of it): smoke_test_lm, 2 steps.
TEMPLATE = [
    "model=smoke_test_lm",
    "train.batch_size=2",
    "train.seq_len=32",
    "train.log_interval=1",
    "train.eval_batches=1",
    "train.progress=lines",
    "schedule.warmup_steps=1",
    "train.max_steps=2",
]


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root (hidden files and .hydra/ included)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class _RunsCode:
    """A pickle that would create a file if unpickling ran code (weights_only must refuse it)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _corrupt(run: Path, work: Path) -> None:
    (run / "last.pt").write_bytes(bytes(range(256)) * 64)


def _truncate(run: Path, work: Path) -> None:
    data = (run / "last.pt").read_bytes()
    (run / "last.pt").write_bytes(data[: len(data) // 2])


def _foreign(run: Path, work: Path) -> None:
    torch.save({"state_dict": {"weight": torch.zeros(3)}}, run / "last.pt")


def _malicious(run: Path, work: Path) -> None:
    with open(run / "last.pt", "wb") as f:
        pickle.dump({"meta": _RunsCode(work / "pwned")}, f)


@dataclass
class BadInput:
    name: str
    args: list[str]  # overrides; {run} is the run directory, {other} another finished run's directory
    status: int
    words: list[str]  # each must appear in stderr (or stdout, for a run that exits 0)
    existing: bool = False  # start from a copy of a finished run (else: a run directory that does not exist)
    damage: Callable[[Path, Path], None] | None = None  # edits the copied run before the attempt
    env: dict = field(default_factory=dict)
    template: list[str] = field(default_factory=lambda: list(TEMPLATE))
    locked: bool = False  # a live writer holds the run directory during the attempt
    needs: str = ""  # a module of the branch that implements the refusal, until it is merged

    def missing(self) -> str:
        """Why this case cannot pass here yet ('' when it can)."""
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return f"needs {self.needs} (branch i9: optimizer settings checked, naming the key)"
        return ""


I9 = "k3train.optim.checks"
BAD_INPUTS = [
    BadInput("unknown key", ["train.batch_szie=4"], 2, ["batch_szie"]),
    BadInput("unknown key added with +", ["+train.max_stpes=5"], 2, ["max_stpes"]),
    BadInput("bad type", ["train.seed=x"], 2, ["seed", "x"]),
    BadInput("unknown config group option", ["optim=sgd"], 2, ["optim", "sgd"]),
    BadInput("missing data path", ["data=prepared", "data.path=/nonexistent/data"], 2, ["/nonexistent/data"]),
    BadInput("data=prepared without data.path", ["data=prepared"], 2, ["data.path"]),
    BadInput("missing resume checkpoint", ["resume=/nonexistent/last.pt"], 2, ["/nonexistent/last.pt"]),
    BadInput("train.device=cuda on CPU", ["train.device=cuda"], 2, ["train.device=cuda", "CUDA is not available"]),
    BadInput("train.max_steps=0", ["train.max_steps=0"], 2, ["max_steps"]),
    BadInput("optim.lr=nan", ["optim.lr=nan"], 2, ["optim.lr"], needs=I9),
    BadInput("optim.lr=inf", ["optim.lr=inf"], 2, ["optim.lr"], needs=I9),
    BadInput("optim.lr<0", ["optim.lr=-0.001"], 2, ["optim.lr"], needs=I9),
    BadInput("seq_len over the model's max_seq_len", ["train.seq_len=8192"], 2, ["max_seq_len"]),
    BadInput("guard.window shorter than its warm-up", ["guard.window=10"], 2, ["guard.window=10", "guard.warmup=20"]),
    BadInput("guard threshold <= 0", ["guard.loss_threshold=0"], 2, ["guard.loss_threshold=0 must be > 0"]),
    BadInput(
        "guard=rewind without checkpoints",
        ["guard=rewind", "train.checkpoint_interval=0"],
        2,
        ["guard=rewind", "train.checkpoint_interval=0"],
    ),
    BadInput("malformed kda_mla_ratio", ["model=k3_tiny", "model.kda_mla_ratio=abc"], 2, ["must look like '3:1'"]),
    BadInput("WORLD_SIZE=2 without RANK", [], 2, ["WORLD_SIZE=2 is set but RANK is not"], env={"WORLD_SIZE": "2"}),
    BadInput("corrupt checkpoint", ["resume=auto"], 2, ["last.pt", "cannot be read"], existing=True, damage=_corrupt),
    BadInput(
        "truncated checkpoint", ["resume=auto"], 2, ["last.pt", "cannot be read"], existing=True, damage=_truncate
    ),
    BadInput("foreign checkpoint", ["resume=auto"], 2, ["not a k3train checkpoint"], existing=True, damage=_foreign),
    BadInput(
        "checkpoint whose unpickling runs code", ["resume=auto"], 2, ["last.pt"], existing=True, damage=_malicious
    ),
    BadInput(
        "incompatible checkpoint (model and recipe)",
        ["resume=auto", "model.d_model=32", "train.batch_size=3"],
        2,
        ["d_model was 64, now 32", "global_batch_size was 2, now 3"],
        existing=True,
    ),
    BadInput(
        "fresh run into an existing run's directory", [], 2, ["already holds a run", "resume=auto"], existing=True
    ),
    BadInput(
        "another run's checkpoint into an existing run's directory",
        ["resume={other}/last.pt"],
        2,
        ["already holds a run"],
        existing=True,
    ),
    BadInput(
        "second writer on a locked run directory",
        ["resume=auto", "train.max_steps=4"],
        2,
        ["{run}"],
        existing=True,
        locked=True,
    ),
    BadInput("resume=auto of a finished run", ["resume=auto"], 0, ["finished"], existing=True),
]


def make_template(work: Path, cache: Path) -> Path:
    """The finished run that "existing" cases copy (made once)."""
    run_dir = work / "template"
    if not (run_dir / "last.pt").exists():
        proc = fh.run([*TEMPLATE, f"hydra.run.dir={run_dir}"], work / "logs" / "template", cache)
        if proc.popen.returncode != 0:
            raise RuntimeError(f"template run failed:\n{proc.stderr()}")
    return run_dir


def run_bad_input(case: BadInput, work: Path, cache: Path) -> tuple[list[str], int]:
    """Attempt the bad input; returns the problems found (none: refused cleanly, nothing touched) and the number
    of files that were there before and are changed or gone (damaged)."""
    template = make_template(work, cache)
    home = work / re.sub(r"[^A-Za-z0-9]+", "_", case.name).strip("_")  # a path Hydra's override grammar takes
    run_dir = home / "run"
    home.mkdir(parents=True)
    if case.existing:
        shutil.copytree(template, run_dir)
        if case.damage:
            case.damage(run_dir, work)
    args = [a.format(run=run_dir, other=template) for a in [*case.template, *case.args]]
    writer = _hold(run_dir, home, cache) if case.locked else None
    before = snapshot(home)
    try:
        proc = fh.run([*args, f"hydra.run.dir={run_dir}"], work / "logs" / home.name, cache, env=case.env)
        after = snapshot(home)
    finally:
        if writer is not None:
            (work / "handshake" / home.name / "go-step-3").touch()
            writer.wait()
    problems = []
    if writer is not None and writer.popen.returncode != 0:
        problems.append(f"the first writer failed after the second was refused:\n{writer.stderr()[-1500:]}")
    rc, out, err = proc.popen.returncode, proc.stdout(), proc.stderr()
    if rc != case.status:
        problems.append(f"exit {rc}, want {case.status}")
    text = out + err if case.status == 0 else err
    missing = [w for w in case.words if w.format(run=run_dir) not in text]
    if missing:
        problems.append(f"message lacks {missing}")
    if "Traceback" in err:
        problems.append("a traceback instead of a one-line error")
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        problems.append(f"files changed or added: {changed}")
    if not case.existing and run_dir.exists():
        problems.append(f"a run that never started left {run_dir} behind: {sorted(snapshot(run_dir))}")
    if (work / "pwned").exists():
        problems.append("loading the checkpoint ran code from it")
    if problems:
        problems.append(f"stderr: {err[-1500:]}")
    return problems, sum(after.get(k) != v for k, v in before.items())


def _hold(run_dir: Path, home: Path, cache: Path) -> fh.Proc:
    """A live writer of run_dir, paused at step 3 (it holds the run directory as any running run would)."""
    handshake = home.parent / "handshake" / home.name
    handshake.mkdir(parents=True)
    writer = fh.Proc(
        [*TEMPLATE, "train.max_steps=4", "resume=auto", f"hydra.run.dir={run_dir}"],
        home.parent / "logs" / f"{home.name}-writer",
        cache,
        fault="pause_step:3",
        handshake=handshake,
    )
    if not fh.wait_until(lambda: (handshake / "paused-step-3").exists(), writer):
        raise RuntimeError(f"the first writer never reached step 3:\n{writer.stderr()}")
    time.sleep(0.1)
    return writer
