"""Fault trials of asynchronous sharded checkpoints: FSDP2 on 2 gloo ranks under torchrun, train.checkpoint_async=true,
so every checkpoint is written by each rank's writer process (DCP's async_save daemon) while training goes on.

A trial SIGKILLs one process of the job, once or twice, then resumes with resume=auto to the end:
  target  rank: one training rank (seeded); torchrun: the launcher; writer: one rank's checkpoint writer process
  moment  random: a seeded time within the uninterrupted run's length; writing: while a checkpoint's temporary
          directory exists (its shards being written, or written and not yet renamed into place)
and must show what fault_harness.py's trials show (the final state and every step's loss bitwise those of the
uninterrupted run, every checkpoint loadable after each kill), and also that nothing is left behind: no temporary
or unnamed directory in the sharded store, and no process of the killed job alive 30 s after it ended (a writer
orphaned by its rank would hold the node; the one exception, noted rather than counted, is a kill while the
writers are still starting, before training: a writer then waits out gloo's rendezvous for its ended peers).
A trial never asserts; it returns the problems it found.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import fault_harness as fh

from k3train.files import TEMP_GLOB

MODEL = "fsdp_async"
RANKS = 2
ARGS = [*fh.K3_TINY, "parallel=fsdp", "train.checkpoint_async=true", "train.cpu_threads=1"]
TARGETS = ("rank", "torchrun", "writer")
MOMENTS = ("random", "writing")
ORPHAN_GRACE_S = 30.0
WRITERS_STARTED = "checkpoint writer processes started"  # rank 0's line once every writer process serves saves


def command(interval: int) -> list[str]:
    return [*ARGS, *fh.SHAPE, f"train.checkpoint_interval={interval}"]


def launch(args: list[str], log: Path, cache: Path) -> fh.Proc:
    """`args` under torchrun with RANKS ranks; the Proc's pid is torchrun's."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", "-m", "k3train"]
    return fh.Proc(args, log, cache, entry=torchrun)


# ---- processes ---------------------------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for task in tasks for c in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; its parent has not reaped it yet


def ranks_of(torchrun: int) -> list[int]:
    return [p for p in children(torchrun) if "k3train" in cmdline(p)]


def writers_of(torchrun: int) -> list[int]:
    """The ranks' checkpoint writer processes (multiprocessing's spawn children; not its resource tracker)."""
    return [p for rank in ranks_of(torchrun) for p in children(rank) if "spawn_main" in cmdline(p)]


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def temp_directories(run_dir: Path, checkpoints_only: bool = False) -> list[Path]:
    """The sharded store's temporary directories: a checkpoint's being written (`checkpoints_only`), or also the
    writer processes' start-up save's."""
    store = run_dir / "dcp"
    found = sorted(p for p in store.glob(TEMP_GLOB) if p.is_dir()) if store.is_dir() else []
    return [p for p in found if p.name.startswith(".step_")] if checkpoints_only else found


# ---- checks -----------------------------------------------------------------------------------------------------
def checkpoint_step(run_dir: Path) -> int:
    from k3train.checkpoint.dcp import safe_load

    last = run_dir / "last.dcp"
    return safe_load(last / "extra.pt")["trainer"]["step"] if last.exists() else 0


def compare_to_baseline(baseline: Path, run_dir: Path) -> list[str]:
    """The final checkpoints read whole, bitwise; the per-step losses; nothing left behind in the store."""
    from k3train.checkpoint.checkpointer import load_checkpoint

    a = load_checkpoint(baseline / "last.dcp")
    try:
        b = load_checkpoint(run_dir / "last.dcp")
    except Exception as exc:  # noqa: BLE001
        return [f"final last.dcp unloadable: {type(exc).__name__}: {exc}"]
    problems = [
        f"{part} differs from the uninterrupted run"
        for part in a
        if part != "meta" and not fh._equal(a[part], b.get(part))
    ]
    want, got = fh.final_losses(baseline), fh.final_losses(run_dir)
    if got != want:
        problems.append(f"per-step losses differ: {sorted(set(want.items()) ^ set(got.items()))[:6]}")
    named = {link.resolve() for link in run_dir.glob("*.dcp")}
    unnamed = [p.name for p in (run_dir / "dcp").iterdir() if p.resolve() not in named]
    if unnamed:
        problems.append(f"temporary or unnamed directories left in dcp/: {unnamed}")
    if fh.temp_files(run_dir):
        problems.append(f"temporary files left: {[p.name for p in fh.temp_files(run_dir)]}")
    return problems + fh.check_loadable(run_dir, "*.dcp")


