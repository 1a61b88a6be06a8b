"""The table of a sweep: one row per job, sorted by final val loss, as markdown and CSV.

A row holds the overrides that differ between the sweep's jobs (the ones every job shares say nothing about the
comparison), how the job ended, its final and best val loss, tokens trained, mean tokens/s and its directory. It is
read from what each job left on disk (.hydra/overrides.yaml, run.json, metrics.jsonl), so it works on finished,
running and crashed jobs alike: a torn last metrics line is skipped and a step a resumed session redid counts once.

    python -m k3train.report.sweep_table SWEEP_DIR     # prints the table, writes SWEEP_DIR/sweep_summary.{md,csv}
"""

from __future__ import annotations

import csv
import fcntl
import html
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from k3train.files import write_atomic
from k3train.observe.metrics import read_metrics
from k3train.observe.run_manifest import RUN_LOCK, read_run_json

SUMMARY_STEM = "sweep_summary"


@dataclass
class JobRow:
    run_dir: Path
    overrides: dict[str, str] = field(default_factory=dict)
    end: str = "not started"  # the last session's end reason, "running", or "stopped without an end" (killed)
    final_val_loss: float | None = None
    best_val_loss: float | None = None
    val_tokens: int | None = None  # what the final val loss averaged over: train.eval_batches' first val batches
    source_val_losses: dict[str, float] = field(default_factory=dict)  # data=mixture: the final val/<source>/loss
    step: int = 0
    tokens: int = 0
    tokens_per_s: float | None = None


def find_jobs(sweep_dir: Path) -> list[Path]:
    """The job directories of a sweep: those Hydra wrote a .hydra/ or k3train a run.json into, in job order."""
    jobs = [d for d in sweep_dir.iterdir() if d.is_dir() and ((d / ".hydra").is_dir() or (d / "run.json").exists())]
    return sorted(jobs, key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))


def read_job(run_dir: Path, events: list[dict] | None = None) -> JobRow:
    """The job's row; events: its metrics.jsonl as read_metrics(final_only=True) gives it, when already read."""
    row = JobRow(run_dir=run_dir, overrides=_overrides(run_dir))
    run = read_run_json(run_dir)
    sessions = (run or {}).get("sessions") or []
    if events is None:
        metrics = run_dir / "metrics.jsonl"
        events = read_metrics(metrics, final_only=True) if metrics.exists() else []
    evals = [e for e in events if e.get("event") == "eval" and isinstance(e.get("loss"), (int, float))]
    if evals:
        row.final_val_loss, row.best_val_loss = evals[-1]["loss"], min(e["loss"] for e in evals)
        row.val_tokens = evals[-1].get("val_tokens")
        row.source_val_losses = {
            key.split("/")[1]: value
            for key, value in evals[-1].items()
            if key.startswith("val/") and key.endswith("/loss")
        }
    progressed = [e for e in events if "step" in e and "tokens" in e]
    if progressed:
        row.step, row.tokens = progressed[-1]["step"], progressed[-1]["tokens"]
    speeds = [e["tokens_per_s"] for e in events if e.get("event") == "train" and e.get("tokens_per_s")]
    if speeds:
        row.tokens_per_s = sum(speeds) / len(speeds)
    if _is_running(run_dir):
        row.end = "running"
    elif sessions:
        row.end = sessions[-1].get("end_reason") or "stopped without an end"
    return row


def varying_keys(rows: list[JobRow]) -> list[str]:
    """Override keys whose value is not the same in every job (a key some jobs lack counts as varying)."""
    keys = sorted({k for r in rows for k in r.overrides})
    return [k for k in keys if len({r.overrides.get(k) for r in rows}) > 1]


def sweep_table(sweep_dir: Path) -> tuple[list[str], list[JobRow]]:
    """The varying override keys and the job rows, best final val loss first (jobs without one last)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"no sweep directory {sweep_dir}: pass the directory a `-m` run printed")
    rows = sorted((read_job(d) for d in find_jobs(sweep_dir)), key=table_order)
    return varying_keys(rows), rows


def table_order(row: JobRow) -> tuple[bool, float]:
    """Sort key: best final val loss first, jobs without a finite one last."""
    return (
        row.final_val_loss is None or not math.isfinite(row.final_val_loss),
        row.final_val_loss if row.final_val_loss is not None else 0.0,
    )


# "val tokens": what each job's val losses measured, the first train.eval_batches batches of the val split (the
# same prefix at every eval), so two jobs compare on the same rows only where it is equal, and `k3train.evaluate`
# (the whole split by default) gives another number for the same checkpoint.
COLUMNS = ["final val loss", "best val loss", "val tokens", "step", "tokens", "tokens/s", "end", "run dir"]


def sources(rows: list[JobRow]) -> list[str]:
    """The mixture sources any job validated alone (data=mixture), in the order they first appear."""
    return list(dict.fromkeys(name for row in rows for name in row.source_val_losses))


def columns(rows: list[JobRow]) -> list[str]:
    """COLUMNS, with each mixture source's final val loss after the mixture's."""
    return [COLUMNS[0], *(f"val {name} loss" for name in sources(rows)), *COLUMNS[1:]]


def cells(row: JobRow, keys: list[str], sweep_dir: Path, names: list[str] = ()) -> list[str]:
    """The row's cells under keys + columns(rows): `names` are the sources of columns(rows)."""

    def number(x: float | None, fmt: str) -> str:
        return "" if x is None else format(x, fmt)

    run_dir = row.run_dir.relative_to(sweep_dir) if row.run_dir.is_relative_to(sweep_dir) else row.run_dir
    return [row.overrides.get(k, "") for k in keys] + [
        number(row.final_val_loss, ".4f"),
        *(number(row.source_val_losses.get(name), ".4f") for name in names),
        number(row.best_val_loss, ".4f"),
        "" if row.val_tokens is None else str(row.val_tokens),
        str(row.step),
        str(row.tokens),
        number(row.tokens_per_s, ".0f"),
        row.end,
        str(run_dir),
    ]


