"""The typed config groups (k3train/config_targets.py): every `_target_` node of a run checked against the types
its target takes, before anything is built, naming the key; every option the package ships passes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from omegaconf import open_dict

from k3train.config_targets import check_target_settings, matches

from helpers.config import composed

GROUPS = ("model", "optim", "schedule", "precision", "data", "parallel")
CONF = Path(__file__).resolve().parents[1] / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group, option",
    [
        (g, o)
        for g in ("model", "optim", "schedule", "precision", "data", "parallel", "callbacks", "logger", "experiment")
        for o in _options(g)
    ],
)
def test_every_shipped_option_takes_its_targets_types(group: str, option: str) -> None:
    check_target_settings(composed(f"{group}={option}"))


@pytest.mark.parametrize(
    "override, message",
    [
        # each of these was taken, or failed deep inside, before the groups were typed
        ("data.document_masking=maybe", r"data.document_masking='maybe' is not true or false \(k3train.data.TokenData"),
        ("schedule.warmup_steps=abc", r"schedule.warmup_steps='abc' is not an integer"),
        ("optim.betas=0.9", r"optim.betas=0.9 is not a list of numbers"),
        ("model.tie_embeddings=maybe", r"model.tie_embeddings='maybe' is not true or false \(k3train.models.k3.KimiK3"),
        ("model.d_model=12.5", r"model.d_model=12.5 is not an integer"),
        ("precision=fp16 precision.growth_interval=true", r"precision.growth_interval=True is not an integer"),
        ("parallel.ep=two", r"parallel.ep='two' is not an integer"),
        ("callbacks.qk_clip.tau=x", r"callbacks.qk_clip.tau='x' is not a number"),
        ("model.kda_mla_ratio=[3,1]", r"model.kda_mla_ratio=\[3, 1\] is not a string or null"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_target_settings(composed(*override.split()))


def test_a_key_its_target_does_not_take_is_refused_with_the_closest_one() -> None:
    cfg = composed("model=dense_peer")
    with open_dict(cfg.model):
        cfg.model.n_layer = 2
    with pytest.raises(ValueError, match=r"unknown key model.n_layer \(did you mean model.n_layers\?\): "):
        check_target_settings(cfg)


def test_numbers_widen_but_booleans_do_not() -> None:
    assert matches(3, float) and not matches(True, float) and not matches(True, int) and not matches(1, bool)
    assert matches(None, int | None) and not matches("3", int | None)
    assert matches("wsd", Literal["wsd", "cosine"]) and not matches("ws", Literal["wsd", "cosine"])
    assert matches([0.9, 0.95], tuple[float, float]) and not matches([0.9], tuple[float, float])
