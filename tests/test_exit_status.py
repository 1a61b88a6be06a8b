"""Every CLI exits 2 on bad input, with one line on stderr (`<prog>: error: ...`) and no traceback, and leaves
what the user has as it was (docs/errors.md). Exit 1 (a failure during the work) is tested where each failure is:
tests/test_run_dir.py (a full disk in training), tests/test_cli.py (divergence).

Each case is a subprocess that imports torch; all of them start at once (the `finished` fixture), so the file
takes about as long as the slowest one and the cores, not the sum."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocess CLI runs

REPO = Path(__file__).resolve().parents[1]
PREPARE_SCRIPT = Path(sys.executable).parent / "k3train-prepare"  # the console script pip installed


@dataclass
class Case:
    prog: str  # how its error line starts: "<prog>: error: "
    argv: list[str]  # after `python`; {tmp} is a directory of this case's own, {input} a text file
    words: list[str]  # each must appear in the error line
    one_line: bool = True
    kept: list[str] = field(default_factory=list)  # files under {tmp} that must keep their content
    absent: list[str] = field(default_factory=list)  # paths under {tmp} that must not appear


CASES = {
    "k3train missing resume checkpoint": Case(
        "k3train",
        ["-m", "k3train", "resume={tmp}/nope/last.pt", "hydra.run.dir={tmp}/run"],
        ["{tmp}/nope/last.pt"],
        absent=["run"],
    ),
    # Hydra reports a config it cannot compose itself, on several lines (its message is kept as it is).
    "k3train unknown config key": Case(
        "k3train", ["-m", "k3train", "train.batch_szie=4", "hydra.run.dir={tmp}/run"], ["batch_szie"], one_line=False
    ),
    "generate missing source": Case(
        "k3train.generate", ["-m", "k3train.generate", "{tmp}/nope", "--prompt", "hi"], ["{tmp}/nope"]
    ),
    "evaluate missing source": Case("k3train.evaluate", ["-m", "k3train.evaluate", "{tmp}/nope"], ["{tmp}/nope"]),
    "export missing source": Case(
        "k3train.export", ["-m", "k3train.export", "{tmp}/nope", "{tmp}/out"], ["{tmp}/nope"], absent=["out"]
    ),
    "export into an existing directory": Case(
        "k3train.export",
        ["-m", "k3train.export", "{tmp}/nope", "{tmp}/mine"],
        ["{tmp}/mine", "already exists"],
        kept=["mine/notes.txt"],
    ),
    # refused before the source is opened: no shard holds a tensor in no bytes
    "export --shard-size 0": Case(
        "k3train.export",
        ["-m", "k3train.export", "{tmp}/nope", "{tmp}/out", "--format", "hf", "--shard-size", "0"],
        ["--shard-size '0'", "above zero"],
        absent=["out"],
    ),
    "consolidate missing checkpoint": Case(
        "k3train.consolidate", ["-m", "k3train.consolidate", "{tmp}/nope"], ["{tmp}/nope"]
    ),
    "report missing run": Case("k3train.report", ["-m", "k3train.report", "{tmp}/nope"], ["{tmp}/nope"]),
    "tokenizer vocabulary under the bytes": Case(
        "tokenizer",
        ["-m", "k3train.tokenizer", "train", "{input}", "--vocab-size", "200", "--out", "{tmp}/tok.json"],
        ["200", "256 byte tokens", "at least 257"],
        absent=["tok.json"],
    ),
    "ladder with one rung": Case(
        "ladder",
        ["-m", "k3train.ladder", "{tmp}/ladder", "--widths", "64", "--lrs", "1e-2", "--steps", "5"],
        ["--widths=64", "at least 2"],
        absent=["ladder"],
    ),
    "mup on a model family without it": Case(
        "k3train",
        ["-m", "k3train", "model=dense_peer", "model.parametrization=mup", "hydra.run.dir={tmp}/run"],
        ["model.parametrization", "no muP parametrization"],
        absent=["run"],
    ),
    "mup_check on a model family without it": Case(
        "mup_check", ["-m", "k3train.mup_check", "--model", "dense_peer", "--out", "{tmp}/out"], ["no muP"]
    ),
    "prepare missing input": Case(
        "prepare",
        ["-m", "k3train.prepare", "{tmp}/nope.jsonl", "--output", "{tmp}/out"],
        ["{tmp}/nope.jsonl", "does not exist"],
        absent=["out"],
    ),
    "prepare into an existing directory": Case(
        "prepare",
        ["-m", "k3train.prepare", "{input}", "--output", "{tmp}/mine", "-q"],
        ["{tmp}/mine", "already exists"],
        kept=["mine/notes.txt"],
    ),
    "k3train-prepare missing input": Case(
        "prepare", [str(PREPARE_SCRIPT), "{tmp}/nope.txt", "--output", "{tmp}/out"], ["{tmp}/nope.txt"]
    ),
}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> dict[str, tuple[Case, Path, subprocess.CompletedProcess, dict[str, str]]]:
    """Start every case at once, then wait for each: name -> (case with {tmp} filled, tmp, result, kept sha256)."""
    root = tmp_path_factory.mktemp("exit-status")
    text = root / "input.txt"
    text.write_text("a few words of text\n" * 50)
    env = {**os.environ, "K3TRAIN_CACHE": str(root / "cache"), "PYTHONUNBUFFERED": "1"}
    started = {}
    for i, (name, case) in enumerate(CASES.items()):
        tmp = root / f"case{i}"
        (tmp / "mine").mkdir(parents=True)
        (tmp / "mine" / "notes.txt").write_text("the user's own file\n")
        fill = lambda s, tmp=tmp: s.replace("{tmp}", str(tmp)).replace("{input}", str(text))  # noqa: E731
        case = Case(case.prog, [fill(a) for a in case.argv], [fill(w) for w in case.words], **_rest(case))
        argv = case.argv if case.argv[0] == str(PREPARE_SCRIPT) else [sys.executable, *case.argv]
        if argv[0] == str(PREPARE_SCRIPT) and not PREPARE_SCRIPT.exists():
            continue
        kept = {k: sha(tmp / k) for k in case.kept}
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started[name] = (case, tmp, proc, kept)
    done = {}
    for name, (case, tmp, proc, kept) in started.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[name] = (case, tmp, subprocess.CompletedProcess(proc.args, proc.returncode, out, err), kept)
    return done


def _rest(case: Case) -> dict:
    return {"one_line": case.one_line, "kept": case.kept, "absent": case.absent}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_with_one_error_line(finished, name):
    if name not in finished:
        pytest.skip(f"{PREPARE_SCRIPT} is not installed (pip install -e .)")
    case, tmp, proc, kept = finished[name]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    if case.one_line:
        assert len(lines) == 1 and lines[0].startswith(f"{case.prog}: error: "), proc.stderr
    assert all(word in proc.stderr for word in case.words), proc.stderr
    assert proc.stdout == "", proc.stdout
    assert {k: sha(tmp / k) for k in kept} == kept  # nothing the user had is changed
    assert not any((tmp / p).exists() for p in case.absent)
