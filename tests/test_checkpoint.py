import os
import subprocess
import sys
import textwrap

import pytest
import torch

from k3train.train.checkpoint import (FORMAT_VERSION, CheckpointError, check_compatible, keep_last,
                                      load_checkpoint, save_checkpoint)


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
        from k3train.train import checkpoint
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
    saved = {"model_config": {"d_model": 64, "n_layers": 2}, "recipe": {"batch_size": 8},
             "optimizer_layout": {"adamw": "3 tensors"}, "data": {"fingerprint": "abc"}}
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
