"""The report's figures, one PNG per aspect of a run, drawn on matplotlib's Agg canvas (no pyplot, no display).

matplotlib is imported here only, when a figure is drawn: training and the sweep table never need it. Each Chart
also carries what its PNG shows, read back from the drawn figure's artists (Chart.panels: per panel its axis
labels, y scale, lines with their labels and data, reference lines, texts), so a test checks a figure by its data.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field

from k3train.observe.sinks import scalar
from k3train.report.runs import Run, has_values, keys_of, series

INSTALL_HINT = "pip install 'k3train[report]'"
MOE_KEY = re.compile(r"moe/(?P<layer>[^/]+)/(?P<metric>.+)")
HEALTH_KEY = re.compile(r"(?P<kind>kda|residual)/(?P<layer>[^/]+)/(?P<metric>.+)")
SOURCE_KEY = re.compile(r"(?P<split>train|val)/(?P<source>.+)/loss")


class MissingMatplotlib(ImportError):
    pass


@dataclass(frozen=True)
class Line:
    """One line of a panel as drawn: kind "data" (points at xs, ys), "hline" (across the panel at ys[0], xs empty)
    or "vline" (at xs[0], ys empty). label: the one it was drawn with, None for a line drawn without (matplotlib's
    "_child0", never in a legend)."""

    kind: str
    label: str | None
    xs: list[float]
    ys: list[float]


@dataclass(frozen=True)
class Panel:
    """One subplot of a figure, top to bottom. xlabel is set on the bottom panel only (the panels share x)."""

    xlabel: str
    ylabel: str
    yscale: str  # "linear" or "log"
    lines: list[Line]
    texts: list[str]  # e.g. "no mfu" where a panel has nothing to draw
    top_xlabel: str = ""  # the second x axis above the panel ("tokens" beside "step"), "" without one
    legend_outside: bool = True  # its legend (if any) sits right of the axes, never over the curves

    def line(self, label: str) -> Line:
        """The one line labelled `label`; KeyError naming the panel's labels when there is none or several."""
        found = [line for line in self.lines if line.label == label]
        if len(found) != 1:
            raise KeyError(f"{len(found)} lines labelled {label!r}; labels: {[line.label for line in self.lines]}")
        return found[0]

    def data(self) -> dict[str | None, tuple[list[float], list[float]]]:
        """label -> (xs, ys) of the data lines, in the order drawn."""
        return {line.label: (line.xs, line.ys) for line in self.lines if line.kind == "data"}


@dataclass
class Chart:
    name: str  # the PNG's file stem
    title: str
    png: bytes | None  # None: the run has nothing to draw here, and note says why
    note: str = ""
    panels: list[Panel] = field(default_factory=list)  # what png shows (empty when png is None)
    caption: str = ""  # under the figure on the page: what it shows and what good looks like


def _new_figure(rows: int, title: str):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingMatplotlib(f"the report draws with matplotlib, which is not installed: {INSTALL_HINT}") from exc
    fig = Figure(figsize=(9, 2.6 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)  # Agg renders the PNG whatever backend the environment asks for
    fig.suptitle(title)
    return fig, list(fig.subplots(rows, 1, squeeze=False, sharex=True)[:, 0])


def _floats(values) -> list[float]:
    return [float(v) for v in values]


def _panel(ax) -> Panel:
    top = [child.get_xlabel() for child in ax.child_axes if child.get_xlabel()]
    legend = ax.get_legend()
    outside = legend is None or legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1
    lines = []
    for artist in ax.get_lines():
        label = artist.get_label()
        label = None if label.startswith("_") else label  # matplotlib's own "_child0": drawn without a label
        transform = artist.get_transform()
        if transform is ax.get_yaxis_transform(which="grid"):  # axhline: x across the axes, y in data
            lines.append(Line("hline", label, [], _floats(artist.get_ydata()[:1])))
        elif transform is ax.get_xaxis_transform(which="grid"):  # axvline
            lines.append(Line("vline", label, _floats(artist.get_xdata()[:1]), []))
        else:
            lines.append(Line("data", label, _floats(artist.get_xdata()), _floats(artist.get_ydata())))
    texts = [t.get_text() for t in ax.texts]
    return Panel(ax.get_xlabel(), ax.get_ylabel(), ax.get_yscale(), lines, texts, top[0] if top else "", outside)


def _chart(name: str, title: str, fig, note: str = "") -> Chart:
    """The Chart of a drawn figure: its PNG and, read back from the same figure, what the PNG shows."""
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=90)  # draws it: the legends' places are known after
    panels = [_panel(ax) for ax in fig.axes if ax.get_label() != "<colorbar>" and not _is_secondary(ax)]
    return Chart(name, title, out.getvalue(), note, panels, CAPTIONS.get(name, ""))


def _is_secondary(ax) -> bool:
    return type(ax).__name__ == "SecondaryAxis"


def _line(ax, xs, ys, label, **style) -> None:
    # a single point has no line to show: mark it
    ax.plot(xs, ys, label=label, marker=style.pop("marker", "o" if len(xs) == 1 else None), markersize=3, **style)


def _finish(ax, ylabel: str, *, log: bool = False, legend: bool = True) -> None:
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if log:
        ax.set_yscale("log")
        # plain numbers (0.5, 2, 40) at every labelled tick, not 4x10^0 on one and 10^0 on the next
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if legend and ax.get_legend_handles_labels()[0]:
        # right of the axes, never over the curves (constrained layout makes room for it)
        ncol = 2 if len(ax.get_legend_handles_labels()[0]) > 12 else 1
        ax.legend(fontsize="small", ncol=ncol, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _tokens_axis(ax, run: Run) -> None:
    """A second x axis above `ax`: the tokens trained by each step. A run's tokens per update are fixed (a resume
    must keep the global batch), so the last train event's tokens / step is every step's."""
    steps, tokens = series(run.events, "train", "tokens")
    if not steps or steps[-1] <= 0 or tokens[-1] <= 0:
        return
    per_step = tokens[-1] / steps[-1]
    top = ax.secondary_xaxis("top", functions=(lambda x: x * per_step, lambda x: x / per_step))
    top.set_xlabel("tokens")


def _all_positive(*ys_lists) -> bool:
    values = [y for ys in ys_lists for y in ys if not math.isnan(y)]
    return bool(values) and min(values) > 0


def _per_key_panels(
    run: Run,
    name: str,
    title: str,
    keys: dict[str, dict[str, tuple]],
    note: str,
    baseline: dict[str, float] | None = None,
) -> Chart:
    """One panel per metric, one line per key (a layer, a param group): keys[metric][key] = path into the event."""
    if not keys:
        return Chart(name, title, None, note)
    fig, axes = _new_figure(len(keys), title)
    from matplotlib import colormaps  # there: _new_figure imported matplotlib

    for ax, (metric, lines) in zip(axes, keys.items()):
        drawn = []
        # past the default cycle's 10 colours (a deep model's layers), one colour per line along a colour map
        colours = [colormaps["viridis"](i / (len(lines) - 1)) for i in range(len(lines))] if len(lines) > 10 else []
        for i, (key, path) in enumerate(lines.items()):
            xs, ys = series(run.events, "train", *path)
            _line(ax, xs, ys, key, **({"color": colours[i]} if colours else {}))
            drawn.append(ys)
        if baseline and metric in baseline:
            ax.axhline(baseline[metric], color="grey", ls=":", lw=1)
        _finish(ax, metric, log=_all_positive(*drawn) and metric in ("update_rms", "weight_norm"))
    axes[-1].set_xlabel("step")
    return _chart(name, title, fig)


def loss_chart(run: Run) -> Chart:
    title = "train and val loss"
    train, val = series(run.events, "train", "loss"), series(run.events, "eval", "loss")
    if not train[0] and not val[0]:
        return Chart("loss", title, None, "no train or eval event yet")
    fig, (ax,) = _new_figure(1, title)
    _line(ax, *train, "train (mean since the last log line)")
    _line(ax, *val, "val (the first train.eval_batches val batches)", marker="o")
    for kind, colour, label in (("spike", "orange", "loss spike (guard)"), ("rewind", "purple", "rewind (guard)")):
        steps = [e["step"] for e in run.events if e.get("event") == kind and scalar(e.get("step")) is not None]
        for i, step in enumerate(steps):
            ax.axvline(step, color=colour, ls="--", lw=1, label=label if i == 0 else None)
    _finish(ax, "loss")
    ax.set_xlabel("step")
    _tokens_axis(ax, run)
    return _chart("loss", title, fig)


def lr_chart(run: Run) -> Chart:
    title = "learning rate per param group"
    groups = keys_of(run.events, "train", "lr")
    if not groups:
        return Chart("lr", title, None, "no train event with a learning rate yet")
    fig, (ax,) = _new_figure(1, title)
    styles = ["-", "--", ":", "-."]  # groups often share one schedule: dashes keep every one visible
    for i, group in enumerate(groups):
        _line(ax, *series(run.events, "train", "lr", group), group, ls=styles[i % len(styles)])
    warmup = scalar(run.setting("schedule", "warmup_steps"))
    if warmup:  # the lr is logged every train.log_interval steps: the rise from 0 shows against this line
        ax.axvline(warmup, color="grey", ls=":", lw=1, label=f"warmup ends (schedule.warmup_steps {warmup:g})")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)  # from 0, so that the warmup is seen to start there
    _finish(ax, "lr")
    ax.set_xlabel("step")
    return _chart("lr", title, fig)


def grad_norm_chart(run: Run) -> Chart:
    title = "gradient norm before and after clipping"
    mean, peak = series(run.events, "train", "grad_norm"), series(run.events, "train", "grad_norm_max")
    if not mean[0]:
        return Chart("grad_norm", title, None, "no train event yet")
    clip = scalar(run.setting("train", "grad_clip"))
    fig, (ax,) = _new_figure(1, title)
    _line(ax, *mean, "before clipping: mean over the updates since the last log line")
    _line(ax, *peak, "before clipping: max")
    if clip:  # clip_grads_with_norm_ scales a gradient whose norm exceeds grad_clip down to it
        _line(ax, peak[0], [min(y, clip) for y in peak[1]], "after clipping: max", ls="--")
        ax.axhline(clip, color="grey", ls=":", lw=1, label=f"train.grad_clip {clip:g}")
        note = ""
    else:
        note = "clipping is off (train.grad_clip 0 or null)" if run.config else "no run.json: clip threshold unknown"
    skipped = [e["step"] for e in run.events if e.get("event") == "skip" and scalar(e.get("step")) is not None]
    for i, step in enumerate(skipped):
        ax.axvline(step, color="red", alpha=0.3, lw=1, label="skipped update" if i == 0 else None)
    _finish(ax, "grad norm", log=_all_positive(mean[1], peak[1]))
    ax.set_xlabel("step")
    return _chart("grad_norm", title, fig, note)


def throughput_chart(run: Run) -> Chart:
    title = "throughput and model FLOPs utilisation"
    speed = series(run.events, "train", "tokens_per_s")
    if not speed[0]:
        return Chart("throughput", title, None, "no train event yet")
    mfu = series(run.events, "train", "mfu")
    fig, (top, bottom) = _new_figure(2, title)
    _line(top, *speed, "tokens/s")
    _finish(top, "tokens/s", legend=False)
    if has_values(mfu[1]):
        _line(bottom, mfu[0], [100 * y for y in mfu[1]], "MFU")
        note = ""
    else:
        note = "no mfu: this run's train events carry none"
        bottom.text(0.5, 0.5, "no mfu", ha="center", va="center", transform=bottom.transAxes)
        bottom.set_yticks([])
    _finish(bottom, "MFU (%)", legend=False)
    bottom.set_xlabel("step")
    return _chart("throughput", title, fig, note)


def moe_chart(run: Run) -> Chart:
    panels: dict[str, dict[str, tuple]] = {}
    for key in keys_of(run.events, "train", "model"):
        if m := MOE_KEY.fullmatch(key):
            panels.setdefault(m["metric"], {})[f"layer {m['layer']}"] = ("model", key)
    # load_max / load_min are a layer's busiest and idlest expert over the mean load: 1 is perfect balance
    return _per_key_panels(
        run,
        "moe",
        "MoE load balance per layer",
        panels,
        "no MoE diagnostics in this run (the model has no MoE layer)",
        baseline={"load_max": 1.0, "load_min": 1.0},
    )


def health_chart(run: Run) -> Chart:
    """The health panel's KDA gates (kda/<layer>/<metric>) and the residual stream's RMS after each layer."""
    panels: dict[str, dict[str, tuple]] = {}
    for key in keys_of(run.events, "train", "model"):
        if m := HEALTH_KEY.fullmatch(key):
            metric = "residual RMS" if m["kind"] == "residual" else m["metric"]
            panels.setdefault(metric, {})[f"layer {m['layer']}"] = ("model", key)
    return _per_key_panels(
        run,
        "health",
        "KDA gates and the residual stream per layer",
        panels,
        "no KDA or residual figures in this run (not a KimiK3 model, or a run from before the health panel)",
    )


def qk_clip_chart(run: Run) -> Chart:
    title = "QK-Clip: max attention logit per MLA module, heads clipped"
    modules = keys_of(run.events, "train", "qk_clip", "max_logit")
    if not modules:
        return Chart("qk_clip", title, None, "no QK-Clip figures in this run (callback off, or no MLA module)")
    fig, (top, bottom) = _new_figure(2, title)
    logits = [series(run.events, "train", "qk_clip", "max_logit", module) for module in modules]
    for module, (xs, ys) in zip(modules, logits):
        _line(top, xs, ys, module)
    tau = scalar(run.setting("callbacks", "qk_clip", "tau"))
    if tau:
        top.axhline(tau, color="grey", ls=":", lw=1, label=f"tau {tau:g}")
    # log: logits far below tau stay readable beside it
    _finish(top, "max logit", log=_all_positive(*(ys for _, ys in logits), [tau or 1.0]))
    clipped = series(run.events, "train", "qk_clip", "n_clipped")
    _line(bottom, *clipped, "clipped heads", marker=".")
    bottom.set_ylim(0, 1.1 * max([1.0, *clipped[1]]))  # a count: from 0, whole numbers
    bottom.yaxis.get_major_locator().set_params(integer=True)
    _finish(bottom, "heads clipped\nsince last log", legend=False)
    bottom.set_xlabel("step")
    return _chart("qk_clip", title, fig)


def optimizer_chart(run: Run) -> Chart:
    panels: dict[str, dict[str, tuple]] = {}
    for key in keys_of(run.events, "train", "optimizer"):
        group, _, metric = key.rpartition("/")
        if group and metric != "lr":  # the lr has its own figure
            panels.setdefault(metric, {})[group] = ("optimizer", key)
    panels = dict(sorted(panels.items(), key=lambda kv: kv[0] != "update_rms"))  # Muon's update RMS first
    return _per_key_panels(
        run,
        "optimizer",
        "optimizer: update RMS and weight norm per param group",
        panels,
        "no optimizer diagnostics in this run (the optimizer reports none)",
    )


def tasks_chart(run: Run) -> Chart:
    """train.eval_tasks: one panel per metric (acc, acc_norm, ...), one line per task, by step."""
    title = "downstream tasks (train.eval_tasks)"
    panels: dict[str, dict[str, tuple]] = {}
    for task in keys_of(run.events, "eval_tasks"):
        for metric in keys_of(run.events, "eval_tasks", task):
            panels.setdefault(metric, {})[task] = (task, metric)
    if not panels:
        return Chart("tasks", title, None, "no eval_tasks event (train.eval_tasks is empty)")
    fig, axes = _new_figure(len(panels), title)
    for ax, (metric, lines) in zip(axes, panels.items()):
        for task, path in lines.items():
            _line(ax, *series(run.events, "eval_tasks", *path), task, marker="o")
        _finish(ax, metric)
    axes[-1].set_xlabel("step")
    _tokens_axis(axes[0], run)
    return _chart("tasks", title, fig)


def sources_chart(run: Run) -> Chart:
    """data=mixture: val (top) and train loss per source by step, the mixture's own dashed beside them."""
    title = "loss per source (data=mixture)"
    names = {
        split: [
            m["source"]
            for key in keys_of(run.events, event)
            if (m := SOURCE_KEY.fullmatch(key)) and m["split"] == split
        ]
        for event, split in (("eval", "val"), ("train", "train"))
    }
    if not names["val"] and not names["train"]:
        return Chart("sources", title, None, "no per-source loss (not a data=mixture run)")
    fig, (top, bottom) = _new_figure(2, title)
    for ax, event, split in ((top, "eval", "val"), (bottom, "train", "train")):
        for source in names[split]:
            _line(
                ax,
                *series(run.events, event, f"{split}/{source}/loss"),
                source,
                **({"marker": "o"} if ax is top else {}),
            )
        _line(ax, *series(run.events, event, "loss"), "mixture", color="grey", ls="--")
        _finish(ax, f"{split} loss")
    bottom.set_xlabel("step")
    _tokens_axis(top, run)
    return _chart("sources", title, fig)


# Under each figure on the page: what it shows and what good looks like.
CAPTIONS = {
    "loss": "Train loss (the mean over the updates since the last log line) and val loss (the first "
    "train.eval_batches val batches, the same rows every time) by step; tokens trained on the top axis. Good: both "
    "fall, val staying close to train; val rising while train falls is overfitting. Dashed: updates the guard "
    "judged a spike (orange) and its rewinds (purple, at the spike's step).",
    "lr": "Each param group's learning rate as the schedule sets it, by step, from 0. Groups that share a schedule "
    "lie on each other (dashed to keep each visible); the dotted line is where warmup ends.",
    "grad_norm": "The global gradient norm before clipping (mean and max over the updates since the last log line) "
    "and after it, against train.grad_clip. Early in training the norm is large whatever the lr (a lower lr keeps "
    "it large longer), so clipping most of the first hundreds of updates is normal, and a short sweep in which every "
    "run clips says nothing about which lr is best: compare their losses. Past the early steps, good is mostly below "
    "the threshold; a norm that stays at or rises above it while the loss stalls means the updates are too large. "
    "Red lines: updates skipped, for a non-finite loss or gradient or a spike the guard held back (guard=skip).",
    "throughput": "Tokens per second and model FLOPs utilisation (the model's FLOPs over the device's peak) by step. "
    "Good: flat after the first steps; dips are evaluations, checkpoints or other processes on the machine.",
    "moe": "Per MoE layer, the load of its busiest (load_max) and idlest (load_min) routed expert over the mean "
    "load in the last forward, 1 (dotted) being perfect balance; over the updates since the last log line the "
    "load's coefficient of variation (load_cv), the share of experts no token reached (dead_share) and the "
    "balancing bias's largest move (bias_drift). Quantile Balancing brings load_max and load_min towards 1 (the "
    "quickstart: load_max 2.2-2.5 at step 10, 1.1-1.2 from step 110); a layer stuck far from 1 routes most tokens "
    "to a few experts.",
    "health": "Per KDA layer, over the updates since the last log line: the log decay's mean and minimum (how "
    "fast each channel forgets: 0 keeps everything), the share of channels within 1% of the sigmoid gate's lower "
    "bound (kda_gate=sigmoid only; saturated channels forget almost all each step), and beta's mean (the delta "
    "rule's write strength); and per layer the residual stream's RMS after it. Good: steady curves; an RMS growing "
    "steadily layer over layer or update over update is a stream heading for overflow, a near_lower_bound share "
    "rising towards 1 a layer that has stopped remembering.",
    "qk_clip": "QK-Clip: each MLA module's largest attention logit against tau (dotted), and how many heads were "
    "rescaled since the last log line. Good: logits level off below tau; heads clipped early in training and "
    "rarely after is QK-Clip doing its job.",
    "optimizer": "Per param group, the RMS of the last update (the lr included: it follows the schedule), the "
    "weight norm, and for Muon the Newton-Schulz orthogonality error: max |sigma - 1| over one orthogonalised "
    "update's singular values, measured every orthogonality_check_interval updates. Muon's 5 quintic steps aim "
    "for singular values in about [0.5, 1.5], not exactly 1 (Jordan et al., 2024), so up to ~0.5 is by design; "
    "near 1 is a direction of the momentum with a tiny singular value left small (it gets a small update, "
    "harmless); far above 1, or NaN, is a fault.",
    "tasks": "Each lm-evaluation-harness task of train.eval_tasks, per metric, at every train.eval_tasks_interval "
    "updates and after the last (eval_tasks events). Good: rising from chance (1 / choices for accuracy) as the "
    "loss falls; a few dozen examples give steps of 1 / examples, so read trends, not single points.",
    "sources": "data=mixture: each source's val loss (its own val split, the same rows every time) and train loss "
    "(the mean over its tokens among the updates since the last log line), the mixture's as the dashed line. A "
    "source whose loss stalls while the others fall is one the weights under-feed, or one that is harder.",
    "overlay": "Val (top) and train loss of every run by step, in the sweep table's order (best final val loss "
    "first). Runs compare step for step where they train the same tokens a step.",
}

RUN_CHARTS = [
    loss_chart,
    lr_chart,
    grad_norm_chart,
    throughput_chart,
    moe_chart,
    health_chart,
    qk_clip_chart,
    optimizer_chart,
]


def run_charts(run: Run) -> list[Chart]:
    """RUN_CHARTS' figures, the loss per source for a mixture, and the downstream tasks' where the run scored any
    (train.eval_tasks)."""
    charts = [chart(run) for chart in RUN_CHARTS]
    if (sources := sources_chart(run)).png is not None:
        charts.append(sources)
    if any(e.get("event") == "eval_tasks" for e in run.events):
        charts.append(tasks_chart(run))
    return charts


def overlay_chart(runs: list[Run]) -> Chart:
    """Val and train loss of every run on one pair of axes, in the order given (a sweep's: best val loss first)."""
    title = "val and train loss of every run"
    fig, (top, bottom) = _new_figure(2, title)
    for run in runs:
        val, train = series(run.events, "eval", "loss"), series(run.events, "train", "loss")
        _line(top, *val, run.label, marker="o")
        _line(bottom, *train, run.label)
    _finish(top, "val loss")
    _finish(bottom, "train loss", legend=False)
    bottom.set_xlabel("step")  # runs of one sweep may train different tokens a step: no tokens axis here
    return _chart("overlay", title, fig)