def make_baseline(interval: int, work: Path, cache: Path) -> fh.Baseline:
    """The uninterrupted run."""
    run_dir = work / f"baseline-{MODEL}-{interval}"
    started = time.monotonic()
    proc = launch([*command(interval), f"hydra.run.dir={run_dir}"], work / "logs" / run_dir.name, cache)
    if proc.wait() != 0:
        raise RuntimeError(f"baseline {run_dir.name} failed:\n{proc.stderr()}")
    return fh.Baseline(run_dir, time.monotonic() - started)


def finish(args: list[str], baseline: fh.Baseline, run_dir: Path, log: Path, cache: Path, result) -> fh.TrialResult:
    """resume=auto to the end under torchrun, then the comparison with the uninterrupted run."""
    return fh.finish_and_compare(args, baseline, run_dir, log, cache, result, launch, compare_to_baseline)


# ---- trials -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedKillTrial:
    target: str
    moment: str
    interval: int
    seed: int
    model: str = MODEL  # fault_harness.run_trials keys baselines by (model, interval)

    @property
    def name(self) -> str:
        return f"{MODEL}-ckpt{self.interval}-{self.target}-{self.moment}-seed{self.seed}"

    baseline = staticmethod(make_baseline)  # fault_harness.run_trials calls it once per interval

    def run(self, baseline: fh.Baseline, work: Path, cache: Path) -> fh.TrialResult:
        rng = random.Random(self.name)
        result = fh.TrialResult(self.name)
        run_dir = work / self.name
        args = [*command(self.interval), "resume=auto", f"hydra.run.dir={run_dir}"]
        for n in range(1, rng.choice((1, 2)) + 1):
            self._kill_once(rng, baseline, args, run_dir, work / "logs" / f"{self.name}-kill{n}", cache, n, result)
        return finish(args, baseline, run_dir, work / "logs" / f"{self.name}-final", cache, result)

    def _victim(self, torchrun: int, rng: random.Random) -> int | None:
        if self.target == "torchrun":
            return torchrun
        pids = sorted(ranks_of(torchrun) if self.target == "rank" else writers_of(torchrun))
        return rng.choice(pids) if pids else None

    def _kill_once(self, rng, baseline, args, run_dir, log, cache, n, result) -> None:
        resumed_at = checkpoint_step(run_dir)
        proc = launch(args, log, cache)
        torchrun = proc.popen.pid
        if self.moment == "writing":  # the first write at or after a seeded step
            step = rng.randint(resumed_at + 1, fh.MAX_STEPS - 1) if resumed_at + 1 < fh.MAX_STEPS else fh.MAX_STEPS
            metrics, offset = run_dir / "metrics.jsonl", _size(run_dir / "metrics.jsonl")
            ready = fh.wait_until(
                lambda: (
                    any(e["step"] >= step for e in fh.train_events_since(metrics, offset))
                    and bool(temp_directories(run_dir, checkpoints_only=True))
                    and self._victim(torchrun, random.Random(0)) is not None
                ),
                proc,
            )
            where = f"while a checkpoint was being written after step {step}"
        else:
            delay = rng.uniform(0.0, baseline.wall_s)
            ready = fh.wait_until(lambda: time.monotonic() - proc.started >= delay, proc)
            ready = ready and fh.wait_until(lambda: self._victim(torchrun, random.Random(0)) is not None, proc)
            where = f"at {delay:.2f}s"
        victim = self._victim(torchrun, rng) if ready and proc.alive() else None
        job = [torchrun, *descendants(torchrun)]
        writers_started = WRITERS_STARTED in proc.stdout()
        result.kills_tried += 1
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
        rc = proc.wait()
        deadline = time.monotonic() + ORPHAN_GRACE_S  # the ranks of a killed torchrun save and end on their own
        while time.monotonic() < deadline and any(alive(p) for p in job):
            time.sleep(0.1)
        for pid in (p for p in job if alive(p)):
            lingered = f"process {pid} still alive {ORPHAN_GRACE_S:.0f} s after the job: {cmdline(pid)[:200]}"
            if writers_started or "spawn_main" not in cmdline(pid) and "resource_tracker" not in cmdline(pid):
                result.problems.append(f"after kill {n}: {lingered}")
            else:  # killed while the writers were starting: it waits in gloo's rendezvous (docs/checkpoints.md)
                result.notes.append(f"after kill {n} during the writers' start-up: {lingered}")
            os.kill(pid, signal.SIGKILL)
        if victim is not None and rc != 0:
            result.kills_landed += 1
            result.notes.append(
                f"kill {n} of the {self.target} {where} (resumed at {resumed_at}): landed, exit {rc}, "
                f"last.dcp at step {checkpoint_step(run_dir)}"
            )
        elif rc == 0:
            result.notes.append(f"kill {n} {where}: missed (the run had finished)")
        else:
            result.problems.append(f"kill {n}: exit {rc} before the kill:\n{proc.stderr()[-2000:]}")
        damage = fh.check_loadable(run_dir, "*.dcp")
        result.damaged += len(damage)
        result.problems += [f"after kill {n}: {p}" for p in damage]


