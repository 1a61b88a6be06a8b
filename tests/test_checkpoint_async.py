"""train.checkpoint_async in one process: a checkpoint written in the background holds what a synchronous save
writes, a resume from it ends where the uninterrupted run does, names move only once a write is complete, and the
events say how long the loop was blocked. The kills, and a full disk, are the fault suite's (k3_tiny_async,
smoke_async in tests/fault_harness.py)."""

import pytest
import torch

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.observe.metrics import read_metrics

from helpers.config import K3_SHRUNK, built_run, fit_k3
from helpers.trees import assert_same_tree

RUN = ("train.max_steps=8", "train.checkpoint_interval=3", "train.keep_last_k=5")


def _fit(monkeypatch, run_dir, data, *overrides, resume=None):
    return fit_k3(monkeypatch, run_dir, data, *RUN, *overrides, resume=resume)


def test_a_background_save_writes_what_a_synchronous_one_does(monkeypatch, tmp_path, tiny_data_dir):
    sync = _fit(monkeypatch, tmp_path / "sync", tiny_data_dir, "train.checkpoint_async=false")
    background = _fit(monkeypatch, tmp_path / "async", tiny_data_dir, "train.checkpoint_async=true")
    for step in (3, 6, 8):
        a = load_checkpoint(tmp_path / "sync" / f"step_{step:07d}.pt")
        b = load_checkpoint(tmp_path / "async" / f"step_{step:07d}.pt")
        assert_same_tree(a, b)
    events = {e["step"]: e for e in read_metrics(tmp_path / "async" / "metrics.jsonl") if e["event"] == "checkpoint"}
    assert sorted(events) == [3, 6, 8]
    assert events[3]["background_s"] > 0 and events[6]["background_s"] > 0  # written behind the loop
    assert events[8]["background_s"] == 0  # the last, written before the run ends
    assert all(e["bytes"] == (tmp_path / "async" / f"step_{s:07d}.pt").stat().st_size for s, e in events.items())
    assert sync.state.step == background.state.step == 8


def test_a_resume_from_a_background_save_ends_where_the_uninterrupted_run_does(monkeypatch, tmp_path, tiny_data_dir):
    straight = _fit(monkeypatch, tmp_path / "straight", tiny_data_dir, "train.checkpoint_async=true")
    resumed = _fit(
        monkeypatch,
        tmp_path / "resumed",
        tiny_data_dir,
        "train.checkpoint_async=true",
        resume=tmp_path / "straight" / "step_0000003.pt",
    )
    for name, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    assert_same_tree(straight.optimizer.state_dict(), resumed.optimizer.state_dict())


def test_last_pt_moves_only_once_the_write_is_complete(monkeypatch, tmp_path, tiny_data_dir):
    """While a save is in flight last.pt is the previous checkpoint; poll() renames the new one into place."""
    run = tmp_path / "run"
    run.mkdir()
    _, parts = built_run(
        monkeypatch, run, tiny_data_dir, *K3_SHRUNK, *RUN, "train.checkpoint_async=true", model="k3_tiny"
    )
    trainer = parts["trainer"]
    trainer.train_step()
    trainer.state.step = 1
    trainer.save(wait=True)
    checkpointer = trainer.checkpointer
    trainer.train_step()
    trainer.save()  # in the background
    assert load_checkpoint(run / "last.pt")["meta"]["step"] == 1 and checkpointer.saved_step == 1
    assert checkpointer.latest_step == trainer.state.step
    written = checkpointer.wait()
    assert written["step"] == trainer.state.step and checkpointer.saved_step == trainer.state.step
    assert load_checkpoint(run / "last.pt")["meta"]["step"] == trainer.state.step
    assert checkpointer.poll() is None and checkpointer.wait() is None  # nothing in flight


def test_the_device_default(monkeypatch):
    from k3train.config import TrainConfig

    assert TrainConfig(device="cpu").asynchronous_checkpoints is False
    assert TrainConfig(device="cuda").asynchronous_checkpoints is True
    assert TrainConfig(device="cpu", checkpoint_async=True).asynchronous_checkpoints is True
    with pytest.raises(ValueError, match="checkpoint_interval_minutes must be > 0"):
        TrainConfig(checkpoint_interval_minutes=0)


def test_a_wall_clock_interval_saves_when_that_long_has_passed(monkeypatch, tmp_path, tiny_data_dir):
    """train.checkpoint_interval_minutes beside (here instead of) the step interval: a microsecond is always past."""
    overrides = ("train.checkpoint_interval=0", "train.checkpoint_interval_minutes=0.00000001", "train.max_steps=4")
    _fit(monkeypatch, tmp_path, tiny_data_dir, *overrides)
    saved = [e["step"] for e in read_metrics(tmp_path / "metrics.jsonl") if e["event"] == "checkpoint"]
    assert saved == [1, 2, 3, 4]


def test_a_write_failure_elsewhere_settles_the_save_in_flight(monkeypatch, tmp_path, tiny_data_dir):
    """A full disk met first by another write (the metrics log) while a save is in flight: the runner puts that
    save in place once its own write has ended, so the run ends with what its message names and no temporary
    file (run/runner.py, _settle_save_in_flight)."""
    from k3train.files import TEMP_GLOB
    from k3train.run import runner

    run = tmp_path / "run"
    run.mkdir()
    _, parts = built_run(
        monkeypatch, run, tiny_data_dir, *K3_SHRUNK, *RUN, "train.checkpoint_async=true", model="k3_tiny"
    )
    trainer = parts["trainer"]
    trainer.train_step()
    trainer.save()  # in the background
    runner._settle_save_in_flight(trainer)
    assert trainer.checkpointer.latest_step == trainer.checkpointer.saved_step == trainer.state.step
    assert load_checkpoint(run / "last.pt")["meta"]["step"] == trainer.state.step
    assert not list(run.glob(TEMP_GLOB))
