"""Overrides that name no setting, refused in one line before Hydra composes the run.

Hydra refuses a misspelt key (`optim.lrr=1e-3`) over several lines that advise appending it with `+`, and a key
appended that way reaches the `_target_` it configures as an unexpected argument. `unknown_key_error` checks every
override's key against the config the command's own group choices compose (model=..., optim=..., experiment=...)
and names the closest keys that exist, with or without `+`/`++`/`~`, in every group; a group option that does not
exist (`model=k3_smal`) is named with its closest options (unless hydra.searchpath adds folders, whose options
Hydra finds; --config-dir and another primary config are left to Hydra). `callbacks` and `logger` hold entries by
name, so adding a new one there (`+callbacks.mine._target_=...`) is allowed; the keys inside an existing one are
checked. Values, types and `hydra.*` keys are left to Hydra and to the schema (k3train/config.py).
"""

from __future__ import annotations

import difflib
from importlib.resources import files

from hydra import compose, initialize_config_module
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig

CONFIG_MODULE = "k3train.conf"
OPEN_GROUPS = ("callbacks", "logger")  # entries by name: a new one may be added
LISTED_KEYS = 12  # a key with no close match lists this many of its parent's keys


def unknown_key_error(argv: list[str]) -> str | None:
    """What is wrong with the first override of argv (sys.argv) that names no setting or no group option, in one
    line; None where every key exists (or the line is for Hydra to judge: a syntax error, --help)."""
    args, _ = get_args_parser().parse_known_args(argv[1:])
    if args.help or args.hydra_help or args.shell_completion or args.info or not args.overrides:
        return None
    if args.config_dir or args.config_path or args.config_name:
        return None  # another primary config or its folder: Hydra judges what it holds
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:
        return None
    groups = config_groups()
    # hydra.searchpath adds config folders (an extension's conf/model/mine.yaml): its options are composed, not listed
    search_path = [o.input_line for o in overrides if o.key_or_group == "hydra.searchpath"]
    choices, swept = list(search_path), set()
    for override in overrides:
        if override.key_or_group not in groups:
            continue
        problem = None if search_path else _unknown_option(override, groups[override.key_or_group])
        if problem:
            return problem
        if override.is_sweep_override():
            swept.add(override.key_or_group)
        else:
            choices.append(override.input_line)
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose("config", overrides=choices)
    except Exception:  # noqa: BLE001 - a choice Hydra cannot compose: Hydra says why when it runs
        return None
    for override in overrides:
        key = override.key_or_group
        top = key.split(".")[0]
        if key in groups or top == "hydra" or "/" in key or top in swept:  # hydra/launcher=...: Hydra's own groups
            continue
        if override.type != OverrideType.CHANGE and top in OPEN_GROUPS and _new_entry(key, cfg):
            continue
        problem = _unknown_key(override, cfg)
        if problem:
            return problem
    return None


def config_groups() -> dict[str, list[str]]:
    """k3train's config groups (conf/<group>/) and their options."""
    root = files(CONFIG_MODULE)
    return {
        group.name: sorted(
            option.name.removesuffix(".yaml") for option in group.iterdir() if option.name.endswith(".yaml")
        )
        for group in root.iterdir()
        if group.is_dir() and group.name not in ("hydra", "__pycache__")
    }


def _unknown_option(override: Override, options: list[str]) -> str | None:
    values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    for value in values:
        if value is None or not isinstance(value, str) or value in options:
            continue
        close = difflib.get_close_matches(value, options, n=3)
        hint = f"did you mean {_either(close)}? " if close else ""
        return (
            f"{override.key_or_group}={value}: no such option in conf/{override.key_or_group}/; {hint}"
            f"the options: {', '.join(options)}"
        )
    return None


# Keys some options have and others lack, and what to say when the chosen option lacks one.
ELSEWHERE = {
    "model.parametrization": "this model family has no muP parametrization; the KimiK3 family has one "
    "(model=k3_tiny, k3_small, kimi_linear_tiny, kimi_linear_small: model.parametrization=mup)",
}


def _unknown_key(override: Override, cfg: DictConfig) -> str | None:
    parts = override.key_or_group.split(".")
    node = cfg
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None  # inside a list or a value: Hydra and the schema judge it
        known = sorted(str(key) for key in node.keys())  # `in node` is False for a key whose value is ??? (MISSING)
        if part in known:
            node = node._get_node(part)
            continue
        parent = ".".join(parts[:depth])
        close = difflib.get_close_matches(part, known, n=3)
        full = [f"{parent}.{key}" if parent else key for key in close]
        where = parent or "the config"
        if override.key_or_group in ELSEWHERE:
            hint = ELSEWHERE[override.key_or_group]
        elif close:
            hint = f"did you mean {_either(full)}?"
        else:
            listed = ", ".join(known[:LISTED_KEYS]) + (", ..." if len(known) > LISTED_KEYS else "")
            hint = f"{where} has {listed}"
        return (
            f"unknown key {override.key_or_group}: {hint} (with or without +, a key must exist; "
            "`python -m k3train --cfg job` prints every key)"
        )
    if override.type == OverrideType.ADD:
        return f"+{override.key_or_group}: that key exists; set it without the + ({override.key_or_group}=...)"
    return None


def _new_entry(key: str, cfg: DictConfig) -> bool:
    """Whether key adds an entry to callbacks or logger (`callbacks.mine...`), rather than a key inside one."""
    parts = key.split(".")
    return len(parts) > 1 and parts[1] not in list(cfg[parts[0]].keys())


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" or {names[-1]}"
