"""python -m k3train.ladder: the power-law fits on known data, the held-out and next-size predictions, bad input in
one line with status 2, and a real two-rung ladder whose finished runs a second call does not run again."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from k3train import ladder
from k3train.ladder import Job, Rung, family_config, fit, power_law
from k3train.models.k3.flops import flops_per_token


def test_power_law_recovers_a_known_exponent_and_coefficient() -> None:
    x = [1e9, 3e9, 1e10, 3e10]
    law = power_law(x, [7.0 * v**-0.05 for v in x])
    assert math.isclose(law["exponent"], -0.05, rel_tol=1e-9) and math.isclose(law["coefficient"], 7.0, rel_tol=1e-9)
    assert math.isclose(law["r2"], 1.0)


def synthetic_rung(width: int, params: int, compute: float, losses: dict[float, float]) -> Rung:
    jobs = [Job(lr, f"d{width}/lr_{lr:g}", "max_steps", loss, 1000, compute) for lr, loss in losses.items()]
    return Rung(width, params, 256, jobs)


def test_fit_predicts_a_held_out_rung_on_the_law_and_flags_a_best_lr_at_the_grid_edge() -> None:
    law = lambda c: 9.0 * c**-0.04  # noqa: E731
    rungs = [
        synthetic_rung(w, n, c, {1e-2: law(c) + 0.05, 2e-2: law(c), 4e-2: law(c) + 0.02})
        for w, n, c in ((32, 10_000, 1e9), (64, 40_000, 4e9), (96, 90_000, 9e9), (128, 160_000, 1.6e10))
    ]
    rungs.append(synthetic_rung(160, 250_000, 2.5e10, {1e-2: law(2.5e10), 2e-2: law(2.5e10) + 0.1}))
    result = fit(rungs, holdout=1, family=family_config("k3_tiny", []), predict_width=256, steps=10)
    assert result["fit_widths"] == [32, 64, 96, 128]
    assert math.isclose(result["fit"]["loss_vs_compute"]["exponent"], -0.04, rel_tol=1e-9)
    assert math.isclose(result["fit"]["best_lr_vs_active_params"]["exponent"], 0.0, abs_tol=1e-12)
    (held,) = result["held_out"]
    assert held["width"] == 160 and abs(held["relative_error"]) < 1e-9 and held["measured_best_lr"] == 1e-2
    assert [r["best_lr_at_grid_edge"] for r in result["rungs"]] == [None] * 4 + ["lowest"]
    prediction = result["prediction"]
    family = family_config("k3_tiny", [])
    assert prediction["width"] == 256 and prediction["tokens"] == 1000  # the last fitted rung's tokens
    assert prediction["compute"] == flops_per_token(family.at_width(256), 256)["training"] * 1000
    assert math.isclose(prediction["loss"], law(prediction["compute"]), rel_tol=1e-9)
    assert math.isclose(prediction["best_lr"], 2e-2, rel_tol=1e-9)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--widths", "64", "--lrs", "1e-2", "--steps", "5"], "leaves 1 rung(s) to fit"),
        (["--widths", "64,128", "--lrs", "1e-2", "--steps", "5", "--holdout", "1"], "leaves 1 rung(s) to fit"),
        (["--widths", "40,64", "--lrs", "1e-2", "--steps", "5"], "mla_n_heads=4 at d_model=128 scales to 1.25"),
        (["--widths", "32,64", "--lrs", "1e-2", "--steps", "5", "--model", "dense_peer"], "KimiK3 family"),
    ],
)
def test_bad_input_is_one_line_with_status_2_and_runs_nothing(argv, words, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a run was started"))
    assert ladder.main([str(tmp_path / "ladder"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ladder: error: ") and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "ladder").exists()


@pytest.mark.slow  # four short training runs
def test_a_real_ladder_fits_and_a_second_call_runs_nothing_again(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "ladder"
    argv = [str(out), "--widths", "32,64", "--lrs", "1e-2,3e-2", "--steps", "3", "--", "model.parametrization=mup"]
    argv += ["train.eval_interval=0", "train.checkpoint_interval=0", "train.progress=lines", "train.batch_size=2"]
    assert ladder.main(argv) == 0
    result = json.loads((out / "ladder.json").read_text())
    assert [r["width"] for r in result["rungs"]] == [32, 64]
    assert all(j["end"] == "max_steps" and j["final_val_loss"] > 0 for r in result["rungs"] for j in r["jobs"])
    assert result["rungs"][0]["active_params"] < result["rungs"][1]["active_params"]
    assert result["fit"]["loss_vs_compute"]["exponent"] < 0  # the wider rung learns more in 3 updates
    assert result["prediction"]["width"] == 128 and (out / "ladder.png").stat().st_size > 0
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran again: {a}"))
    capsys.readouterr()
    assert ladder.main(argv) == 0
    assert capsys.readouterr().out.count("every lr finished, nothing to run") == 2
