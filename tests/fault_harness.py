"""Fault trials: kill, signal or starve a training run in a subprocess, resume it, and check nothing was lost.

Shared by the fault suite (tests/test_fault_*.py, pytest marker `fault`) and its long mode
(benchmarks/fault_trials.py). A trial never asserts: it returns the problems it found, so the long mode can count
them and the suite can fail on them. Faults come from tests/fault_entry.py, never from the product.

What a resumed run must show, against an uninterrupted run of the same command:
  - bitwise-equal final model, optimizer (state and param_groups, lr included), scaler, trainer counters,
    loader cursors, schedule plan and RNG state;
  - the same loss at every step, each step's counting train event identified by read_metrics(final_only=True);
  - after every kill: every checkpoint loads (weights_only), run.json parses, metrics.jsonl reads;
  - at the end: no temporary file left in the run directory.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3train.files import TEMP_GLOB

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "tests" / "fault_entry.py"

MAX_STEPS = 8
SHAPE = [
    "train.batch_size=2",
    "train.seq_len=32",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.eval_batches=1",
    "train.progress=lines",
    "schedule.warmup_steps=2",
    "train.deterministic=true",
    f"train.max_steps={MAX_STEPS}",
]
# k3_tiny shrunk, with Muon + AdamW and a QK-Clip threshold that clips: optimizer state, Quantile Balancing
# buffers and QK-Clip's weight edits all have to survive a kill.
K3_TINY = [
    "model=k3_tiny",
    "optim=muon_adamw",
    "model.d_model=64",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.kda_chunk_size=16",
    "callbacks.qk_clip.tau=0.05",
]
MODELS = {
    "smoke_test_lm": ["model=smoke_test_lm"],
    "k3_tiny": K3_TINY,
    # guard=rewind over a window this short trips on k3_tiny's own early gradient norms (7.6 and 6.8 robust sigmas at
    # step 4): with checkpoint_interval 1 the run rewinds twice to step 3, with 5 it skips twice (no checkpoint is
    # good yet). A kill can land in a rewind, a skip or the last_good link, and resume=auto must still end bitwise.
    "k3_tiny_guarded": [
        *K3_TINY,
        "guard=rewind",
        "guard.warmup=3",
        "guard.window=6",
        "guard.good_after=1",
    ],
    # train.checkpoint_async: each checkpoint copied at the boundary and written by a background thread, renamed
    # into place at a later boundary; a kill lands mid-write, between write and rename, or in the rename itself
    "k3_tiny_async": [*K3_TINY, "train.checkpoint_async=true"],
    "smoke_async": ["model=smoke_test_lm", "train.checkpoint_async=true"],
    # data=mixture: every source's cursor, the batch counter and the dropped sources have to survive a kill too (two
    # sources over the built-in corpus, each with its own cursor, at 1:3)
    "smoke_mixture": [
        "model=smoke_test_lm",
        "data=mixture",
        "data.sources=[{name:a,path:null},{name:b,path:null}]",
        "data.weights=[0.25,0.75]",
    ],
}
# kill_trials' (the mixture's is the suite's own)
KILL_MODELS = ("smoke_test_lm", "k3_tiny", "k3_tiny_guarded", "k3_tiny_async")
KILL_KINDS = ("random", "after_step", "temp_file")
TIMEOUT = 300


def command(model: str, interval: int) -> list[str]:
    return [*MODELS[model], *SHAPE, f"train.checkpoint_interval={interval}"]


def temp_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob(TEMP_GLOB))


# ---- processes --------------------------------------------------------------------------------------------
class Proc:
    """A k3train process with its output in files (a pipe nobody reads could block it)."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        cache: Path,
        fault: str = "",
        handshake: Path | None = None,
        env: dict | None = None,
        entry: list[str] | None = None,
    ):
        self.log = log
        env = {
            **os.environ,
            "K3TRAIN_CACHE": str(cache),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "K3TRAIN_FAULT": fault,
            "K3TRAIN_FAULT_DIR": str(handshake or ""),
            **(env or {}),
        }
        entry = entry or ([str(ENTRY)] if fault else ["-m", "k3train"])
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
            self.popen = subprocess.Popen([sys.executable, *entry, *args], cwd=REPO, env=env, stdout=out, stderr=err)
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise

    def stdout(self) -> str:
        return Path(f"{self.log}.out").read_text(errors="replace")

    def stderr(self) -> str:
        return Path(f"{self.log}.err").read_text(errors="replace")


