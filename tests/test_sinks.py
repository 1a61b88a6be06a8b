"""The TensorBoard and W&B sinks, each read back from what it wrote; off by default, both at once with
logger=[tensorboard,wandb]."""

import collections
import importlib.util
import json
import math
import struct
import time

import pytest

from k3train.observe.metrics import MetricsLogger, read_metrics
from k3train.observe.sinks import TensorBoardSink, WandbSink, scalars


def _session(path, sinks, start, losses):
    """One session of a run: its session event, a train event per step from start + 1 with these losses, an eval
    and the end, through MetricsLogger as the Trainer logs them."""
    with MetricsLogger(path / "metrics.jsonl", sinks=sinks) as log:
        log.log("session", session=0 if start == 0 else 1, step=start, run_dir=str(path), resume_from=None)
        step = start
        for step, loss in enumerate(losses, start + 1):
            log.log(
                "train",
                step=step,
                tokens=64 * step,
                loss=loss,
                lr={"muon_hidden": 0.01},
                model={"moe/1/load_max": 1.25},
                qk_clip={"max_logit": {"layers.3.mixer": 7.0}, "n_clipped": 0, "clipped_heads": {}},
            )
        log.log("eval", step=step, tokens=64 * step, loss=min(losses) + 0.5, batches=1, val_tokens=64)
        log.log("end", step=step, tokens=64 * step, reason="max_steps", skipped_updates=0)


def test_scalars_are_every_number_tagged_by_event_and_field():
    record = {
        "event": "train",
        "time": 1.0,
        "step": 3,
        "tokens": 192,
        "loss": "nan",
        "lr": {"adamw": 0.5},
        "model": {"moe/1/load_max": 1.5},
        "qk_clip": {"clipped_heads": {"layers.3": [0, 1]}, "n_clipped": 2},
        "flag": True,
        "path": "x",
    }
    values = scalars(record)
    assert math.isnan(values.pop("train/loss"))
    assert values == {
        "train/tokens": 192.0,
        "train/lr/adamw": 0.5,
        "train/model/moe/1/load_max": 1.5,
        "train/qk_clip/n_clipped": 2.0,
    }


def test_a_sink_that_never_wrote_leaves_nothing_and_a_missing_package_is_one_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'k3train[tensorboard]'")
    TensorBoardSink(tmp_path).close()  # a start refused after the sinks were built
    assert list(tmp_path.iterdir()) == []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "wandb" else real_find_spec(name, *args)
    )
    with pytest.raises(
        ImportError,
        match=r"logger=wandb needs the wandb package, which is not installed: "
        r"pip install 'k3train\[wandb\]'",
    ):
        WandbSink(tmp_path)


def test_tensorboard_holds_every_number_and_a_resume_replaces_the_redone_steps(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'k3train[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _session(tmp_path, [TensorBoardSink(tmp_path)], 0, [5.0, 4.0, 9.0, 9.0])  # killed after step 4...
    _session(tmp_path, [TensorBoardSink(tmp_path)], 2, [3.0, 2.0])  # ...resumed from its step-2 checkpoint

    tb = EventAccumulator(str(tmp_path / "tensorboard"))
    tb.Reload()
    loss = [(s.step, s.value) for s in tb.Scalars("train/loss")]
    final = [
        (e["step"], e["loss"])
        for e in read_metrics(tmp_path / "metrics.jsonl", final_only=True)
        if e["event"] == "train"
    ]
    assert loss == final == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0)]  # as metrics.jsonl's final events
    lr = tb.Scalars("train/lr/muon_hidden")  # TensorBoard keeps float32
    assert [s.step for s in lr] == [1, 2, 3, 4] and [s.value for s in lr] == pytest.approx([0.01] * 4)
    assert [s.value for s in tb.Scalars("train/model/moe/1/load_max")] == [1.25] * 4
    assert [(s.step, s.value) for s in tb.Scalars("eval/loss")] == [(4, 2.5)]
    assert {"session", "end"} <= {tag.removesuffix("/text_summary") for tag in tb.Tags()["tensors"]}


def test_only_rank_0_writes(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'k3train[tensorboard]'")
    with MetricsLogger(tmp_path / "metrics.jsonl", sinks=[TensorBoardSink(tmp_path)], enabled=False) as log:
        log.log("train", step=1, tokens=64, loss=5.0)  # as on a rank other than 0
    assert list(tmp_path.iterdir()) == []


def _wandb_env(monkeypatch, tmp_path):
    """W&B offline, quiet, and with its settings and caches under tmp_path rather than the home directory."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": tmp_path / "wb-config",
        "WANDB_CACHE_DIR": tmp_path / "wb-cache",
        "WANDB_DATA_DIR": tmp_path / "wb-data",
    }.items():
        monkeypatch.setenv(name, str(value))


def _wandb_history(path) -> tuple[dict[int, dict], collections.Counter]:
    """step -> the numbers W&B logged at it, read from an offline run's .wandb file. W&B has no public reader of
    that file (wandb sync uploads it; wandb.Api() asks the server), so this reads its record log (the LevelDB log
    format: 32 KiB blocks of chunks, each with a 7-byte header; the file starts with a 7-byte W&B header) and
    decodes each record with the protobuf classes W&B ships (wandb.proto, internal: the test skips without it)."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="wandb's record format is not importable")
    data, pos, pending, history, kinds = path.read_bytes(), 7, b"", {}, collections.Counter()
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            kinds[record.WhichOneof("record_type")] += 1
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                step = record.history.step.num or items.get("_step", 0)  # the step is in both places
                history.setdefault(step, {}).update(items)
    return history, kinds


def test_wandb_writes_an_offline_run_with_every_number_under_the_run_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'k3train[wandb]'")
    _wandb_env(monkeypatch, tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "0123abcd4567", "config": {"optim": {"lr": 0.01}}}))
    _session(tmp_path, [WandbSink(tmp_path)], 0, [5.0, 4.0])

    (files,) = tmp_path.glob("wandb/offline-run-*-0123abcd4567/run-0123abcd4567.wandb")
    # W&B's service process writes the file; twice in CI (loaded machine) it held only its 7-byte header when
    # read at once, so give the writer a deadline before judging what it wrote
    deadline = time.monotonic() + 30
    history, kinds = _wandb_history(files)
    while not history and time.monotonic() < deadline:
        time.sleep(0.5)
        history, kinds = _wandb_history(files)
    # on failure, say what the file held
    assert {step: items.get("train/loss") for step, items in history.items() if step} == {1: 5.0, 2: 4.0}, (
        f"{files.stat().st_size} bytes, records {dict(kinds)}, history {history}"
    )
    assert history[2]["eval/loss"] == 4.5 and history[1]["train/model/moe/1/load_max"] == 1.25
    assert history[2]["train/qk_clip/max_logit/layers.3.mixer"] == 7.0


@pytest.mark.slow
def test_both_sinks_at_once_from_the_command_line(run_cli, tmp_path, monkeypatch):
    for package in ("tensorboard", "wandb"):
        pytest.importorskip(package, reason=f"{package} is not installed: pip install 'k3train[{package}]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _wandb_env(monkeypatch, tmp_path)
    run_dir = tmp_path / "run"
    proc = run_cli(
        "logger=[tensorboard,wandb]",
        "model=smoke_test_lm",
        "train.max_steps=4",
        "train.batch_size=2",
        "train.seq_len=32",
        "train.log_interval=2",
        "train.eval_batches=1",
        "train.progress=lines",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr
    train = [e for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] == "train"]
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [(s.step, s.value) for s in tb.Scalars("train/loss")] == [
        (e["step"], pytest.approx(e["loss"])) for e in train
    ]
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    (files,) = run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    history, _ = _wandb_history(files)
    assert [(e["step"], history[e["step"]]["train/loss"]) for e in train] == [(e["step"], e["loss"]) for e in train]
