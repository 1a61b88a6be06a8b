"""FSDP2 (parallel=fsdp) on CPU (gloo): 2 sharded ranks train as 1 process does with the same global batch, their
sharded checkpoints resume exactly (after a rank is killed, on 2 ranks or in 1 process, or consolidated into one
file), and opening a sharded checkpoint never runs code from it."""

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from k3train import export
from k3train.checkpoint.checkpointer import FORMAT_VERSION, CheckpointError, ShardedCheckpointer, load_checkpoint
from k3train.checkpoint.dcp import EXTRA, PLACEHOLDER, read_sharded, whole_tensor
from k3train.consolidate import consolidate
from k3train.inference.loading import load as load_for_inference
from k3train.observe.metrics import read_metrics

from helpers.distributed_runs import FP64_BOUND, K3, SMOKE, kill_a_rank_then_resume, launch, steps

FSDP = ["parallel=fsdp"]


def assert_same_steps(got: dict, want: dict, rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(want) and len(want) >= 2
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), step


def assert_same_weights(got: dict, want: dict, atol: float) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=atol, msg=name)


@pytest.mark.slow
def test_fsdp_k3_tiny_equals_one_process_and_resumes_sharded_or_consolidated(k3_cache, tmp_path):
    """Muon (whole matrices gathered from shards), Quantile Balancing, QK-Clip on row-sharded weights, gradient
    accumulation without a reduce-scatter per micro-batch; then 1 process resumes its consolidated step-2
    checkpoint (a 2-rank resume from last.dcp: the killed-rank test below)."""
    args = [
        *K3,
        "train.max_steps=4",
        "train.gradient_accumulation_steps=2",
        "train.checkpoint_interval=2",
        "train.keep_last_k=2",
    ]
    one, two, single = tmp_path / "one", tmp_path / "two", tmp_path / "single"
    proc = launch(k3_cache, *args, "train.batch_size=2", f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    proc = launch(k3_cache, *args, *FSDP, "train.batch_size=1", f"hydra.run.dir={two}")
    assert proc.returncode == 0, proc.stderr
    assert "FSDP2 over 2 process(es)" in proc.stdout
    assert "head_splits=(4, 0) x" in proc.stdout  # fully_shard's new parameters kept Muon's per-head annotation
    assert (two / "last.dcp").is_symlink() and not (two / "last.pt").exists()
    for event in ("train", "eval"):
        assert_same_steps(steps(two, event), steps(one, event), rel=FP64_BOUND)
    clipped = [e["qk_clip"]["n_clipped"] for e in read_metrics(two / "metrics.jsonl") if e["event"] == "train"]
    assert sum(clipped) > 0, "tau=0.05 must clip, or this case does not test QK-Clip on sharded weights"
    want = load_checkpoint(one / "last.pt")
    assert_same_weights(load_checkpoint(two / "last.dcp")["model"], want["model"], atol=FP64_BOUND)

    # generate, evaluate and export read a sharded run as they read a single-file one
    loaded = load_for_inference(two)
    assert loaded.step == 4 and loaded.path == two / "last.dcp"
    assert_same_weights(loaded.model.state_dict(), want["model"], atol=FP64_BOUND)
    exported = tmp_path / "export"
    assert export.main([str(two), str(exported)]) == 0
    assert_same_weights(load_for_inference(exported).model.state_dict(), want["model"], atol=FP64_BOUND)

    step2 = consolidate(two / "step_0000002.dcp")
    assert step2 == two / "consolidated_step_0000002.pt"
    assert load_checkpoint(step2)["trainer"]["step"] == 2  # weights_only, as every checkpoint loads
    proc = launch(k3_cache, *args, "train.batch_size=2", f"hydra.run.dir={single}", f"resume={step2}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    assert_same_steps(steps(single), {s: loss for s, loss in steps(one).items() if s > 2}, rel=FP64_BOUND)
    assert_same_weights(load_checkpoint(single / "last.pt")["model"], want["model"], atol=FP64_BOUND)


@pytest.mark.slow
def test_fsdp_smoke_equals_one_process_and_a_killed_rank_resumes_exactly(k3_cache, tmp_path):
    straight, killed, one = tmp_path / "straight", tmp_path / "killed", tmp_path / "one"
    args = [*SMOKE, *FSDP, "train.max_steps=8", "train.batch_size=2", "train.keep_last_k=3"]
    assert launch(k3_cache, *args, f"hydra.run.dir={straight}").returncode == 0
    proc = launch(k3_cache, *SMOKE, "train.max_steps=8", "train.batch_size=4", f"hydra.run.dir={one}", ranks=None)
    assert proc.returncode == 0, proc.stderr
    assert_same_steps(steps(straight), steps(one))
    assert_same_weights(
        load_checkpoint(straight / "last.dcp")["model"], load_checkpoint(one / "last.pt")["model"], atol=1e-6
    )

    kill_a_rank_then_resume(k3_cache, args, straight, killed, "last.dcp")
    proc = launch(
        k3_cache,
        *SMOKE,
        "train.max_steps=8",
        "train.batch_size=2",
        f"hydra.run.dir={tmp_path / 'half'}",
        f"resume={straight / 'step_0000004.dcp'}",
        ranks=None,
    )  # 1 x 2 rows: not the checkpoint's 2 x 2
    assert proc.returncode == 2 and "global_batch_size was 4, now 2" in proc.stderr
    named = {os.readlink(link).split("/")[-1] for link in killed.glob("*.dcp")}  # last, step_4, step_6, step_8
    assert sorted(p.name for p in (killed / "dcp").iterdir()) == sorted(named) and len(named) == 3


# ---- opening a sharded checkpoint --------------------------------------------------------------------------------


def _sharded_checkpoint(directory: Path) -> None:
    """A sharded checkpoint as write_sharded lays it out, made in one process: one tensor through DCP, the rest in
    extra.pt with a placeholder where it goes."""
    dcp.save({"model/w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=directory, no_dist=True)
    torch.save(
        {
            "meta": {"step": 3, "format_version": FORMAT_VERSION},
            "model": {"w": {PLACEHOLDER: "model/w", "shape": [2, 3], "dtype": "float32"}, "b": torch.ones(2)},
        },
        directory / EXTRA,
    )


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_sharded_checkpoint_reads_back_whole(tmp_path):
    _sharded_checkpoint(tmp_path / "ckpt")
    tree = read_sharded(tmp_path / "ckpt", whole_tensor)
    assert torch.equal(tree["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(tree["model"]["b"], torch.ones(2)) and tree["meta"]["step"] == 3


def test_a_malicious_metadata_file_is_refused_without_running_it(tmp_path):
    _sharded_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "code-ran"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError, match="is not part of a checkpoint's metadata"):
        load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()


def test_a_metadata_entry_that_is_not_a_tensor_is_refused(tmp_path):
    """DCP would torch.load a bytes entry with weights_only=False: a placeholder naming one must not reach it."""
    directory = tmp_path / "ckpt"
    dcp.save({"model/w": torch.zeros(2), "model/extra": {"any": "object"}}, checkpoint_id=directory, no_dist=True)
    torch.save({"model": {PLACEHOLDER: "model/w", "shape": [2], "dtype": "float32"}}, directory / EXTRA)
    with pytest.raises(CheckpointError, match="entries other than tensors"):
        load_checkpoint(directory)


def test_consolidate_refuses_to_overwrite_and_names_what_it_needs(tmp_path):
    _sharded_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "one.pt"
    out.write_bytes(b"the user's file")
    with pytest.raises(FileExistsError, match="already exists"):
        consolidate(tmp_path / "ckpt", out)
    assert out.read_bytes() == b"the user's file"
    with pytest.raises(CheckpointError, match="neither a sharded checkpoint"):
        consolidate(tmp_path)


def test_consolidate_of_a_run_that_went_on_in_one_process_refuses_its_older_last_dcp(tmp_path):
    """A run's newest checkpoint is what resume, generate and evaluate take: a last.pt newer than last.dcp is not
    consolidated into an older step; the .dcp named itself still is."""
    run = tmp_path / "run"
    run.mkdir()
    _sharded_checkpoint(run / "step_0000004.dcp")
    (run / "last.dcp").symlink_to("step_0000004.dcp")
    (run / "last.pt").write_bytes(b"written later, by one process")
    os.utime(run / "step_0000004.dcp", (1_000_000_000, 1_000_000_000))  # older than last.pt
    with pytest.raises(CheckpointError, match=r"newest checkpoint is last.pt, written after last.dcp and already one"):
        consolidate(run)
    assert not list(run.glob("consolidated_*"))
    assert consolidate(run / "last.dcp").name.startswith("consolidated_step_")


def test_an_fsdp_run_refuses_a_single_file_checkpoint_saying_what_to_do(tmp_path):
    checkpointer = ShardedCheckpointer(tmp_path, {}, keep_last_k=0, layouts={("dp_shard",): None}, writer=True)
    (tmp_path / "consolidated.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="resume it with parallel=ddp, or in one process"):
        checkpointer.load(tmp_path / "consolidated.pt")


def test_a_failed_sharded_write_is_the_failing_ranks_own_error():
    """DCP raises a BaseException holding each rank's error; the runner reports an OSError (a full disk) itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    from k3train.checkpoint.dcp import rank_error

    full = OSError(28, "No space left on device", "/run/dcp/x/__1_0.distcp")
    assert rank_error(CheckpointException("save", {1: (full, None)})) is full
