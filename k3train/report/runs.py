"""What the report draws from: the runs behind the paths it is given, read as they are on disk.

A path is a run directory (it holds metrics.jsonl or run.json) or a sweep directory (job directories 0/, 1/, ...
that Hydra or k3train wrote into; sweep_table.find_jobs). Events come from read_metrics(final_only=True): a torn
last line is skipped and counted, and a step that a resumed session redid counts once, so finished, running and
crashed runs read the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from k3train.observe.metrics import read_metrics
from k3train.observe.run_manifest import read_run_json
from k3train.observe.sinks import scalar
from k3train.observe.sweep_table import JobRow, find_jobs, read_job, table_order, varying_keys


class NotARunError(ValueError):
    """A path the report cannot use; the message is the one line to show."""


@dataclass
class Run:
    run_dir: Path
    label: str  # how figures and the page name the run: a sweep job's differing overrides, else its path
    events: list[dict]
    torn: int  # lines of metrics.jsonl skipped as not valid JSON (a kill mid-write)
    row: JobRow  # the run's line of a sweep table: end reason, val losses, tokens, tokens/s
    config: dict = field(default_factory=dict)  # run.json's resolved config (empty before run.json exists)

    def setting(self, *keys: str):
        """A value of the resolved config (e.g. "train", "grad_clip"), or None when the run has no such setting."""
        node = self.config
        for key in keys:
            if not isinstance(node, dict):
                return None
            node = node.get(key)
        return node


@dataclass
class Sweep:
    sweep_dir: Path
    keys: list[str]  # the overrides that differ between its jobs
    rows: list[JobRow]  # best final val loss first
    runs: list[Run]  # in the rows' order


def series(events: list[dict], event: str, *path: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of one figure over the events of one kind: path walks into nested dicts (e.g. "lr", "adamw_embed");
    events without the figure are left out, non-finite values kept (matplotlib leaves a gap)."""
    xs, ys = [], []
    for e in events:
        if e.get("event") != event or scalar(e.get(x)) is None:
            continue
        value = e
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        y = scalar(value)
        if y is not None:
            xs.append(scalar(e[x]))
            ys.append(y)
    return xs, ys


def keys_of(events: list[dict], event: str, *path: str) -> list[str]:
    """The keys of a dict figure (e.g. the lr of every param group), in the order they first appear."""
    seen: dict[str, None] = {}
    for e in events:
        if e.get("event") != event:
            continue
        value = e
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, dict):
            seen.update(dict.fromkeys(value))
    return list(seen)


def is_run_dir(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "run.json").is_file()


def load_run(run_dir: Path, label: str | None = None) -> Run:
    metrics = run_dir / "metrics.jsonl"
    events = read_metrics(metrics, final_only=True) if metrics.is_file() else []
    config = read_run_json(run_dir).get("config") or {}  # {} before run.json exists: figures do without it
    return Run(
        run_dir=run_dir,
        label=label or str(run_dir),
        events=list(events),
        torn=getattr(events, "torn", 0),
        row=read_job(run_dir, events),
        config=config,
    )


def load_sweep(sweep_dir: Path) -> Sweep:
    """Each job read once: its table row comes from the same events its figures draw."""
    runs = sorted((load_run(d) for d in find_jobs(sweep_dir)), key=lambda run: table_order(run.row))
    rows = [run.row for run in runs]
    keys = varying_keys(rows)
    for run in runs:
        label = ", ".join(f"{k}={run.row.overrides[k]}" for k in keys if k in run.row.overrides)
        run.label = f"{run.run_dir.name}: {label}" if label else run.run_dir.name
    return Sweep(sweep_dir=sweep_dir, keys=keys, rows=rows, runs=runs)


def load_path(path: Path) -> Run | Sweep:
    """The run or sweep at path; NotARunError (one line saying what is wrong) when it is neither or has nothing."""
    if not path.exists():
        raise NotARunError(f"{path} does not exist: pass a run directory or a sweep directory")
    if not path.is_dir():
        raise NotARunError(
            f"{path} is not a directory: pass a run directory (the one holding metrics.jsonl), not a file in it"
        )
    if is_run_dir(path):
        run = load_run(path)
        if not run.events:
            raise NotARunError(f"{path} has no events yet (metrics.jsonl is missing or empty): nothing to draw")
        return run
    if find_jobs(path):
        return load_sweep(path)
    what = "is empty" if not any(path.iterdir()) else "holds neither metrics.jsonl/run.json nor job directories"
    raise NotARunError(
        f"{path} {what}: pass a run directory (outputs/runs/<date>/<time>) or a sweep directory "
        f"(outputs/sweeps/<date>/<time>)"
    )


def has_values(ys: list[float]) -> bool:
    return any(math.isfinite(y) for y in ys)