def run(args: list[str], log: Path, cache: Path, env: dict | None = None) -> Proc:
    proc = Proc(args, log, cache, env=env)
    proc.wait()
    return proc


def wait_until(condition, proc: Proc, timeout: float = TIMEOUT) -> bool:
    """True once condition() holds; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if not proc.alive():
            return condition()
        time.sleep(0.005)
    raise TimeoutError(f"{proc.log}: condition not reached in {timeout}s")


def train_events_since(path: Path, offset: int) -> list[dict]:
    """Complete train events appended after byte offset (a torn last line is not yet an event)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().split(b"\n")[:-1]
    out = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "train":
            out.append(event)
    return out


# ---- checks -----------------------------------------------------------------------------------------------
def checkpoint_step(run_dir: Path) -> int:
    path = run_dir / "last.pt"
    return torch.load(path, weights_only=True)["trainer"]["step"] if path.exists() else 0


def check_loadable(run_dir: Path, checkpoints: str = "*.pt") -> list[str]:
    """Every checkpoint (`checkpoints`: their names' pattern; "*.dcp" for sharded ones) loads with the product's
    loader (weights_only), run.json parses, metrics.jsonl reads."""
    from k3train.checkpoint.checkpointer import load_checkpoint
    from k3train.observe.metrics import read_metrics

    problems = []
    for path in sorted(run_dir.glob(checkpoints)):
        try:
            load_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            problems.append(f"unloadable checkpoint {path.name}: {type(exc).__name__}: {exc}")
    if (run_dir / "run.json").exists():
        try:
            json.loads((run_dir / "run.json").read_text())
        except ValueError as exc:
            problems.append(f"unreadable run.json: {exc}")
    if (run_dir / "metrics.jsonl").exists():
        try:
            read_metrics(run_dir / "metrics.jsonl")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"unreadable metrics.jsonl: {type(exc).__name__}: {exc}")
    return problems


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def final_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of each step's counting train event; raises if a step has none or two."""
    from k3train.observe.metrics import read_metrics

    events = read_metrics(run_dir / "metrics.jsonl", final_only=True)
    steps = [e["step"] for e in events if e["event"] == "train"]
    if sorted(steps) != sorted(set(steps)):
        raise AssertionError(f"steps with more than one counting train event: {sorted(steps)}")
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


