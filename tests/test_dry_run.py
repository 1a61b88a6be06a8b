"""`python -m k3train dry_run.world_size=N dry_run.rank=R` (k3train/run/dry_run.py): one rank of a large run on a
fake process group, its bytes beside the planner's, and its refusals."""

import json

import pytest

from helpers.distributed_runs import launch

# Short rows under block checkpointing (the K3 recipe's), so activations stay small beside the model's bytes.
SMALL = ["parallel=fsdp", "train.batch_size=1", "train.seq_len=16", "train.activation_checkpointing=block"]
GIB = 2**30


def dry_run(k3_cache, run, model: str, ep: int) -> dict:
    args = [f"model={model}", *SMALL, "train.max_steps=2", f"parallel.ep={ep}", f"hydra.run.dir={run}"]
    proc = launch(k3_cache, *args, "dry_run.world_size=64", "dry_run.rank=63", ranks=None)
    assert proc.returncode == 0, proc.stderr
    assert "dry run: rank 63 of 64" in proc.stdout
    return json.loads((run / "dry_run.json").read_text())


@pytest.mark.slow
def test_a_k3_small_rank_of_64_builds_only_its_part_and_measures_what_the_planner_plans(
    k3_cache, builtin_data, tmp_path
):
    run = tmp_path / "run"  # builtin_data: the corpus prepared before, so its preparation is not in the peak
    report = dry_run(k3_cache, run, "k3_small", ep=64)
    assert report["steps"] == 2 and report["mesh"]["dp_shard"] == 64 and report["mesh"]["ep"] == 64
    m = report["measured"]
    for key in ("params", "grads", "optimizer"):  # the planner pads every shard to the largest rank's rows
        assert report["ratio"][key] == pytest.approx(1.0, abs=0.03), (key, report["ratio"])
    # k3_small's 129.4M parameters: 0.48 GiB in fp32. Building and allocating this rank's part stays under a quarter
    # of it above the process's baseline (the whole model built first would add all of it).
    whole = 129_425_544 * 4
    assert m["built_peak_resident"] - m["baseline_resident"] < whole / 4, m
    # And so does the whole run's peak, updates included, above torch's own: the peak of the same dry run of k3_tiny
    # (0.2% of k3_small's bytes), which holds the kernels, thread pools and autograd engine that a first forward and
    # backward bring in (about 40 MB above the baseline before the build, on an AMD EPYC).
    torch_own = dry_run(k3_cache, tmp_path / "tiny", "k3_tiny", ep=8)["measured"]["peak_resident"]
    assert m["peak_resident"] - torch_own < whole / 4, (m, torch_own)
    assert not (run / "last.pt").exists() and not (run / "metrics.jsonl").exists()  # nothing but the report


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dry_run.world_size=4", "dry_run.rank=4"], "dry_run.rank=4 is not a rank of dry_run.world_size=4"),
        (["dry_run.world_size=6", "parallel=fsdp", "parallel.ep=4"], "parallel.ep=4 must divide"),
    ],
)
def test_a_dry_run_that_cannot_be_is_refused_in_one_line(k3_cache, tmp_path, overrides, message):
    proc = launch(k3_cache, "model=k3_tiny", *overrides, f"hydra.run.dir={tmp_path / 'run'}", ranks=None)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "dry_run.json").exists()


def test_a_dry_run_under_a_launcher_is_refused_on_every_rank(k3_cache, tmp_path):
    proc = launch(k3_cache, "model=k3_tiny", "dry_run.world_size=8", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    assert "a dry run is one process standing for one rank" in proc.stderr, proc.stderr
    assert proc.stderr.count("exitcode  : 2") == 2, proc.stderr  # each rank's own status: bad input