def to_markdown(keys: list[str], rows: list[JobRow], sweep_dir: Path) -> str:
    header, names = keys + columns(rows), sources(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r, keys, sweep_dir, names)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_csv(keys: list[str], rows: list[JobRow], sweep_dir: Path) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(keys + columns(rows))
    writer.writerows(cells(r, keys, sweep_dir, sources(rows)) for r in rows)
    return out.getvalue()


def to_html(keys: list[str], rows: list[JobRow], sweep_dir: Path) -> str:
    header = "".join(f"<th>{html.escape(h)}</th>" for h in keys + columns(rows))
    names = sources(rows)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells(r, keys, sweep_dir, names)) + "</tr>\n"
        for r in rows
    )
    return f"<table>\n<tr>{header}</tr>\n{body}</table>\n"


def edge_notes(keys: list[str], rows: list[JobRow]) -> list[str]:
    """For each swept number (3 values or more among the jobs with a val loss) whose best job (the lowest final val
    loss) took its smallest or largest value: the optimum may lie beyond the grid, so the sweep has not found it."""
    finished = [r for r in rows if r.final_val_loss is not None and math.isfinite(r.final_val_loss)]
    if not finished:
        return []
    best, notes = finished[0], []  # rows are sorted best first
    for key in keys:
        values = {}
        for row in finished:
            try:
                values[row.overrides.get(key)] = float(row.overrides.get(key))
            except (TypeError, ValueError):
                break  # not a number everywhere: no edge to speak of
        else:
            if len(set(values.values())) < 3 or key not in best.overrides:
                continue
            low, high = min(values.values()), max(values.values())
            if values[best.overrides[key]] in (low, high):
                side = "smallest" if values[best.overrides[key]] == low else "largest"
                notes.append(
                    f"best final val loss at {key}={best.overrides[key]}, the {side} value swept "
                    f"({low:g}..{high:g}): the optimum may lie beyond it; extend the grid past it before choosing"
                )
    return notes


# A search's space, written beside its trials by hydra/sweeper=optuna (hydra_plugins/k3train_search/optuna_sweeper.py):
# {key: {"type": "float" | "int", "low", "high", "log"} or {"type": "categorical", "choices"}}.
SEARCH_SPACE = "search_space.json"
RANGE_EDGE = 0.1  # the outer tenth of a range at each end (of its log for a log range) counts as its edge


def range_edge_notes(rows: list[JobRow], space: dict) -> list[str]:
    """For a search: each number whose best job (the lowest final val loss) drew a value in the outer tenth of its
    range: the optimum may lie outside the range searched. A search's extreme draws are not its range's ends, so the
    grid's rule (edge_notes) would not say this."""
    finished = [r for r in rows if r.final_val_loss is not None and math.isfinite(r.final_val_loss)]
    if not finished:
        return []
    best, notes = finished[0], []
    for key, spec in space.items():
        if spec.get("type") == "categorical" or key not in best.overrides:
            continue
        scale = math.log if spec.get("log") else float
        low, high = scale(spec["low"]), scale(spec["high"])
        at = (scale(float(best.overrides[key])) - low) / (high - low)
        if at <= RANGE_EDGE or at >= 1 - RANGE_EDGE:
            side = "lower" if at <= RANGE_EDGE else "upper"
            notes.append(
                f"best final val loss at {key}={best.overrides[key]}, near the {side} end of its search range "
                f"({spec['low']:g}..{spec['high']:g}): the optimum may lie outside it; widen the range there"
            )
    return notes


def write_sweep_summary(sweep_dir: Path, table: tuple[list[str], list[JobRow]] | None = None) -> str:
    """Write SWEEP_DIR/sweep_summary.md and .csv (each atomically) and return the markdown table, with a note under
    it for a best value at the edge of its grid (edge_notes) or of a search's range (range_edge_notes); `table`
    (keys, rows) when the caller has read the jobs already."""
    sweep_dir = Path(sweep_dir)
    keys, rows = table if table is not None else sweep_table(sweep_dir)
    markdown = to_markdown(keys, rows, sweep_dir)
    space_file = sweep_dir / SEARCH_SPACE
    notes = (
        range_edge_notes(rows, json.loads(space_file.read_text())) if space_file.exists() else edge_notes(keys, rows)
    )
    if notes:
        markdown += "\n" + "".join(f"**Note:** {note}.\n" for note in notes)
    for suffix, text in ((".md", markdown), (".csv", to_csv(keys, rows, sweep_dir))):
        write_atomic(sweep_dir / f"{SUMMARY_STEM}{suffix}", lambda f, text=text: f.write(text.encode()))
    return markdown


def _overrides(run_dir: Path) -> dict[str, str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        listed = yaml.safe_load(path.read_text()) or []
    except (OSError, yaml.YAMLError):
        listed = (read_run_json(run_dir).get("sessions") or [{}])[0].get("overrides") or []
    pairs = (str(o).split("=", 1) for o in listed if "=" in str(o))
    return {k.lstrip("+~"): v for k, v in pairs if not k.startswith("hydra.")}


def _is_running(run_dir: Path) -> bool:
    """A live k3train process holds the run directory's lock (run/rundir.py)."""
    try:
        with open(run_dir / RUN_LOCK, "rb") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(lock, fcntl.LOCK_UN)
            return False
    except OSError:
        return False  # no lock file: k3train never started here


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m k3train.report.sweep_table SWEEP_DIR", file=sys.stderr)
        return 2
    try:
        print(write_sweep_summary(Path(args[0])), end="")
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
