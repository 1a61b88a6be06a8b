"""A resume composes its run's own overrides, then the ones given now (k3train/run/remembered.py); `resume=DIR`
continues the run in DIR; a resume whose model differs is refused in one line naming how the run was started."""

import json

import pytest

from k3train.run.remembered import config_changes, remember_run_overrides

STARTED = ["model=smoke_test_lm", "optim.lr=2e-3", "train.max_steps=2", "train.batch_size=2", "train.seq_len=32"]


def _run_dir(tmp_path, overrides=STARTED):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sessions = [{"session": 0, "overrides": ["model=k3_small"]}, {"session": 1, "overrides": overrides}]
    (run_dir / "run.json").write_text(json.dumps({"sessions": sessions}))
    return run_dir


def test_a_resume_in_a_run_directory_composes_the_runs_overrides_then_those_given_now(tmp_path):
    run_dir = _run_dir(tmp_path)
    argv = ["k3train", "--cfg", "job", f"hydra.run.dir={run_dir}", "resume=auto", "train.max_steps=4"]
    composed, remembered = remember_run_overrides(argv)
    # the last session's overrides, less the ones given now (train.max_steps), then those given now, in order
    assert composed == [
        "k3train",
        "--cfg",
        "job",
        "model=smoke_test_lm",
        "optim.lr=2e-3",
        "train.batch_size=2",
        "train.seq_len=32",
        f"hydra.run.dir={run_dir}",
        "resume=auto",
        "train.max_steps=4",
    ]
    assert remembered.run_dir == run_dir
    assert "with its overrides: model=smoke_test_lm optim.lr=2e-3 train.max_steps=2" in remembered.describe()


def test_resume_naming_a_run_directory_continues_in_it(tmp_path):
    run_dir = _run_dir(tmp_path)
    composed, remembered = remember_run_overrides(["k3train", f"resume={run_dir}", "optim.lr=1e-3"])
    assert composed == [
        "k3train",
        "model=smoke_test_lm",
        "train.max_steps=2",
        "train.batch_size=2",
        "train.seq_len=32",
        "resume=auto",
        "optim.lr=1e-3",
        f"hydra.run.dir={run_dir}",
    ]
    assert remembered is not None


def test_only_a_resume_of_a_recorded_run_is_rewritten(tmp_path):
    run_dir = _run_dir(tmp_path)
    unchanged = [
        ["k3train", "train.max_steps=4"],  # not a resume
        ["k3train", "resume=auto", "train.max_steps=4"],  # a new timestamped directory: nothing to continue
        ["k3train", "-m", f"hydra.run.dir={run_dir}", "resume=auto"],  # a sweep: each job names its own directory
        ["k3train", f"hydra.run.dir={tmp_path / 'elsewhere'}", "resume=auto"],  # no run there
        ["k3train", f"resume={run_dir / 'last.pt'}"],  # a checkpoint file: the runner resolves it
    ]
    for argv in unchanged:
        assert remember_run_overrides(argv) == (argv, None), argv


def test_the_overrides_come_from_hydras_record_where_run_json_has_none(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- model=smoke_test_lm\n- optim.lr=2e-3\n")
    composed, _ = remember_run_overrides(["k3train", f"hydra.run.dir={run_dir}", "resume=auto"])
    assert composed == ["k3train", "model=smoke_test_lm", "optim.lr=2e-3", f"hydra.run.dir={run_dir}", "resume=auto"]


def test_config_changes_name_every_leaf_that_differs():
    before = {"train": {"max_steps": 2, "seed": 1}, "optim": {"lr": 0.002}, "gone": 1}
    now = {"train": {"max_steps": 4, "seed": 1}, "optim": {"lr": 0.002}, "new": {"x": 1}}
    assert config_changes(before, now) == [
        "gone: 1 -> '(absent)'",
        "new: '(absent)' -> {'x': 1}",
        "train.max_steps: 2 -> 4",
    ]


@pytest.mark.slow
def test_cli_resume_remembers_the_model_and_refuses_another_in_one_line(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    common = ["train.log_interval=1", "train.eval_interval=0", "train.eval_batches=1"]
    first = run_cli(*STARTED, *common, f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr

    # model=smoke_test_lm is not repeated: without the run's own overrides this would build k3_tiny and be refused
    longer = run_cli(f"hydra.run.dir={run_dir}", "resume=auto", "train.max_steps=3")
    assert longer.returncode == 0, longer.stderr
    assert "changed since the last session: train.max_steps: 2 -> 3" in longer.stdout
    assert "resumed from" in longer.stdout and "at step 2" in longer.stdout

    # resume=DIR alone continues in DIR
    again = run_cli(f"resume={run_dir}", "train.max_steps=4")
    assert again.returncode == 0, again.stderr
    manifest = json.loads((run_dir / "run.json").read_text())
    assert len(manifest["sessions"]) == 3 and manifest["sessions"][-1]["final_step"] == 4
    assert manifest["model"]["class"] == "SmokeTestLM"

    refused = run_cli(f"hydra.run.dir={run_dir}", "resume=auto", "model=k3_tiny", "train.max_steps=5")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3train: error: cannot resume from"), refused.stderr
    assert "that run was started with: model=smoke_test_lm optim.lr=2e-3" in lines[0]
    assert "CheckpointError" not in lines[0]


def test_how_a_session_ran_is_not_remembered(tmp_path):
    """A run started on 2 ranks with parallel.cp=2, as a time slice, may go on in one process to its end."""
    session = ["parallel=fsdp", "parallel.cp=2", "train.stop_after=2", "model.kda_implementation=fla"]
    run_dir = _run_dir(tmp_path, overrides=["model=smoke_test_lm", *session])
    composed, remembered = remember_run_overrides(["k3train", f"hydra.run.dir={run_dir}", "resume=auto"])
    assert composed == ["k3train", "model=smoke_test_lm", f"hydra.run.dir={run_dir}", "resume=auto"]
    assert f"(not {' '.join(session)}: how a session runs is each session's own; " in remembered.describe()


def _run_on(tmp_path, world_size: int, overrides: list[str]):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    session = {"session": 0, "overrides": overrides, "world_size": world_size}
    (run_dir / "run.json").write_text(json.dumps({"sessions": [session]}))
    return run_dir


def test_the_parallel_layout_is_kept_where_the_processes_are_the_runs(tmp_path):
    """A pipelined run on 2 processes resumed on 2 with resume=auto alone stays pipelined; on 1 process the layout is
    dropped and the line says which overrides it had; any parallel override given now replaces the whole layout."""
    layout = ["parallel=fsdp", "parallel.pp=2"]
    run_dir = _run_on(tmp_path, 2, ["model=smoke_test_lm", *layout, "train.stop_after=2"])
    resume = ["k3train", f"hydra.run.dir={run_dir}", "resume=auto"]

    composed, remembered = remember_run_overrides(resume, world_size=2)
    assert composed == ["k3train", "model=smoke_test_lm", *layout, f"hydra.run.dir={run_dir}", "resume=auto"]
    assert "(not train.stop_after=2: how a session runs is each session's own)" in remembered.describe()

    composed, remembered = remember_run_overrides(resume, world_size=1)
    assert composed == ["k3train", "model=smoke_test_lm", *resume[1:]]
    assert (
        "its layout (parallel=fsdp parallel.pp=2) ran on 2 process(es), this session has 1: give this session's "
        "parallel.* overrides, or the same ones to keep it"
    ) in remembered.describe()

    composed, _ = remember_run_overrides([*resume, "parallel.cp=2"], world_size=2)
    assert composed == ["k3train", "model=smoke_test_lm", *resume[1:], "parallel.cp=2"]


def test_keys_given_with_a_resume_are_checked_against_the_runs_own_config_groups(tmp_path):
    """data=mixture is the run's: its keys are known to a resume that does not repeat it."""
    from k3train.config import register_configs
    from k3train.run.override_keys import unknown_key_error

    register_configs()  # as python -m k3train does first
    run_dir = _run_on(tmp_path, 1, ["data=mixture", "train.max_steps=2"])
    composed, _ = remember_run_overrides(["k3train", f"hydra.run.dir={run_dir}", "resume=auto", "data.verify=true"])
    assert unknown_key_error(composed) is None
    assert "unknown key data.verify" in unknown_key_error(["k3train", "data.verify=true"])


@pytest.mark.slow
def test_cli_resume_of_a_mixture_takes_a_mixture_key_without_repeating_data_mixture(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    mixture = ["data=mixture", "data.sources=[{name:a,path:null},{name:b,path:null}]", "data.weights=[1,3]"]
    first = run_cli(*STARTED, *mixture, "train.eval_interval=0", "train.stop_after=1", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr
    resumed = run_cli(f"hydra.run.dir={run_dir}", "resume=auto", "data.verify=true")
    assert resumed.returncode == 0, resumed.stderr
    assert "stopped at step 2 (max_steps)" in resumed.stdout
