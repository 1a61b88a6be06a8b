"""train.checkpoint_async under FSDP2 and expert parallelism on 2 gloo ranks (`python -m k3train` under torchrun):
each rank's shards are copied at the boundary and written by DCP's writer process (async_save, process-based), and
the checkpoints are bitwise the synchronous saves'; a resume from one ends where the uninterrupted run does. The
kills during a write, and a full disk, are the fault suite's (k3_tiny_async_sharded in tests/fault_harness.py)."""

import pytest

from k3train.checkpoint.checkpointer import load_checkpoint
from k3train.observe.metrics import read_metrics

from helpers.distributed_runs import K3, launch, steps
from helpers.trees import assert_same_tree

RUN = [*K3, "train.max_steps=8", "train.checkpoint_interval=3", "train.keep_last_k=5", "train.eval_interval=0"]
LAYOUTS = {"fsdp": ["parallel=fsdp"], "ep": ["parallel=fsdp", "parallel.ep=2"]}

pytestmark = pytest.mark.slow


def _run(k3_cache, run_dir, *args):
    proc = launch(k3_cache, *RUN, *args, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_sharded_background_save_writes_what_a_synchronous_one_does(k3_cache, tmp_path, layout):
    sync, background = tmp_path / "sync", tmp_path / "async"
    _run(k3_cache, sync, *LAYOUTS[layout], "train.checkpoint_async=false")
    proc = _run(k3_cache, background, *LAYOUTS[layout], "train.checkpoint_async=true")
    assert "Received async checkpoint request" not in proc.stderr  # the writer process's per-save chatter
    for step in (3, 6, 8):
        name = f"step_{step:07d}.dcp"
        assert_same_tree(load_checkpoint(sync / name), load_checkpoint(background / name))
    events = {e["step"]: e for e in read_metrics(background / "metrics.jsonl") if e["event"] == "checkpoint"}
    assert sorted(events) == [3, 6, 8]
    assert events[3]["background_s"] > 0 and events[6]["background_s"] > 0  # written behind the loop
    assert events[8]["background_s"] == 0  # the last, written before the run ends
    store = background / "dcp"
    named = {link.resolve() for link in background.glob("*.dcp")}
    assert set(store.iterdir()) == named  # no temporary or unnamed directory left
    assert steps(sync) == steps(background)


def test_a_resume_from_a_sharded_background_save_ends_where_the_uninterrupted_run_does(k3_cache, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(k3_cache, straight, "parallel=fsdp", "train.checkpoint_async=true")
    _run(k3_cache, resumed, "parallel=fsdp", "train.checkpoint_async=true", f"resume={straight / 'step_0000003.dcp'}")
    assert steps(resumed) == {s: v for s, v in steps(straight).items() if s > 3}
    a, b = load_checkpoint(straight / "last.dcp"), load_checkpoint(resumed / "last.dcp")
    assert_same_tree(a["model"], b["model"])
    assert_same_tree(a["optimizer"], b["optimizer"])
