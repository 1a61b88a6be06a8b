"""`python -m k3train.report PATH... [--out DIR]`: figures, one HTML page and (for a sweep) its table.

With one path the report goes to PATH/report/ unless --out says otherwise; with several, --out is needed. A sweep's
table is written where write_sweep_summary always writes it (SWEEP_DIR/sweep_summary.{md,csv}) and shown on the
page. Every file is written atomically, so a report that fails part way leaves the previous one's files whole.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from k3train.files import write_atomic
from k3train.observe.sweep_table import write_sweep_summary
from k3train.report.figures import MissingMatplotlib, overlay_chart, run_charts
from k3train.report.page import render
from k3train.report.runs import NotARunError, Run, Sweep, load_path

PAGE = "index.html"


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: f.write(data))


def _folders(runs: list[Run]) -> list[str]:
    """Where each run's PNGs go under the report directory: flat for one run, else a folder per run named as its
    directory (a sweep job's number), numbered when two runs' directories share a name."""
    if len(runs) == 1:
        return [""]
    names = [re.sub(r"[^A-Za-z0-9_.-]", "_", run.run_dir.name) for run in runs]
    if len(set(names)) < len(names):
        names = [f"{i:02d}_{name}" for i, name in enumerate(names)]
    return names


def write_report(paths: list[Path], out_dir: Path) -> Path:
    """Read every path (all of them first, so a bad one stops the report before it writes anything), then write
    the PNGs, the sweep tables and out_dir/index.html; returns the page's path."""
    loaded = [load_path(p) for p in paths]
    sweeps = [x for x in loaded if isinstance(x, Sweep)]
    runs = [r for x in loaded for r in (x.runs if isinstance(x, Sweep) else [x])]
    charts = []
    for run, folder in zip(runs, _folders(runs)):
        drawn = []
        for chart in run_charts(run) if run.events else []:
            href = f"{folder}/{chart.name}.png" if folder else f"{chart.name}.png"
            if chart.png is not None:
                _write(out_dir / href, chart.png)
            drawn.append((chart, href))
        charts.append((run, drawn))
    overlay = None
    if len(runs) > 1:
        chart = overlay_chart(runs)
        _write(out_dir / f"{chart.name}.png", chart.png)
        overlay = (chart, f"{chart.name}.png")
    for sweep in sweeps:
        write_sweep_summary(sweep.sweep_dir, (sweep.keys, sweep.rows))  # the rows the page shows
    page = out_dir / PAGE
    _write(page, render(paths=paths, sweeps=sweeps, runs=runs, overlay=overlay, charts=charts).encode())
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3train.report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="run directories or sweep directories")
    parser.add_argument("--out", type=Path, help="the report directory (default with one PATH: PATH/report)")
    args = parser.parse_args(argv)
    if args.out is None and len(args.paths) > 1:
        parser.error("several paths need --out DIR: where to write the report")
    out_dir = args.out or args.paths[0] / "report"
    try:
        page = write_report(args.paths, out_dir)
    except (NotARunError, MissingMatplotlib) as exc:
        print(f"k3train.report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"k3train.report: error: cannot write the report: {exc}", file=sys.stderr)
        return 1
    print(f"report: {page}")
    return 0
