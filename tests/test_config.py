"""Composition and override semantics of conf/ (no training)."""

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from k3train.config import TrainConfig, check_known_keys, register_configs

register_configs()


def composed(*overrides):
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_defaults_compose_to_a_typed_train_config():
    cfg = composed()
    train = OmegaConf.to_object(cfg.train)
    assert isinstance(train, TrainConfig)
    assert train.batch_size == cfg.train.batch_size and train.device == "auto"
    for group in ("model", "optim", "schedule", "precision", "data"):
        assert "_target_" in cfg[group], group


def test_explicit_false_and_zero_beat_true_and_nonzero_defaults():
    """The seeds' merge rule: an explicitly given false/0 is an override, not 'unset'."""
    base = composed("train.deterministic=true", "train.grad_clip=1.0")
    assert base.train.deterministic is True and base.train.grad_clip == 1.0
    cfg = composed("train.deterministic=false", "train.grad_clip=0", "train.eval_interval=0")
    assert cfg.train.deterministic is False and cfg.train.grad_clip == 0 and cfg.train.eval_interval == 0
    assert OmegaConf.to_object(cfg.train).clip_norm is None  # 0 disables clipping


def test_misspelt_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as err:
        composed("train.batch_szie=4")
    assert "batch_szie" in str(err.value)


@pytest.mark.parametrize("override,key,hint", [
    ("+train.max_stpes=5", "train.max_stpes", "train.max_steps"),  # the form Hydra's own error hint suggests
    ("++train.max_stpes=5", "train.max_stpes", "train.max_steps"),
    ("+profile.activ=2", "profile.activ", "profile.active"),
    ("+resum=auto", "resum", "resume"),
])
def test_a_key_added_with_plus_is_refused_naming_it(override, key, hint):
    cfg = composed(override)  # Hydra lets it into the structured config...
    with pytest.raises(ValueError) as err:
        check_known_keys(cfg)  # ...the runner does not
    assert str(err.value).startswith(f"unknown key {key} (did you mean {hint}?)")
    check_known_keys(composed())  # the defaults have none


def test_an_unknown_key_in_a_config_file_is_refused_naming_it(tmp_path):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "typo.yaml").write_text("# @package _global_\ntrain:\n  max_stpes: 5\n")
    with pytest.raises(ConfigCompositionException) as err:
        composed(f"hydra.searchpath=[file://{tmp_path}]", "+extra=typo")  # what --config-dir does
    assert "max_stpes" in str(err.value.__cause__ or err.value)


def test_wrong_type_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        composed("train.batch_size=abc")
    assert "batch_size" in str(err.value.__cause__ or err.value)


def test_cross_field_checks_run_when_the_typed_config_is_built():
    cfg = composed("train.batch_size=0")
    with pytest.raises(ValueError, match="train.batch_size must be >= 1"):
        OmegaConf.to_object(cfg.train)


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(ConfigCompositionException) as err:
        composed("optim=sgd")
    assert "adamw" in str(err.value)


def test_every_option_of_every_group_composes():
    from importlib.resources import files

    conf = files("k3train.conf")
    for group in ("model", "optim", "schedule", "precision", "data"):
        options = sorted(p.name[:-5] for p in (conf / group).iterdir() if p.name.endswith(".yaml"))
        assert options, group
        for option in options:
            extra = ["data.path=/nonexistent"] if (group, option) == ("data", "prepared") else []
            cfg = composed(f"{group}={option}", *extra)
            assert cfg[group]["_target_"], (group, option)
