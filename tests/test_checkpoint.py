import os
import subprocess
import sys
import textwrap

import pytest
import torch

from k3train.checkpoint.checkpointer import (
    FORMAT_VERSION,
    Checkpointer,
    CheckpointError,
    check_compatible,
    keep_last,
    load_checkpoint,
    save_checkpoint,
)


def payload(value: float) -> dict:
    return {"meta": {"format_version": FORMAT_VERSION}, "model": {"w": torch.full((4,), value)}}


def test_round_trip_and_no_temp_files_left(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, payload(1.0))
    save_checkpoint(path, payload(2.0))
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_truncated_checkpoint_gives_clear_error(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, payload(1.0))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        load_checkpoint(path)


def test_missing_and_foreign_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a k3train checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")
    torch.save({"meta": {"format_version": 999}}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="format version 999"):
        load_checkpoint(tmp_path / "future.pt")


def test_loading_never_runs_code_from_the_file(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    path = tmp_path / "evil.pt"
    torch.save({"meta": {"format_version": FORMAT_VERSION}, "x": Evil()}, path)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_kill_between_write_and_rename_leaves_previous_checkpoint(tmp_path):
    """A process killed after writing the temp file but before the rename: last.pt is still the old one."""
    path = tmp_path / "last.pt"
    save_checkpoint(path, payload(1.0))
    script = textwrap.dedent(f"""
        import os, signal, torch
        from k3train.checkpoint import checkpointer as checkpoint
        def die(src, dst):
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.os.replace = die
        checkpoint.save_checkpoint({str(path)!r}, {{"meta": {{"format_version": {FORMAT_VERSION}}},
                                                    "model": {{"w": torch.full((4,), 2.0)}}}})
    """)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -9
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((4,), 1.0))


def test_compatibility_names_each_mismatch(tmp_path):
    saved = {
        "model_config": {"d_model": 64, "n_layers": 2},
        "recipe": {"batch_size": 8},
        "optimizer_layout": {"adamw": "3 tensors"},
        "data": {"fingerprint": "abc"},
    }
    check_compatible(saved, saved, tmp_path / "x.pt")
    current = {**saved, "model_config": {"d_model": 128, "n_layers": 2}, "data": {"fingerprint": "def"}}
    with pytest.raises(CheckpointError) as err:
        check_compatible(saved, current, tmp_path / "x.pt")
    assert "d_model was 64, now 128" in str(err.value) and "fingerprint was 'abc', now 'def'" in str(err.value)
    assert "n_layers" not in str(err.value)


def test_keep_last_k(tmp_path):
    ckpt = tmp_path / "last.pt"
    for step in (10, 20, 30):
        save_checkpoint(ckpt, payload(float(step)))
        keep_last(tmp_path, ckpt, step, k=2)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_0000020.pt", "step_0000030.pt"]
    assert torch.equal(load_checkpoint(tmp_path / "step_0000020.pt")["model"]["w"], torch.full((4,), 20.0))


class Box:
    def __init__(self, value=0.0):
        self.value = value

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state):
        self.value = state["value"].item()


def test_checkpointer_saves_and_restores_its_named_parts(tmp_path):
    writer = Checkpointer(tmp_path, meta={"data": {"fingerprint": "abc"}})
    writer.add("a", Box(1.0))
    writer.add("b", Box(2.0))
    assert writer.save(step=5) > 0 and writer.saved_step == 5
    reader = Checkpointer(tmp_path, meta={"data": {"fingerprint": "abc"}})
    a, b = Box(), Box()
    reader.add("a", a)
    reader.add("b", b)
    assert reader.load(tmp_path / "last.pt") == 5
    assert (a.value, b.value) == (1.0, 2.0) and reader.saved_step == 5


def test_checkpointer_refuses_a_part_it_cannot_save_and_a_checkpoint_lacking_one(tmp_path):
    ckpt = Checkpointer(tmp_path, meta={})
    with pytest.raises(TypeError, match="state_dict"):
        ckpt.add("x", object())
    ckpt.add("a", Box(1.0))
    with pytest.raises(ValueError, match="already added"):
        ckpt.add("a", Box())
    ckpt.save(step=1)
    later = Checkpointer(tmp_path, meta={})
    later.add("a", Box())
    later.add("sampler", Box())
    with pytest.raises(CheckpointError, match="lacks sampler"):
        later.load(tmp_path / "last.pt")


def test_checkpointer_refuses_a_mismatched_run_before_touching_any_part(tmp_path):
    ckpt = Checkpointer(tmp_path, meta={"data": {"fingerprint": "abc"}})
    ckpt.add("a", Box(1.0))
    ckpt.save(step=1)
    other = Checkpointer(tmp_path, meta={"data": {"fingerprint": "xyz"}})
    box = Box(3.0)
    other.add("a", box)
    with pytest.raises(CheckpointError, match="fingerprint was 'abc', now 'xyz'"):
        other.load(tmp_path / "last.pt")
    assert box.value == 3.0


def test_a_version_1_checkpoint_is_refused_as_older(tmp_path):
    torch.save({"meta": {"format_version": 1}, "model": {}}, tmp_path / "old.pt")
    with pytest.raises(CheckpointError, match="written by an older k3train"):
        load_checkpoint(tmp_path / "old.pt")
