"""`python -m k3train.plan`'s search (k3train/plan/search.py): when the configured recipe fits nowhere, the recipes
that do, each with a command that, run, plans it as fitting with the step time listed; without --gpus, the fewest
devices that fit (and half as many do not); bad input refused in one line, exit 2.

Every check goes through the CLI's main(), in process, and feeds what it printed back to it: the search's figures
are the planner's own only if the printed overrides compose to the recipe that was planned.
"""

from __future__ import annotations

import json
import re
import shlex
import time

import pytest

from k3train.plan.__main__ import main

TINY = ["model=k3_tiny", "model.vocab_size=257"]
SMALL = ["model=k3_small", "model.vocab_size=32768"]
STEP = re.compile(r"^  step +([0-9.]+) s$", re.M)


def listed(out: str) -> list[tuple[float, list[str]]]:
    """(step seconds as listed, the printed planner command's arguments after `python -m k3train.plan`) per
    recipe."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("recipes that fit on "))
    rows, step = [], None
    for line in lines[start + 1 :]:
        if re.match(r"^ +[0-9.]+  ", line):
            step = float(line.split()[0])
        elif line.strip().startswith("plan: python -m k3train.plan "):
            rows.append((step, shlex.split(line)[4:]))
    return rows


def run_commands(out: str) -> list[list[str]]:
    """The overrides of each training command printed (the lead's, then each recipe's first `run:`), after
    `-m k3train` or `python -m k3train`."""
    commands = []
    for line in out.splitlines():
        command = line.strip().removeprefix("run:").strip()
        if command.startswith(("torchrun ", "python -m k3train ")):
            words = shlex.split(command)
            commands.append(words[words.index("k3train") + 1 :])
    return commands


def assert_each_fits_as_listed(capsys: pytest.CaptureFixture, recipes: list[tuple[float, list[str]]]) -> None:
    for step_s, argv in recipes:
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        assert ": fits" in out, argv
        assert round(float(STEP.search(out).group(1)), 2) == step_s, argv


def value(argv: list[str], key: str, default: int) -> int:
    return next((int(a.split("=", 1)[1]) for a in argv if a.startswith(f"{key}=")), default)


def test_the_recipes_listed_when_nothing_fits_each_fit_when_planned(capsys: pytest.CaptureFixture) -> None:
    """k3_small with 64 rows of 4,096 on one H100: activations past 80 GB as configured; the search's recipes keep
    train.seq_len and the 64 rows a step (batch x accumulation), and each, planned by its command, fits."""
    assert main([*SMALL, "train.batch_size=64", "train.seq_len=4096", "--gpus", "1", "--gpu", "h100"]) == 2
    out, err = capsys.readouterr()
    assert "nothing fits on 1 x NVIDIA H100 SXM (exit 2); the recipes listed fit" in err
    recipes = listed(out)
    assert len(recipes) >= 3 and [s for s, _ in recipes] == sorted(s for s, _ in recipes)  # fastest first
    for _, argv in recipes:
        assert [a for a in argv if a.startswith("train.seq_len=")] == ["train.seq_len=4096"]
        assert value(argv, "train.batch_size", 64) * value(argv, "train.gradient_accumulation_steps", 1) == 64
    assert_each_fits_as_listed(capsys, recipes)
    # what to train leads, and is the fastest recipe's; each recipe's training command trains what was listed
    lead, *runs = run_commands(out)
    assert out.splitlines()[5].startswith("the configured recipe fits on no mesh of 1; train the fastest recipe")
    assert lead == runs[0] and len(runs) == len(recipes)
    assert main([*SMALL, "train.batch_size=64", "train.seq_len=4096", "--gpus", "1", "--gpu", "h100", "--json"]) == 2
    plan = json.loads(capsys.readouterr().out)
    first = plan["search"]["fits"][0]
    assert (
        plan["run"] == first["run"] == {"overrides": lead, "launch": [shlex.join(["python", "-m", "k3train", *lead])]}
    )
    assert first["days_per_1e12_tokens"] == pytest.approx(1e12 / first["tokens_per_day"])
    assert_each_fits_as_listed(
        capsys, [(step, [*run, "--gpus", "1", "--gpu", "h100"]) for (step, _), run in zip(recipes, runs)]
    )


def test_rows_too_long_for_a_device_are_split_over_cp_and_the_commands_still_compose(
    capsys: pytest.CaptureFixture,
) -> None:
    """One row of 262,144 positions keeps more than an H100 holds under any precision and checkpointing: the search
    splits rows (parallel.cp), keeping the global batch (8 rows over 8 GPUs); a DDP-only override given
    (parallel.bucket_cap_mb) is dropped where the recipe moves to FSDP, or its command would not compose."""
    recipe = [*SMALL, "train.batch_size=1", "train.seq_len=262144", "parallel.bucket_cap_mb=50", "--gpu", "h100"]
    assert main([*recipe, "--gpus", "8"]) == 2
    recipes = listed(capsys.readouterr().out)
    assert recipes
    for _, argv in recipes:
        cp = value(argv, "parallel.cp", 1)
        assert cp > 1 and value(argv, "train.gradient_accumulation_steps", 1) == cp  # 1 row a cp group, cp times
        assert "parallel=fsdp" not in argv or not any(a.startswith("parallel.bucket_cap_mb") for a in argv)
    assert_each_fits_as_listed(capsys, recipes)


@pytest.mark.parametrize(
    "args",
    [
        ["parallel.bucket_cap_mb=50", "--gpus", "4"],  # proposed: FSDP, DDP's key dropped
        ["--gpus", "8", "--mesh", "2x4x2"],  # HSDP with ep
        ["parallel.pp=2", "parallel.pp_schedule=gpipe", "train.gradient_accumulation_steps=4", "--gpus", "4"],
        ["parallel=fsdp", "--cp", "2", "--gpus", "4"],
    ],
)
def test_the_training_command_composes_to_the_plan_it_leads(capsys: pytest.CaptureFixture, args: list[str]) -> None:
    """The lead's overrides, planned on the mesh shown, are the same plan: the same step and peak, and nothing left
    for the config to change ("run it with" names what the config lacks for the mesh)."""
    argv = [*TINY, "train.seq_len=64", *args, "--gpu", "h100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    mesh = re.search(r"^mesh (\S+) = ", out, re.M).group(1)
    devices = args[args.index("--gpus") + 1]
    assert main([*run_commands(out)[0], "--gpus", devices, "--gpu", "h100", "--mesh", mesh]) == 0
    again = capsys.readouterr().out
    assert "run it with" not in again and f"mesh {mesh} = " in again
    for pattern in (STEP, re.compile(r"^  peak .*$", re.M), re.compile(r"pipeline: .*$", re.M)):
        assert [m.group(0) for m in pattern.finditer(again)] == [m.group(0) for m in pattern.finditer(out)]


def test_without_gpus_the_fewest_devices_that_fit_and_half_as_many_do_not(capsys: pytest.CaptureFixture) -> None:
    recipe = [*SMALL, "train.batch_size=1", "train.seq_len=262144", "--gpu", "h100"]
    assert main(recipe) == 0
    out = capsys.readouterr().out
    fewest = int(re.match(r"fewest devices: ([0-9,]+) x NVIDIA H100 SXM", out).group(1).replace(",", ""))
    assert fewest > 1 and f"on {fewest} x NVIDIA H100 SXM" in out and ": fits" in out
    assert_each_fits_as_listed(capsys, listed(out))
    assert main([*recipe, "--gpus", str(fewest // 2)]) == 2
    assert "  none: no recipe searched fits" in capsys.readouterr().out


def test_without_gpus_a_model_that_fits_on_one_device_plans_as_gpus_1(capsys: pytest.CaptureFixture) -> None:
    """What `python -m k3train.plan model=k3_tiny` printed before --gpus could be left out (then 1), under one line
    naming the count."""
    assert main([*TINY, "--gpu", "h100"]) == 0
    fewest = capsys.readouterr().out
    assert main([*TINY, "--gpu", "h100", "--gpus", "1"]) == 0
    one = capsys.readouterr().out
    first, rest = fewest.split("\n", 1)
    assert first.startswith("fewest devices: 1 x NVIDIA H100 SXM") and rest == "\n" + one


def test_a_mesh_without_gpus_plans_its_ranks(capsys: pytest.CaptureFixture) -> None:
    assert main([*TINY, "--mesh", "1x4x2", "--gpu", "h100"]) == 0
    assert "mesh 1x4x2 = dp_replicate 1 x dp_shard 4 (ep 2), 4 device(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "0"], "k3train plan: error: --gpus must be >= 1"),
        (["--gpus", "many"], "k3train plan: error: argument --gpus: invalid int value: 'many'"),
        (["--cp", "0"], "k3train plan: error: --cp must be >= 1"),
        (["--prefer", "fast"], "k3train plan: error: argument --prefer: invalid choice: 'fast'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture, args: list[str], message: str) -> None:
    assert main([*TINY, *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1 and not captured.out


# ---- K3 (2.78e12 parameters, on the meta device) ------------------------------------------------------------------
@pytest.mark.slow  # 11 s on 2 cores: K3 planned four times
def test_k3_on_1024_h200s_as_configured_lists_recipes_that_fit_in_seconds(capsys: pytest.CaptureFixture) -> None:
    """The configured recipe (fp32, 8 x 256, no checkpointing) keeps 575 GB a GPU at best; the search lists what
    fits, in seconds, and each listed command plans a fit at the step time listed."""
    t0 = time.perf_counter()
    assert main(["model=k3", "--gpus", "1024", "--gpu", "h200"]) == 2
    seconds = time.perf_counter() - t0
    out = capsys.readouterr().out
    searched = float(re.search(r"searched in ([0-9.]+) s", out).group(1))
    assert searched < 20 and seconds < 60
    recipes = listed(out)
    assert any("precision=bf16" in argv and "train.activation_checkpointing=block" in argv for _, argv in recipes)
    assert_each_fits_as_listed(capsys, recipes)


@pytest.mark.slow  # 9 s on 2 cores: the counts up to 512, then 256 and the recipe planned again
def test_k3_without_gpus_fits_first_on_512_h200s(capsys: pytest.CaptureFixture) -> None:
    """Muon's 12 bytes a parameter (fp32 weights, gradients, momentum) are 130 GB a GPU over 256 H200s, past
    126.9 GB usable: 512 is the first power of two; there the configured recipe does not fit, but one does."""
    assert main(["model=k3", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fewest devices: 512 x NVIDIA H200 SXM") and "on 256 none did" in out
    assert_each_fits_as_listed(capsys, listed(out))
    assert main(["model=k3", "--gpus", "256", "--gpu", "h200"]) == 2
    assert "  none: no recipe searched fits" in capsys.readouterr().out
