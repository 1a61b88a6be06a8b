"""The guard in `python -m k3train` runs: every rank of DDP, FSDP2, a pipeline and expert parallelism holds the same
spike back (the run equals one whose loader dropped that batch, bit for bit), and a run killed in the middle of a
rewind resumes to end exactly as the uninterrupted guarded run."""

import pytest
import torch

from k3train.checkpoint.checkpointer import load_checkpoint

from helpers.distributed_runs import K3, launch, steps

SPIKE = 24  # the loss has fallen from 5.5 to a slow 4: a random-token batch's 5.5 stands well above the window
GUARDED = [
    *K3,
    "train.max_steps=28",
    "train.checkpoint_interval=4",
    "train.eval_interval=0",
    "guard.warmup=8",
    "guard.window=12",
]
LAYOUTS = {
    "ddp": (["parallel=ddp"], "last.pt"),
    "fsdp": (["parallel=fsdp"], "last.dcp"),
    "pp": (["parallel=ddp", "parallel.pp=2", "train.gradient_accumulation_steps=2"], "last.pt"),
    "ep": (["parallel=fsdp", "parallel.ep=2"], "last.dcp"),
}


def _assert_same_checkpoint(a, b):
    """Model and optimizer state of two checkpoints, bit for bit."""
    a, b = load_checkpoint(a), load_checkpoint(b)
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name
    for i, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            other = b["optimizer"]["state"][i][key]
            assert torch.equal(other, value) if torch.is_tensor(value) else other == value, (i, key)
    assert a["trainer"]["step"] == b["trainer"]["step"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_rank_holds_the_spike_back(k3_cache, tmp_path, layout):
    args, last = LAYOUTS[layout]
    skipped, dropped = tmp_path / "skipped", tmp_path / "dropped"
    for run_dir, how in ((skipped, f"guard.inject_at=[{SPIKE}]"), (dropped, f"guard.drop_at=[{SPIKE}]")):
        proc = launch(k3_cache, *GUARDED, *args, "guard=skip", how, f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    spikes = [(e["step"], e["action"]) for e in _events(skipped, "spike")]
    assert spikes == [(SPIKE, "skipped")], spikes
    assert steps(skipped) == steps(dropped)
    _assert_same_checkpoint(skipped / last, dropped / last)


def test_a_kill_during_a_rewind_resumes_to_the_uninterrupted_guarded_run(k3_cache, tmp_path):
    """One process: the spike at step 24 comes just after the step-24 checkpoint, so the rewind goes to step 20's
    (good after 3 clean updates). SIGKILL after the good checkpoint is restored, before the loader moves past the
    data; resume=auto starts from last.pt (step 24), meets the same spike and rewinds the same way."""
    args = [*GUARDED, "guard=rewind", "guard.good_after=3", "guard.rewind_margin=1", f"guard.inject_at=[{SPIKE}]"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    proc = launch(k3_cache, *args, f"hydra.run.dir={straight}", ranks=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [rewind] = _events(straight, "rewind")
    assert (rewind["step"], rewind["to"]) == (SPIKE, 20)
    fault = {"K3TRAIN_FAULT": "die_rewind:1", "K3TRAIN_FAULT_RANK": "0"}
    proc = launch(k3_cache, *args, f"hydra.run.dir={killed}", entry=("tests/fault_entry.py",), env=fault, ranks=None)
    assert proc.returncode != 0 and not _events(killed, "rewind")
    assert load_checkpoint(killed / "last.pt")["trainer"]["step"] == SPIKE
    proc = launch(k3_cache, *args, f"hydra.run.dir={killed}", "resume=auto", ranks=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(e["step"], e["to"]) for e in _events(killed, "rewind")] == [(SPIKE, 20)]
    assert steps(killed) == steps(straight) and steps(killed, "eval") == steps(straight, "eval")
    _assert_same_checkpoint(straight / "last.pt", killed / "last.pt")


def _events(run_dir, name):
    from k3train.observe.metrics import read_metrics

    return [e for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] == name]
