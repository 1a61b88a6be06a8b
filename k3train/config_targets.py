"""The typed config groups: every `_target_` node of a run (model, optim, schedule, precision, data, parallel, each
callback and metrics sink) checked against the types of what it builds, at start-up, naming the key.

The types are the target's own: its signature's annotations (`LRSchedule(warmup_steps: int, ...)`), or for a model
built `from_fields` its `config_class` dataclass's fields (KimiK3Config). One source of truth, so a schema cannot
drift from the code it describes; the classes still check ranges and combinations when they are built. What this
adds is what they could not see: `data.document_masking=maybe` is a non-empty string (true to Python), and
`schedule.warmup_steps=abc` failed deep inside as a comparison of str and int.

Checked: bool, int (not bool), float (int too), str (and paths), None, unions of those, Literal, sequences and
mappings of them; anything else (a module, a process group, Any) is taken as it is. `???` (a value the option leaves
to be chosen) is left for the target's own refusal.
"""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import os
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

GROUPS = ("model", "optim", "schedule", "precision", "data", "parallel", "guard")  # one `_target_` node each
NAMED_GROUPS = ("callbacks", "logger")  # name -> `_target_` node
HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})


def check_target_settings(cfg: DictConfig) -> None:
    """Raise ValueError naming the first setting of a `_target_` node that its target does not take, or whose value
    is not of the type it takes."""
    for group in GROUPS:
        if isinstance(cfg.get(group), DictConfig):
            check_node(cfg[group], f"{group}.")
    for group in NAMED_GROUPS:
        for name, node in (cfg.get(group) or {}).items():
            if isinstance(node, DictConfig):
                check_node(node, f"{group}.{name}.")


def check_node(node: DictConfig, prefix: str) -> None:
    target = node.get("_target_")
    if not isinstance(target, str):
        return
    from hydra.utils import get_method

    try:
        built = get_method(target)
    except Exception:  # noqa: BLE001 - instantiate names an unknown target itself
        return
    takes = parameter_types(built)
    if takes is None:
        return
    values = OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    for key, value in values.items():
        if key in HYDRA_KEYS:
            continue
        if key not in takes:
            close = difflib.get_close_matches(str(key), sorted(takes), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ValueError(
                f"unknown key {prefix}{key}{hint}: {target} takes {', '.join(sorted(takes)) or 'no settings'}"
            )
        if value == "???" or takes[key] is Any:
            continue
        if not matches(value, takes[key]):
            raise ValueError(
                f"{prefix}{key}={value!r} is not {describe(takes[key])} ({target} takes {key}: "
                f"{describe(takes[key])}); set it to one"
            )


def parameter_types(built: Any) -> dict[str, Any] | None:
    """{setting: its type} of what a node builds; None when it takes any keyword (nothing to check against)."""
    owner = getattr(built, "__self__", None)
    config_class = getattr(owner, "config_class", None)
    if getattr(built, "__name__", "") == "from_fields" and is_dataclass(config_class):
        hints = _hints(config_class)
        return {f.name: hints.get(f.name, Any) for f in fields(config_class)}
    try:
        signature = inspect.signature(built)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    hints = _hints(built.__init__ if inspect.isclass(built) else built)
    return {
        name: hints.get(name, Any)
        for name, p in signature.parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def _hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve is not checked
        return {}


def matches(value: Any, kind: Any) -> bool:
    """Whether a config value (plain Python, as OmegaConf.to_container gives it) is of the annotated type."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any or kind is inspect.Parameter.empty:
        return True
    if kind is type(None) or kind is None:
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, arm) for arm in args)
    if origin is typing.Literal:
        return value in args
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str or kind is os.PathLike or (isinstance(kind, type) and issubclass(kind, os.PathLike)):
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence) or kind in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
        return all(matches(v, args[0]) for v in value) if args else True
    if origin in (dict, collections.abc.Mapping) or kind is dict:
        return isinstance(value, dict)
    return True  # a class the config cannot hold (a module, a process group): supplied at build time


def describe(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arm) for arm in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if kind is type(None):
        return "null"
    if origin in (list, tuple, collections.abc.Sequence):
        plural = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(args[0], describe(args[0]))}" if args else "a list"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
    if isinstance(kind, type) and issubclass(kind, os.PathLike):
        return "a path"
    return names.get(kind, getattr(kind, "__name__", str(kind)))
