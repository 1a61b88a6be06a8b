"""`python -m k3train.report`: figures and one page from what runs left on disk (finished, running, crashed, torn,
resumed), a sweep's table and overlay, and one clear line for a path it cannot use."""

import base64
import fcntl
import json
import math
import os
import re
import subprocess
import sys

import pytest

from k3train.observe.metrics import read_metrics
from k3train.report.cli import main, write_report
from k3train.report.figures import (
    RUN_CHARTS,
    grad_norm_chart,
    health_chart,
    loss_chart,
    lr_chart,
    moe_chart,
    optimizer_chart,
    overlay_chart,
    qk_clip_chart,
    run_charts,
    throughput_chart,
)
from k3train.report.runs import load_run, series

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHART_NAMES = ["loss", "lr", "grad_norm", "throughput", "moe", "health", "qk_clip", "optimizer"]


def _train(step, loss, **extra):
    return {
        "event": "train",
        "step": step,
        "tokens": 64 * step,
        "loss": loss,
        "grad_norm": 2.0 + step,
        "grad_norm_max": 3.0 + step,
        "tokens_per_s": 100.0 + step,
        "step_time_s": 0.5,
        "lr": {"muon_hidden": 0.01, "adamw_embed": 0.003},
        "model": {
            **{"moe/1/load_max": 1.5, "moe/1/load_min": 0.5, "moe/2/load_max": 1.2, "moe/2/load_min": 0.8},
            **{"kda/0/beta_mean": 0.4, "residual/0/rms": 1.0 + 0.1 * step},
        },
        "optimizer": {"muon_hidden/update_rms": 1e-3, "muon_hidden/weight_norm": 9.0, "muon_hidden/lr": 0.01},
        "qk_clip": {"max_logit": {"layers.3.mixer": 30.0 + step}, "n_clipped": step % 2, "clipped_heads": {}},
        **extra,
    }


def _run_dir(path, *, mfu=False, running=False):
    """A run killed after step 4 and resumed from its step-2 checkpoint (steps 3-4 redone, with other losses),
    then killed mid-write: the last line is torn."""
    path.mkdir(parents=True)
    extra = {"mfu": 0.25} if mfu else {}
    events = [
        {"event": "session", "session": 0, "step": 0},
        _train(1, 5.0, **extra),
        _train(2, 4.0, **extra),
        {"event": "eval", "step": 2, "tokens": 128, "loss": 4.5},
        _train(3, 9.0, **extra),
        _train(4, 9.0, **extra),
        {"event": "session", "session": 1, "step": 2},
        _train(3, 3.5, **extra),
        {"event": "skip", "step": 3, "tokens": 192, "loss": "nan", "grad_norm": "inf"},
        _train(4, "nan", **extra),
        {"event": "eval", "step": 4, "tokens": 256, "loss": 3.0},
    ]
    text = "".join(json.dumps(e) + "\n" for e in events) + '{"event": "train", "step": 5, "lo'
    (path / "metrics.jsonl").write_text(text)
    config = {"train": {"grad_clip": 1.0}, "callbacks": {"qk_clip": {"tau": 100.0}}}
    session = {"session": 1, "overrides": []} if running else {"session": 1, "overrides": [], "end_reason": "max_steps"}
    (path / "run.json").write_text(json.dumps({"config": config, "sessions": [session]}))
    return path


def _embedded_pngs(page: str) -> dict[str, bytes]:
    """href -> the PNG embedded in the link to it."""
    return {
        href: base64.b64decode(data)
        for href, data in re.findall(r'<a href="([^"]+)"><img src="data:image/png;base64,([^"]+)"', page)
    }


def test_a_resumed_torn_run_reads_one_event_per_step_from_the_later_session(tmp_path):
    run = load_run(_run_dir(tmp_path / "run"))
    assert run.torn == 1
    xs, ys = series(run.events, "train", "loss")
    assert xs == [1, 2, 3, 4] and ys[:3] == [5.0, 4.0, 3.5] and ys[3] != ys[3]  # "nan" read as NaN, not dropped
    assert series(run.events, "train", "lr", "adamw_embed") == ([1, 2, 3, 4], [0.003] * 4)
    assert series(run.events, "eval", "loss", x="tokens") == ([128, 256], [4.5, 3.0])


def test_the_report_of_one_run_draws_every_figure_and_embeds_them_in_one_page(tmp_path, capsys):
    run_dir = _run_dir(tmp_path / "run")
    assert main([str(run_dir)]) == 0
    out = run_dir / "report"
    assert capsys.readouterr().out.strip() == f"report: {out / 'index.html'}"
    page = (out / "index.html").read_text()
    embedded = _embedded_pngs(page)
    assert sorted(embedded) == sorted(f"{name}.png" for name in CHART_NAMES)
    assert sorted(os.listdir(out)) == sorted([*embedded, "index.html"])
    for href, png in embedded.items():
        assert png.startswith(PNG_MAGIC) and len(png) > 5000 and png == (out / href).read_bytes()
    assert "no mfu" in page and ">max_steps<" in page  # the run's end, from run.json
    assert (run_dir / "metrics.jsonl").read_text().endswith('"lo')  # the report only reads the run


def test_mfu_is_drawn_when_the_events_carry_it(tmp_path):
    chart = throughput_chart(load_run(_run_dir(tmp_path / "run", mfu=True)))
    assert chart.png.startswith(PNG_MAGIC) and chart.note == ""


def test_a_running_run_is_reported_as_running(tmp_path):
    run_dir = _run_dir(tmp_path / "run", running=True)
    with open(run_dir / ".lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a live k3train process holds it
        assert load_run(run_dir).row.end == "running"
    assert load_run(run_dir).row.end == "stopped without an end"  # the process died without an end event


def test_a_sweep_with_a_crashed_and_a_not_yet_started_job(tmp_path):
    for job, lr in enumerate(["1e-3", "3e-3"]):
        (_run_dir(tmp_path / str(job), running=job == 1) / ".hydra").mkdir()  # job 1's session has no end...
        (tmp_path / str(job) / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n- train.max_steps=4\n")
    lines = (tmp_path / "1" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "1" / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")  # ...it was killed at step 2
    (tmp_path / "2" / ".hydra").mkdir(parents=True)  # Hydra made the job; k3train has not started it
    (tmp_path / "2" / ".hydra" / "overrides.yaml").write_text("- optim.lr=1e-2\n- train.max_steps=4\n")

    out = tmp_path / "report"
    page = write_report([tmp_path], out).read_text()
    rows = re.findall(r"<tr><td>(\de-\d)</td><td>([\d.]*)</td>(?:<td>[^<]*</td>){5}<td>([^<]*)</td>", page)
    assert rows == [
        ("1e-3", "3.0000", "max_steps"),
        ("3e-3", "4.5000", "stopped without an end"),
        ("1e-2", "", "not started"),
    ]
    assert (tmp_path / "sweep_summary.md").read_text().count("\n") == 5
    embedded = _embedded_pngs(page)
    assert sorted(embedded) == sorted(["overlay.png", *(f"{job}/{n}.png" for job in "01" for n in CHART_NAMES)])
    assert "no events yet" in page  # job 2


def test_several_runs_get_a_folder_each_and_an_overlay(tmp_path):
    a, b = _run_dir(tmp_path / "a" / "run"), _run_dir(tmp_path / "b" / "run", mfu=True)
    out = tmp_path / "out"
    page = write_report([a, b], out).read_text()
    embedded = _embedded_pngs(page)
    assert sorted(embedded) == sorted(["overlay.png", *(f"{d}_run/{n}.png" for d in ("00", "01") for n in CHART_NAMES)])
    assert all(png == (out / href).read_bytes() for href, png in embedded.items())


def _with(name, text, path=""):
    """A maker of a bad path: tmp_path with the file `name` in it; returns tmp_path / path."""
    return lambda p: (p / name).write_text(text) * 0 or p / path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "nope", "does not exist"),
        (lambda p: p, "is empty"),
        (_with("notes.txt", "x"), "holds neither metrics.jsonl/run.json nor job directories"),
        (_with("metrics.jsonl", "", "metrics.jsonl"), "is not a directory"),
        (_with("run.json", "{}"), "has no events yet"),
        (_with("metrics.jsonl", '{"event": "sess'), "has no events yet"),  # only a torn line
    ],
)
def test_a_path_it_cannot_use_is_one_clear_line_and_nothing_is_written(tmp_path, capsys, make, message):
    path = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("k3train.report: error: ")
    assert sorted(tmp_path.rglob("*")) == before


def test_several_paths_need_an_output_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert exit_.value.code == 2 and "several paths need --out DIR" in capsys.readouterr().err


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_without_matplotlib_the_report_says_how_to_install_it_and_training_never_needs_it(tmp_path):
    run_dir = _run_dir(tmp_path / "run")
    proc = _python(
        "import sys; sys.modules['matplotlib'] = None\n"  # as if not installed
        f"from k3train.report.cli import main; sys.exit(main([{str(run_dir)!r}]))"
    )
    assert proc.returncode == 2 and not (run_dir / "report").exists()
    assert proc.stderr == (
        "k3train.report: error: the report draws with matplotlib, which is not installed: "
        "pip install 'k3train[report]'\n"
    )
    proc = _python(
        "import sys, k3train.__main__, k3train.run.runner, k3train.observe.sweep_table\n"
        "assert 'matplotlib' not in sys.modules, 'training imported matplotlib'"
    )
    assert proc.returncode == 0, proc.stderr


def test_every_chart_is_listed_once():
    assert [chart.__name__.removesuffix("_chart") for chart in RUN_CHARTS] == CHART_NAMES


# ---- each figure checked by its data: Chart.panels, read back from the drawn figure, against the events written ----
# A run logged every 10 steps at 4096 tokens a step (so steps, tokens and event indices all differ), every figure
# varying from step to step and from line to line: a figure that plotted tokens for steps, dropped or swapped a
# line, or scaled a value other than as the PNG says fails here.
STEPS = [10, 20, 30, 40, 50]
GRAD_NORMS = [0.8, 1.5, 2.5, 0.9, 4.0]
CLIP, TAU = 2.0, 60.0
GROUPS = ["muon_hidden", "adamw_embed", "adamw_head"]
LAYERS = ["1", "3"]
KDA_LAYERS = ["0", "2"]
MODULES = ["layers.3.mixer", "layers.7.mixer"]


def _known_train(i, step, grad_norm, loss_shift):
    return {
        "event": "train",
        "step": step,
        "tokens": 4096 * step,
        "loss": 6.0 - 0.5 * i + loss_shift,
        "grad_norm": grad_norm,
        "grad_norm_max": 1.5 * grad_norm,
        "tokens_per_s": 1000.0 + 10 * i,
        "mfu": 0.1 + 0.01 * i,
        "lr": {group: (g + 1) * 0.01 * (i + 1) for g, group in enumerate(GROUPS)},
        "model": {
            **{
                f"moe/{layer}/{metric}": 1.0 + sign * (j + 1) * 0.05 * (i + 1)
                for j, layer in enumerate(LAYERS)
                for metric, sign in (("load_max", 1), ("load_min", -1))
            },
            **{f"kda/{layer}/log_decay_mean": -0.5 * (j + 1) - 0.01 * i for j, layer in enumerate(KDA_LAYERS)},
            **{f"kda/{layer}/beta_mean": 0.3 + 0.1 * j + 0.02 * i for j, layer in enumerate(KDA_LAYERS)},
            **{f"residual/{layer}/rms": 1.0 + j + 0.1 * i for j, layer in enumerate(["0", *LAYERS])},
        },
        "optimizer": {
            **{f"{group}/update_rms": (g + 1) * 1e-3 * (i + 1) for g, group in enumerate(GROUPS[:2])},
            **{f"{group}/weight_norm": 10.0 * (g + 1) + i for g, group in enumerate(GROUPS[:2])},
            "muon_hidden/lr": 0.5,  # the lr has its own figure: not drawn here
        },
        "qk_clip": {
            "max_logit": {module: 20.0 * (m + 1) + 5 * i for m, module in enumerate(MODULES)},
            "n_clipped": [0, 1, 0, 2, 0][i],
            "clipped_heads": {},
        },
    }


def _known_run(path, *, grad_norms=GRAD_NORMS, grad_clip=CLIP, mfu=True, loss_shift=0.0):
    """Five train events, two evals and a skipped update, as the trainer writes them; returns (run_dir, events)."""
    path.mkdir(parents=True)
    train = [_known_train(i, step, g, loss_shift) for i, (step, g) in enumerate(zip(STEPS, grad_norms))]
    if not mfu:
        for e in train:
            del e["mfu"]
    evals = [
        {"event": "eval", "step": s, "tokens": 4096 * s, "loss": 5.5 - 0.3 * k + loss_shift}
        for k, s in enumerate([20, 40])
    ]
    skip = {"event": "skip", "step": 25, "tokens": 4096 * 25, "loss": "nan", "grad_norm": "inf"}
    # a spike after step 50, rewound to the step-50 checkpoint itself: no step is redone, every train event counts
    spike = {"event": "spike", "step": 50, "tokens": 4096 * 50, "loss": 9.0, "grad_norm": 20.0, "action": "rewind"}
    rewind = {"event": "rewind", "step": 50, "to": 50, "tokens": 4096 * 50, "rewinds": 1}
    events = [{"event": "session", "session": 0, "step": 0}, *train[:2], evals[0], skip, *train[2:4], evals[1]]
    events += [train[4], spike, rewind]
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    config = {
        "train": {"grad_clip": grad_clip},
        "callbacks": {"qk_clip": {"tau": TAU}},
        "schedule": {"warmup_steps": 15},
    }
    (path / "run.json").write_text(json.dumps({"config": config, "sessions": [{"session": 0, "overrides": []}]}))
    return path, events


def _of(events, kind, *path):
    """Straight from the events written: the value at path of each event of one kind, in order."""
    values = []
    for e in events:
        if e["event"] == kind:
            for key in path:
                e = e[key]
            values.append(e)
    return values


def _chart_of(tmp_path, chart, **kwargs):
    run_dir, events = _known_run(tmp_path / "run", **kwargs)
    return chart(load_run(run_dir)), events


def test_the_loss_figure_draws_train_and_val_loss_against_steps_with_tokens_above(tmp_path):
    chart, events = _chart_of(tmp_path, loss_chart)
    (panel,) = chart.panels
    assert (panel.xlabel, panel.top_xlabel, panel.ylabel, panel.yscale) == ("step", "tokens", "loss", "linear")
    assert panel.data() == {
        "train (mean since the last log line)": (_of(events, "train", "step"), _of(events, "train", "loss")),
        "val (the first train.eval_batches val batches)": (_of(events, "eval", "step"), _of(events, "eval", "loss")),
    }
    assert panel.line("loss spike (guard)").xs == [50] and panel.line("rewind (guard)").xs == [50]
    assert panel.legend_outside


def test_the_health_figure_draws_each_kda_gate_figure_and_the_residual_rms_per_layer(tmp_path):
    chart, events = _chart_of(tmp_path, health_chart)
    assert [p.ylabel for p in chart.panels] == ["log_decay_mean", "beta_mean", "residual RMS"]
    for panel, key, layers in (
        (chart.panels[0], "kda/{}/log_decay_mean", KDA_LAYERS),
        (chart.panels[1], "kda/{}/beta_mean", KDA_LAYERS),
        (chart.panels[2], "residual/{}/rms", ["0", *LAYERS]),
    ):
        assert panel.data() == {
            f"layer {layer}": (STEPS, _of(events, "train", "model", key.format(layer))) for layer in layers
        }


def test_the_lr_figure_draws_every_param_group_against_steps(tmp_path):
    chart, events = _chart_of(tmp_path, lr_chart)
    (panel,) = chart.panels
    assert (panel.xlabel, panel.ylabel, panel.yscale) == ("step", "lr", "linear")
    assert panel.data() == {group: (STEPS, _of(events, "train", "lr", group)) for group in GROUPS}


def test_the_grad_norm_figure_draws_norms_the_clip_and_skipped_updates_on_a_log_axis(tmp_path):
    chart, events = _chart_of(tmp_path, grad_norm_chart)
    (panel,) = chart.panels
    assert (panel.xlabel, panel.ylabel, panel.yscale, chart.note) == ("step", "grad norm", "log", "")
    peak = _of(events, "train", "grad_norm_max")
    assert panel.data() == {
        "before clipping: mean over the updates since the last log line": (STEPS, GRAD_NORMS),
        "before clipping: max": (STEPS, peak),
        "after clipping: max": (STEPS, [min(y, CLIP) for y in peak]),
    }
    assert min(peak) < CLIP < max(peak)  # the clipped line differs from the unclipped one
    assert panel.line("train.grad_clip 2").ys == [CLIP] and panel.line("train.grad_clip 2").kind == "hline"
    assert panel.line("skipped update") == panel.lines[-1]
    assert [(line.kind, line.xs) for line in panel.lines if line.kind == "vline"] == [("vline", [25.0])]


def test_a_grad_norm_of_zero_keeps_the_axis_linear_and_no_clip_draws_no_clipped_line(tmp_path):
    chart, _ = _chart_of(tmp_path, grad_norm_chart, grad_norms=[0.0, *GRAD_NORMS[1:]], grad_clip=0)
    (panel,) = chart.panels
    assert panel.yscale == "linear"  # a log axis cannot show 0
    assert list(panel.data()) == [
        "before clipping: mean over the updates since the last log line",
        "before clipping: max",
    ]
    assert [line.kind for line in panel.lines] == ["data", "data", "vline"]
    assert chart.note == "clipping is off (train.grad_clip 0 or null)"


@pytest.mark.parametrize("mfu", [True, False])
def test_the_throughput_figure_draws_tokens_per_second_and_mfu_in_percent(tmp_path, mfu):
    chart, events = _chart_of(tmp_path, throughput_chart, mfu=mfu)
    top, bottom = chart.panels
    assert (top.ylabel, top.yscale, bottom.xlabel, bottom.ylabel) == ("tokens/s", "linear", "step", "MFU (%)")
    assert top.data() == {"tokens/s": (STEPS, _of(events, "train", "tokens_per_s"))}
    if mfu:
        assert bottom.data() == {"MFU": (STEPS, [100 * y for y in _of(events, "train", "mfu")])}
        assert (bottom.texts, chart.note) == ([], "")
    else:
        assert (bottom.lines, bottom.texts) == ([], ["no mfu"])


def test_the_moe_figure_draws_a_panel_per_metric_and_a_line_per_layer_with_balance_at_1(tmp_path):
    chart, events = _chart_of(tmp_path, moe_chart)
    assert [(p.ylabel, p.yscale) for p in chart.panels] == [("load_max", "linear"), ("load_min", "linear")]
    assert chart.panels[-1].xlabel == "step"
    for panel in chart.panels:
        assert panel.data() == {
            f"layer {layer}": (STEPS, _of(events, "train", "model", f"moe/{layer}/{panel.ylabel}")) for layer in LAYERS
        }
        assert [(line.kind, line.ys) for line in panel.lines if line.kind != "data"] == [("hline", [1.0])]


def test_the_qk_clip_figure_draws_each_modules_max_logit_on_a_log_axis_under_tau_and_the_clipped_heads(tmp_path):
    chart, events = _chart_of(tmp_path, qk_clip_chart)
    top, bottom = chart.panels
    assert (top.ylabel, top.yscale) == ("max logit", "log")
    assert top.data() == {m: (STEPS, _of(events, "train", "qk_clip", "max_logit", m)) for m in MODULES}
    assert top.line("tau 60").kind == "hline" and top.line("tau 60").ys == [TAU]
    assert (bottom.xlabel, bottom.yscale) == ("step", "linear")
    assert bottom.data() == {"clipped heads": (STEPS, _of(events, "train", "qk_clip", "n_clipped"))}


def test_the_optimizer_figure_draws_update_rms_first_then_weight_norm_per_group_on_log_axes(tmp_path):
    chart, events = _chart_of(tmp_path, optimizer_chart)
    assert [(p.ylabel, p.yscale) for p in chart.panels] == [("update_rms", "log"), ("weight_norm", "log")]
    assert chart.panels[-1].xlabel == "step"
    for panel in chart.panels:
        assert panel.data() == {
            group: (STEPS, _of(events, "train", "optimizer", f"{group}/{panel.ylabel}")) for group in GROUPS[:2]
        }


def test_the_overlay_draws_each_runs_val_and_train_loss_against_steps(tmp_path):
    (a, events_a), (b, events_b) = _known_run(tmp_path / "a"), _known_run(tmp_path / "b", loss_shift=1.25)
    top, bottom = overlay_chart([load_run(a, label="run a"), load_run(b, label="run b")]).panels
    assert (top.ylabel, bottom.ylabel, bottom.xlabel) == ("val loss", "train loss", "step")
    for panel, kind in ((top, "eval"), (bottom, "train")):
        assert panel.data() == {
            label: (_of(events, kind, "step"), _of(events, kind, "loss"))
            for label, events in (("run a", events_a), ("run b", events_b))
        }


def test_every_figure_has_steps_below_its_legend_outside_and_a_caption_on_the_page(tmp_path):
    run_dir, _ = _known_run(tmp_path / "run")
    charts = run_charts(load_run(run_dir))
    for chart in charts:
        assert chart.panels[-1].xlabel == "step", chart.name
        assert all(panel.legend_outside for panel in chart.panels), chart.name
        assert len(chart.caption) > 80, chart.name  # what it shows and what good looks like
    assert "orthogonality error" in {c.name: c for c in charts}["optimizer"].caption
    write_report([run_dir], tmp_path / "out")
    page = (tmp_path / "out" / "index.html").read_text()
    assert page.count("<figcaption>") == len(charts) and "what good" not in page  # the captions' own words
    assert "[0.5, 1.5]" in page


def test_a_log_axis_labels_its_ticks_as_plain_numbers():
    """The grad-norm figure's log axis (and every other log axis: _finish) reads 0.5, 1, 2, 20, not 5x10^-1."""
    from matplotlib.figure import Figure

    from k3train.report.figures import _finish

    ax = Figure().subplots()
    ax.plot([1, 2, 3], [0.4, 2.0, 40.0])
    _finish(ax, "grad norm", log=True)
    labels = [ax.yaxis.get_major_formatter()(v, 0) for v in (0.5, 1.0, 2.0, 20.0)]
    assert labels == ["0.5", "1", "2", "20"]
    assert [ax.yaxis.get_minor_formatter()(v, 0) for v in (3.0, 30.0)] == ["", ""]


def test_the_lr_figure_starts_at_0_and_marks_the_end_of_warmup(tmp_path):
    chart, _ = _chart_of(tmp_path, lr_chart)
    (panel,) = chart.panels
    warmups = [line for line in panel.lines if line.kind == "vline"]
    assert len(warmups) == 1 and warmups[0].xs == [15.0]
    assert warmups[0].label == "warmup ends (schedule.warmup_steps 15)"


def test_the_report_writes_the_pngs_whose_data_the_charts_carry(tmp_path):
    run_dir, events = _known_run(tmp_path / "run")
    write_report([run_dir], tmp_path / "out")
    charts = run_charts(load_run(run_dir))
    assert [chart.name for chart in charts] == CHART_NAMES
    for chart in charts:
        assert chart.panels and chart.png == (tmp_path / "out" / f"{chart.name}.png").read_bytes()
    assert charts[1].panels[0].line("adamw_head").ys == _of(events, "train", "lr", "adamw_head")


def test_the_figures_of_a_resumed_torn_run_draw_the_later_sessions_values(tmp_path):
    charts = {chart.name: chart for chart in run_charts(load_run(_run_dir(tmp_path / "run")))}
    xs, ys = charts["loss"].panels[0].data()["train (mean since the last log line)"]
    assert xs == [1, 2, 3, 4] and ys[:3] == [5.0, 4.0, 3.5] and math.isnan(ys[3])  # not step 3's 9.0
    assert charts["lr"].panels[0].data()["adamw_embed"] == ([1, 2, 3, 4], [0.003] * 4)


# ---- in CI: the report on a real quickstart run and a real 4-job sweep ------------------------------------------
SMALL = [
    "experiment=quickstart",
    "train.max_steps=4",
    "train.batch_size=2",
    "train.seq_len=32",
    "train.log_interval=2",
    "train.eval_interval=2",
    "train.eval_batches=1",
    "train.progress=lines",
]


def _report(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "k3train.report", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_report_on_a_quickstart_run(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(*SMALL, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    proc = _report(run_dir)
    assert proc.returncode == 0, proc.stderr
    out = run_dir / "report"
    page = (out / "index.html").read_text()
    for name in CHART_NAMES:  # a k3_tiny run has every figure: MoE layers, MLA with QK-Clip, Muon
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000
        assert _embedded_pngs(page)[f"{name}.png"] == png


@pytest.mark.slow
def test_report_on_a_four_job_sweep(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("K3TRAIN_OUTPUTS", str(tmp_path))
    proc = run_cli("-m", *SMALL, "optim.lr=1e-3,3e-3,1e-2,3e-2")
    assert proc.returncode == 0, proc.stderr
    (sweep,) = tmp_path.glob("sweeps/*/*")
    proc = _report(sweep)
    assert proc.returncode == 0, proc.stderr

    final = {}  # job -> its final val loss, read here from each job's own metrics.jsonl
    for job in ("0", "1", "2", "3"):
        evals = [
            e["loss"] for e in read_metrics(sweep / job / "metrics.jsonl", final_only=True) if e["event"] == "eval"
        ]
        final[job] = evals[-1]
    in_order = sorted(final, key=final.get)
    table = [line for line in (sweep / "sweep_summary.md").read_text().splitlines()[2:] if line.startswith("| ")]
    assert [line.split(" | ")[-1].rstrip(" |") for line in table] == in_order
    assert [float(line.split(" | ")[1]) for line in table] == pytest.approx(sorted(final.values()), abs=1e-4)

    out = sweep / "report"
    page = (out / "index.html").read_text()
    embedded = _embedded_pngs(page)
    assert sorted(embedded) == sorted(["overlay.png", *(f"{job}/{n}.png" for job in final for n in CHART_NAMES)])
    for href, png in embedded.items():
        assert png.startswith(PNG_MAGIC) and len(png) > 5000 and png == (out / href).read_bytes()
    rows = re.findall(r"<tr>(?:<td>[^<]*</td>){7}<td>max_steps</td><td>(\d)</td></tr>", page)
    assert rows == in_order  # the page's sweep table, best val loss first


def test_a_mixture_run_gets_a_loss_per_source_figure_with_each_sources_val_and_train_curves(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    events = [
        _train(1, 5.0, **{"train/web/loss": 4.0, "train/code/loss": 5.5}),
        _train(2, 4.0, **{"train/code/loss": 4.4}),  # no web row in that window: no figure, no point
        {"event": "eval", "step": 2, "tokens": 128, "loss": 4.5, "val/web/loss": 4.1, "val/code/loss": 4.9},
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    run = load_run(path)
    charts = {chart.name: chart for chart in run_charts(run)}
    assert list(charts) == [*CHART_NAMES, "sources"]
    val, train = charts["sources"].panels
    assert val.data() == {"web": ([2], [4.1]), "code": ([2], [4.9]), "mixture": ([2], [4.5])}
    assert train.data() == {"web": ([1], [4.0]), "code": ([1, 2], [5.5, 4.4]), "mixture": ([1, 2], [5.0, 4.0])}
    assert (val.ylabel, train.ylabel) == ("val loss", "train loss")
    # a run of one dataset has none
    assert "sources" not in {chart.name for chart in run_charts(load_run(_run_dir(tmp_path / "plain")))}
