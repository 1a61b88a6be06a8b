"""An override whose key names no setting is refused in one line naming the closest keys, with or without +, in
every config group, before Hydra composes (k3train/run/override_keys.py)."""

import pytest

from k3train.config import register_configs
from k3train.run.override_keys import config_groups, unknown_key_error

register_configs()


def error(*overrides: str) -> str | None:
    return unknown_key_error(["k3train", *overrides])


@pytest.mark.parametrize("plus", ["", "+", "++", "~"])
@pytest.mark.parametrize(
    "key,closest",
    [
        ("optim.lrr", "optim.lr"),
        ("train.max_step", "train.max_steps"),
        ("model.d_modell", "model.d_model"),
        ("parallel.bucket_cap", "parallel.bucket_cap_mb"),  # not epp: pp and ep are both one letter away
        ("schedule.warmup_step", "schedule.warmup_steps"),
        ("precision.dtyp", "precision.dtype"),
        ("data.document_maskin", "data.document_masking"),
        ("profile.enable", "profile.enabled"),
        ("paths.output", "paths.outputs"),
        ("callbacks.qk_clip.taux", "callbacks.qk_clip.tau"),
        ("trian.seed", "train"),
    ],
)
def test_a_misspelt_key_names_the_closest_ones_in_every_group(plus, key, closest):
    override = f"{plus}{key}" if plus == "~" else f"{plus}{key}=1"
    message = error(override)
    assert message is not None and message.startswith(f"unknown key {key}: did you mean {closest}"), message
    assert "\n" not in message


def test_the_groups_chosen_on_the_command_line_decide_which_keys_exist():
    assert error("optim=adamw", "optim.momentum=0.9") is not None  # Muon's key, not AdamW's
    assert error("optim.momentum=0.9") is None  # muon_adamw is the default
    assert error("model=smoke_test_lm", "model.n_layers=2") is not None  # a KimiK3 key, not the smoke model's
    assert error("data=prepared", "data.path=/x") is None  # a key whose value is ??? still exists
    assert error("experiment=k3_small_gpu", "train.batch_size=2", "optim.lr=1e-3") is None


def test_a_key_with_no_close_match_lists_its_parents_keys():
    message = error("train.zzzqq=1")
    assert message.startswith("unknown key train.zzzqq: train has activation_checkpointing, batch_size, ")


def test_a_group_option_that_does_not_exist_names_the_closest_and_the_options():
    message = error("model=k3_smal")
    assert message.startswith("model=k3_smal: no such option in conf/model/; did you mean k3_small?")
    assert all(option in message for option in config_groups()["model"])
    assert error("-m", "optim=adamw,muon_adamww").startswith("optim=muon_adamww: no such option")


def test_appending_a_key_that_exists_says_to_drop_the_plus():
    assert (
        error("+train.max_steps=3") == "+train.max_steps: that key exists; set it without the + (train.max_steps=...)"
    )
    assert error("++train.max_steps=3") is None  # ++ sets it whether or not it exists: Hydra's meaning


def test_what_is_left_to_hydra_passes():
    assert error("train.max_steps=3", "hydra.run.dir=/tmp/x", "hydra.job.name=x") is None
    assert error("-m", "hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "optim.lr=1e-3,3e-3") is None
    assert error("-m", "optim.lr=1e-3,3e-3", "optim=adamw,muon_adamw", "optim.weight_decay=0") is None  # swept group
    assert error("+callbacks.mine._target_=my.Callback") is None  # callbacks and logger hold entries by name
    assert error("train.max_steps=") is None and error("--help") is None  # Hydra's own syntax errors and help


@pytest.mark.slow
@pytest.mark.parametrize("override", ["optim.lrr=1e-3", "+optim.lrr=1e-3", "+model.d_modell=3"])
def test_cli_refuses_an_unknown_key_in_one_line_and_writes_nothing(run_cli, tmp_path, override):
    run_dir = tmp_path / "run"
    proc = run_cli("model=smoke_test_lm", override, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3train: error: unknown key "), proc.stderr
    assert "did you mean" in lines[0] and "Error" not in lines[0] and "0x" not in lines[0]
    assert not run_dir.exists()


def test_an_extensions_search_path_is_composed_with_its_own_options_and_keys(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bigram.yaml").write_text("_target_: bigram.Bigram\nwidth: 8\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    assert error("model=bigram", "model.width=4", search) is None
    assert error("model=bigram", "model.widht=4", search).startswith(
        "unknown key model.widht: did you mean model.width"
    )
    assert error("--config-dir", str(tmp_path), "model=bigram") is None  # Hydra judges another config folder