def compare_to_baseline(baseline: Path, run_dir: Path) -> list[str]:
    """Bitwise equality of the final state and the per-step losses; no temp file left."""
    problems = []
    a = torch.load(baseline / "last.pt", weights_only=True)
    try:
        b = torch.load(run_dir / "last.pt", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        return [f"final last.pt unloadable: {type(exc).__name__}: {exc}"]
    for part in ("model", "scaler", "trainer", "train_loader", "val_loader", "plan"):
        if not _equal(a[part], b[part]):
            differ = [k for k in a[part] if not _equal(a[part][k], b[part].get(k))]
            problems.append(f"{part} differs from the uninterrupted run: {differ[:5]}")
    if a["optimizer"]["param_groups"] != b["optimizer"]["param_groups"]:  # lr, initial_lr, ... exactly
        problems.append("optimizer param_groups (lr included) differ from the uninterrupted run")
    if not _equal(a["optimizer"]["state"], b["optimizer"]["state"]):
        problems.append("optimizer state tensors differ from the uninterrupted run")
    if not _equal(a["rng"], b["rng"]):
        problems.append("RNG state differs from the uninterrupted run")
    try:
        want, got = final_losses(baseline), final_losses(run_dir)
        if got != want:
            problems.append(f"per-step losses differ: {sorted(set(want.items()) ^ set(got.items()))[:6]}")
        if sorted(got) != list(range(1, MAX_STEPS + 1)):
            problems.append(f"counting train events for steps {sorted(got)}, want 1..{MAX_STEPS}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"metrics.jsonl: final events not identifiable: {type(exc).__name__}: {exc}")
    if temp_files(run_dir):
        problems.append(f"temporary files left: {[p.name for p in temp_files(run_dir)]}")
    problems += check_loadable(run_dir)
    return problems


# ---- baselines ----------------------------------------------------------------------------------------------
@dataclass
class Baseline:
    run_dir: Path
    wall_s: float


def make_baseline(model: str, interval: int, work: Path, cache: Path) -> Baseline:
    run_dir = work / f"baseline-{model}-{interval}"
    t0 = time.monotonic()
    proc = run([*command(model, interval), f"hydra.run.dir={run_dir}"], work / "logs" / run_dir.name, cache)
    if proc.popen.returncode != 0:
        raise RuntimeError(f"baseline {run_dir.name} failed:\n{proc.stderr()}")
    return Baseline(run_dir, time.monotonic() - t0)


# ---- SIGKILL trials -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KillTrial:
    model: str
    interval: int
    kind: str  # random: at a random time; after_step: once step N is logged; temp_file: while last.pt's temp exists
    seed: int

    @property
    def name(self) -> str:
        return f"{self.model}-ckpt{self.interval}-{self.kind}-seed{self.seed}"

    def run(self, baseline: Baseline, work: Path, cache: Path) -> TrialResult:
        return run_kill_trial(self, baseline, work, cache)


@dataclass
class TrialResult:
    name: str
    kills_tried: int = 0
    kills_landed: int = 0
    bitwise: bool = False
    notes: list[str] = field(default_factory=list)  # where each kill landed
    problems: list[str] = field(default_factory=list)
    damaged: int = 0  # files a fault left unusable (must stay 0)
    skipped: str = ""  # why the trial could not run here


def kill_trials(seeds: range, models: tuple[str, ...] = KILL_MODELS) -> list[KillTrial]:
    return [KillTrial(m, i, k, s) for s in seeds for m in models for i in (1, 5) for k in KILL_KINDS]


def _checkpoints_ahead(step: int, interval: int) -> int:
    """How many times last.pt is written after step (interval saves before the end, then the final one)."""
    return sum(1 for s in range(step + 1, MAX_STEPS) if s % interval == 0) + 1


def _kill_once(
    trial: KillTrial,
    rng: random.Random,
    baseline: Baseline,
    run_dir: Path,
    work: Path,
    cache: Path,
    n: int,
    result: TrialResult,
) -> None:
    args = [*command(trial.model, trial.interval), "resume=auto", f"hydra.run.dir={run_dir}"]
    log = work / "logs" / f"{trial.name}-kill{n}"
    resumed_at = checkpoint_step(run_dir)
    metrics = run_dir / "metrics.jsonl"
    offset = metrics.stat().st_size if metrics.exists() else 0
    handshake = work / "handshake" / f"{trial.name}-{n}"
    handshake.mkdir(parents=True, exist_ok=True)
    if trial.kind == "temp_file":
        k = rng.randint(1, _checkpoints_ahead(resumed_at, trial.interval))
        proc = Proc(args, log, cache, fault=f"pause_replace:{k}", handshake=handshake)
        paused = wait_until(lambda: (handshake / f"paused-replace-{k}").exists(), proc)
        if paused and not temp_files(run_dir):
            result.problems.append(f"kill {n}: paused in the checkpoint rename but no temp file exists")
        where = f"in checkpoint write {k} after step {resumed_at}"
    elif trial.kind == "after_step" and resumed_at + 1 < MAX_STEPS:
        step = rng.randint(resumed_at + 1, MAX_STEPS - 1)
        proc = Proc(args, log, cache)
        wait_until(lambda: any(e["step"] >= step for e in train_events_since(metrics, offset)), proc)
        where = f"after step {step}"
    else:  # random (or no step left to land after): any time from start-up to the uninterrupted run's end
        delay = rng.uniform(0.0, baseline.wall_s)
        proc = Proc(args, log, cache)
        wait_until(lambda: time.monotonic() - proc.started >= delay, proc)
        where = f"at {delay:.2f}s"
    result.kills_tried += 1
    if proc.alive():
        proc.popen.send_signal(signal.SIGKILL)
    rc = proc.wait()
    if rc == -signal.SIGKILL:
        result.kills_landed += 1
        result.notes.append(f"kill {n} {where}: landed, last.pt at step {checkpoint_step(run_dir)}")
    elif rc == 0:
        result.notes.append(f"kill {n} {where}: missed (the run had finished)")
    else:
        result.problems.append(f"kill {n}: exit {rc} before the kill:\n{proc.stderr()[-2000:]}")
    damage = check_loadable(run_dir)
    result.damaged += len(damage)
    result.problems += [f"after kill {n}: {p}" for p in damage]


def run_kill_trial(trial: KillTrial, baseline: Baseline, work: Path, cache: Path) -> TrialResult:
    """One or two seeded SIGKILLs, then `resume=auto` to the end; compare with the uninterrupted run."""
    rng = random.Random(trial.name)
    result = TrialResult(trial.name)
    run_dir = work / trial.name
    for n in range(1, rng.choice((1, 2)) + 1):
        _kill_once(trial, rng, baseline, run_dir, work, cache, n, result)
    args = [*command(trial.model, trial.interval), "resume=auto", f"hydra.run.dir={run_dir}"]
    return finish_and_compare(args, baseline, run_dir, work / "logs" / f"{trial.name}-final", cache, result)


def finish_and_compare(
    args: list[str],
    baseline: Baseline,
    run_dir: Path,
    log: Path,
    cache: Path,
    result: TrialResult,
    launch=None,
    compare=None,
) -> TrialResult:
    """resume=auto to the end (`launch(args, log, cache)`: a Proc, one process unless given), then the comparison
    with the uninterrupted run (`compare(baseline_dir, run_dir)`: compare_to_baseline unless given)."""
    final = (launch or Proc)(args, log, cache)
    if final.wait() != 0:
        result.problems.append(f"resume=auto exited {final.popen.returncode}:\n{final.stderr()[-2000:]}")
        return result
    mismatch = (compare or compare_to_baseline)(baseline.run_dir, run_dir)
    result.bitwise = not mismatch
    result.problems += mismatch
    return result


# ---- SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT trials -------------------------------------------------------------------
@dataclass(frozen=True)
class SignalTrial:
    sig: signal.Signals
    second: bool  # a second signal while the stop's checkpoint (or the step's interval one) is being written
    model: str
    interval: int
    step: int  # the first signal arrives at the boundary after this step

    @property
    def name(self) -> str:
        return f"{self.model}-ckpt{self.interval}-{self.sig.name}-{'twice' if self.second else 'once'}-step{self.step}"

    def run(self, baseline: Baseline, work: Path, cache: Path) -> TrialResult:
        return run_signal_trial(self, baseline, work, cache)


SIGNAL_TRIALS = [
    SignalTrial(signal.SIGTERM, False, "smoke_test_lm", 5, 3),
    SignalTrial(signal.SIGUSR1, False, "k3_tiny", 1, 4),
    SignalTrial(signal.SIGTERM, True, "k3_tiny", 5, 6),  # the second signal in the stop's own checkpoint write
    SignalTrial(signal.SIGUSR1, True, "smoke_test_lm", 1, 3),  # ... in the interval checkpoint of that step
    SignalTrial(signal.SIGUSR2, False, "smoke_test_lm", 5, 4),  # submitit's time-limit / preemption warning
    SignalTrial(signal.SIGINT, False, "k3_tiny", 5, 3),  # Ctrl-C at a terminal
    SignalTrial(signal.SIGINT, True, "smoke_test_lm", 1, 3),  # Ctrl-C twice: out at once, the last checkpoint kept
]


def run_signal_trial(trial: SignalTrial, baseline: Baseline, work: Path, cache: Path) -> TrialResult:
    """Signal at the boundary after `step`: the run checkpoints there and ends by the signal. With `second`, a
    second signal arrives while that checkpoint's temp file exists: the process ends at once, the previous
    last.pt is kept. Either way resume=auto then finishes bitwise-equal to the uninterrupted run."""
    sig, second, model, interval, step = trial.sig, trial.second, trial.model, trial.interval, trial.step
    name = trial.name
    result = TrialResult(name)
    run_dir, handshake = work / name, work / "handshake" / name
    handshake.mkdir(parents=True, exist_ok=True)
    args = [*command(model, interval), "resume=auto", f"hydra.run.dir={run_dir}"]
    # the stop's checkpoint is the rename after the interval saves up to step (none if step itself saved)
    writes = step // interval + (1 if step % interval else 0)
    fault = f"pause_step:{step}" + (f",pause_replace:{writes}" if second else "")
    proc = Proc(args, work / "logs" / name, cache, fault=fault, handshake=handshake)
    if not wait_until(lambda: (handshake / f"paused-step-{step}").exists(), proc):
        result.problems.append(f"never reached step {step}:\n{proc.stderr()[-2000:]}")
        return result
    result.kills_tried += 1
    proc.popen.send_signal(sig)
    (handshake / f"go-step-{step}").touch()
    kept_step = step - step % interval if step % interval else step - interval
    if second:
        if not wait_until(lambda: (handshake / f"paused-replace-{writes}").exists(), proc):
            result.problems.append(f"the stop's checkpoint write was never reached:\n{proc.stderr()[-2000:]}")
            return result
        if not temp_files(run_dir):
            result.problems.append("paused in the checkpoint rename but no temp file exists")
        result.kills_tried += 1
        proc.popen.send_signal(sig)
    rc = proc.wait()
    if rc != -sig:
        result.problems.append(f"exit {rc}, want {-sig} (ended by {sig.name}):\n{proc.stderr()[-2000:]}")
    else:
        result.kills_landed += 1 + second
    if "Traceback" in proc.stderr():
        result.problems.append(f"a traceback on stderr:\n{proc.stderr()[-2000:]}")
    if sig == signal.SIGINT:  # a person at a terminal: one line saying what happened and what is kept
        said = (
            f"k3train: interrupted at step {step}; last.pt of step {kept_step} is kept"
            if second
            else (f"k3train: stopped by Ctrl-C at step {step} with a checkpoint")
        )
        if said not in proc.stderr():
            result.problems.append(f"stderr does not say {said!r}:\n{proc.stderr()[-2000:]}")
    want_step = kept_step if second else step
    if checkpoint_step(run_dir) != want_step:
        result.problems.append(f"last.pt at step {checkpoint_step(run_dir)}, want {want_step}")
    if not second:
        from k3train.observe.metrics import read_metrics

        end = read_metrics(run_dir / "metrics.jsonl")[-1]
        if end.get("event") != "end" or end.get("reason") != f"signal:{sig.name}":
            result.problems.append(f"last event {end}, want end reason signal:{sig.name}")
    result.notes.append(f"{sig.name} after step {step}" + (" and again in the checkpoint write" if second else ""))
    damage = check_loadable(run_dir)
    result.damaged += len(damage)
    result.problems += damage
    return finish_and_compare(args, baseline, run_dir, work / "logs" / f"{name}-final", cache, result)


# ---- running many ---------------------------------------------------------------------------------------------
def run_trials(trials: list, work: Path, cache: Path, jobs: int = 2) -> dict[str, TrialResult]:
    """Baselines first, then the trials, `jobs` at a time (each is a few subprocesses); name -> result."""
    from concurrent.futures import ThreadPoolExecutor

    makers = {(t.model, t.interval): getattr(t, "baseline", None) for t in trials}  # a trial kind's own, if any
    keys = sorted(makers)

    def baseline(key: tuple[str, int]) -> Baseline:
        model, interval = key
        return makers[key](interval, work, cache) if makers[key] else make_baseline(model, interval, work, cache)

    with ThreadPoolExecutor(jobs) as pool:
        baselines = dict(zip(keys, pool.map(baseline, keys)))

        def one(trial) -> TrialResult:
            try:
                return trial.run(baselines[trial.model, trial.interval], work, cache)
            except Exception as exc:  # noqa: BLE001 - a hung or crashed trial is a finding, not the end
                return TrialResult(trial.name, problems=[f"{type(exc).__name__}: {exc}"])

        return {r.name: r for r in pool.map(one, trials)}


# ---- a full disk ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiskTrial:
    """The disk fills during a checkpoint write: `enospc` makes the writer raise ENOSPC half-way (always
    possible); `tmpfs` runs in a real tmpfs sized so the second checkpoint cannot fit (needs mount rights).
    The run must end with exit 1 and one line (what failed, what was kept, what to do), keep a loadable
    checkpoint and no temporary file, and resume=auto (with space again) must end bitwise."""

    kind: str  # enospc | tmpfs
    model: str = "smoke_test_lm"
    interval: int = 1
    failing_write: int = 4  # enospc: the checkpoint write that fails

    @property
    def name(self) -> str:
        return f"{self.model}-ckpt{self.interval}-full-disk-{self.kind}"

    def run(self, baseline: Baseline, work: Path, cache: Path) -> TrialResult:
        result = TrialResult(self.name)
        if self.kind == "enospc":
            return self._fill(work / self.name, baseline, work, cache, result, fault=f"enospc:{self.failing_write}")
        mount = work / self.name
        mount.mkdir()
        size = (baseline.run_dir / "last.pt").stat().st_size * 3 // 2 + 128 * 1024  # one checkpoint, not two
        try:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                check=True,
                capture_output=True,
                text=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            result.skipped = (
                f"cannot mount a tmpfs here ({getattr(exc, 'stderr', '') or exc}); the enospc trial covers a full disk"
            )
            return result
        try:
            return self._fill(mount / "run", baseline, work, cache, result, remount=str(mount))
        finally:
            subprocess.run(["umount", str(mount)], check=False)

    def _fill(
        self,
        run_dir: Path,
        baseline: Baseline,
        work: Path,
        cache: Path,
        result: TrialResult,
        fault: str = "",
        remount: str = "",
    ) -> TrialResult:
        args = [*command(self.model, self.interval), "resume=auto", f"hydra.run.dir={run_dir}"]
        proc = Proc(args, work / "logs" / self.name, cache, fault=fault, handshake=work)
        rc, err = proc.wait(), proc.stderr()
        result.kills_tried += 1
        lines = [line for line in err.splitlines() if line.strip()]
        if rc != 1:
            result.problems.append(f"exit {rc}, want 1")
        else:
            result.kills_landed += 1
        if "Traceback" in err or len([line for line in lines if "error" in line.lower()]) != 1:
            result.problems.append("want one error line, no traceback")
        for words in ("No space left on device", "kept", "resume=auto"):
            if words not in err:
                result.problems.append(f"the message lacks {words!r}")
        if not (run_dir / "last.pt").exists():
            result.problems.append("no checkpoint kept")
        if temp_files(run_dir):
            result.problems.append(f"temporary files left: {[p.name for p in temp_files(run_dir)]}")
        damage = check_loadable(run_dir)
        result.damaged += len(damage)
        result.problems += damage
        if result.problems:
            result.problems.append(f"stderr: {err[-2000:]}")
        result.notes.append(f"disk full; last.pt kept at step {checkpoint_step(run_dir)}")
        if remount:  # space again
            subprocess.run(["mount", "-o", "remount,size=256m", remount], check=True)
        return finish_and_compare(args, baseline, run_dir, work / "logs" / f"{self.name}-final", cache, result)


DISK_TRIALS = [DiskTrial("enospc"), DiskTrial("tmpfs"), DiskTrial("enospc", model="smoke_async")]