def kill_trials(seeds: range, intervals: tuple[int, ...] = (1, 3)) -> list[ShardedKillTrial]:
    return [ShardedKillTrial(t, m, i, s) for s in seeds for t in TARGETS for m in MOMENTS for i in intervals]


@dataclass(frozen=True)
class ShardedDiskTrial:
    """The disk fills during an asynchronous sharded write: a real tmpfs (needs mount rights) sized so that the
    second checkpoint cannot fit. The writer processes meet ENOSPC; every rank must end with the one-line failure
    (what failed, what was kept, what to do), a loadable last.dcp and no temporary directory; resume=auto, with
    space again, must end bitwise as the uninterrupted run."""

    interval: int = 1
    model: str = MODEL

    @property
    def name(self) -> str:
        return f"{MODEL}-ckpt{self.interval}-full-disk-tmpfs"

    baseline = staticmethod(make_baseline)

    def run(self, baseline: fh.Baseline, work: Path, cache: Path) -> fh.TrialResult:
        result = fh.TrialResult(self.name)
        mount = work / self.name
        mount.mkdir()
        size = sum(f.stat().st_size for f in (baseline.run_dir / "last.dcp").iterdir()) * 3 // 2 + 256 * 1024
        try:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                check=True,
                capture_output=True,
                text=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            result.skipped = f"cannot mount a tmpfs here ({getattr(exc, 'stderr', '') or exc})"
            return result
        try:
            run_dir = mount / "run"
            args = [*command(self.interval), "resume=auto", f"hydra.run.dir={run_dir}"]
            proc = launch(args, work / "logs" / self.name, cache)
            rc, err = proc.wait(), proc.stderr()
            result.kills_tried += 1
            said = [
                line for line in err.splitlines() if line.startswith("k3train: error:") or line.startswith("error:")
            ]
            if rc == 0:
                result.problems.append("the run ended with exit 0 on a full disk")
            else:
                result.kills_landed += 1
            if not said or not all(w in said[0] for w in ("No space left on device", "kept", "resume=auto")):
                result.problems.append(
                    f"want a one-line failure naming the full disk, what was kept and resume=auto; got {said}"
                )
            if not (run_dir / "last.dcp").exists():
                result.problems.append("no checkpoint kept")
            if temp_directories(run_dir) or fh.temp_files(run_dir):
                result.problems.append(f"temporary files left: {temp_directories(run_dir) + fh.temp_files(run_dir)}")
            damage = fh.check_loadable(run_dir, "*.dcp")
            result.damaged += len(damage)
            result.problems += damage
            if result.problems:
                result.problems.append(f"stderr: {err[-2000:]}")
            result.notes.append(f"disk full; last.dcp kept at step {checkpoint_step(run_dir)}")
            subprocess.run(["mount", "-o", "remount,size=256m", str(mount)], check=True)
            return finish(args, baseline, run_dir, work / "logs" / f"{self.name}-final", cache, result)
        finally:
            subprocess.run(["umount", str(mount)], check=False)
