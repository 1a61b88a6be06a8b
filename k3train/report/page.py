"""The report's HTML page: one file that holds everything it shows (the PNGs embedded, inline style), each figure
linked to its PNG file beside the page."""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path

from k3train.observe.sweep_table import cells, columns, sources, to_html
from k3train.report.figures import Chart
from k3train.report.runs import Run, Sweep

STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1100px; }
table { border-collapse: collapse; font-size: 0.9em; margin-bottom: 1em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin-bottom: 1em; }
.note { color: #666; font-style: italic; }
figcaption { color: #333; max-width: 60em; margin-bottom: 1.5em; }
"""


def _figure(chart: Chart, href: str) -> str:
    if chart.png is None:
        return f'<p class="note">{html.escape(chart.title)}: {html.escape(chart.note)}</p>\n'
    data = base64.b64encode(chart.png).decode()
    note = f'<p class="note">{html.escape(chart.note)}</p>\n' if chart.note else ""
    caption = f"<figcaption>{html.escape(chart.caption)}</figcaption>" if chart.caption else ""
    return (
        f'<figure><a href="{html.escape(href)}"><img src="data:image/png;base64,{data}" '
        f'alt="{html.escape(chart.title)}"></a>{note}{caption}</figure>\n'
    )


def _runs_table(runs: list[Run]) -> str:
    names = sources([r.row for r in runs])
    header = "".join(f"<th>{html.escape(h)}</th>" for h in ["run", *columns([r.row for r in runs]), "torn lines"])
    rows = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(c)}</td>" for c in [r.label, *cells(r.row, [], Path(), names), str(r.torn)])
        + "</tr>\n"
        for r in runs
    )
    return f"<table>\n<tr>{header}</tr>\n{rows}</table>\n"


def render(
    *,
    paths: list[Path],
    sweeps: list[Sweep],
    runs: list[Run],
    overlay: tuple[Chart, str] | None,
    charts: list[tuple[Run, list[tuple[Chart, str]]]],
) -> str:
    """The page: the runs, each sweep's table, the overlay of every run, then each run's figures. Figures come as
    (chart, the PNG's path relative to the page)."""
    head = (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>k3train report</title>'
        f"<style>{STYLE}</style></head><body>\n<h1>k3train report</h1>\n"
        f"<p>{html.escape(', '.join(str(p) for p in paths))}; drawn {time.strftime('%Y-%m-%d %H:%M:%S %Z')}</p>\n"
    )
    parts = [head, "<h2>Runs</h2>\n", _runs_table(runs)]
    for sweep in sweeps:
        parts += [
            f"<h2>Sweep {html.escape(str(sweep.sweep_dir))}</h2>\n",
            "<p>Best final val loss first (also in sweep_summary.md and sweep_summary.csv there). A val loss is over "
            "the first train.eval_batches batches of the val split (val tokens); <code>python -m k3train.evaluate"
            "</code> reads the whole split by default, so its number for the same checkpoint differs.</p>\n",
            to_html(sweep.keys, sweep.rows, sweep.sweep_dir),
        ]
    if overlay:
        parts += ["<h2>Every run</h2>\n", _figure(*overlay)]
    for run, run_charts in charts:
        parts.append(f"<h2>{html.escape(run.label)}</h2>\n<p>{html.escape(str(run.run_dir))}</p>\n")
        if not run.events:
            parts.append('<p class="note">no events yet (metrics.jsonl is missing or empty)</p>\n')
        parts += [_figure(chart, href) for chart, href in run_charts]
    parts.append("</body></html>\n")
    return "".join(parts)
