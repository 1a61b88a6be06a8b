"""One figure on matplotlib's Agg canvas for the CLIs that draw one (k3train.ladder, k3train.mup_check): no pyplot,
no display, and no error where matplotlib is not installed (it is the `report` extra), only a line saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def new_figure(path: Path, **kwargs: Any) -> Any | None:
    """A matplotlib Figure (kwargs: Figure's) on an Agg canvas, to be saved to `path`; None, having said that `path`
    is not drawn, where matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(f"no figure: matplotlib is not installed (pip install 'k3train[report]'); {path.name} not drawn")
        return None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig
