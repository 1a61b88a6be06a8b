"""What an optimizer was built with, for run.json and the run summary: any torch optimizer's param groups.

Every group setting is shown except the parameters, the current lr (the schedule moves it: initial_lr is the
configured one, shown as `lr` in the table), settings that are None or False, and torch's implementation flags.
A setting with one entry per parameter (MuonAdamW's head_splits) is shown as counts of its values other than None.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

# How torch runs an update, not what the update is.
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def group_settings(group: dict[str, Any]) -> dict[str, Any]:
    n_params = len(group["params"])
    settings: dict[str, Any] = {"initial_lr": group.get("initial_lr", group["lr"])}
    for key, value in group.items():
        if key in ("params", "lr", "initial_lr", "name", "kind", *IMPLEMENTATION_FLAGS):
            continue
        if value is None or value is False:
            continue
        if isinstance(value, list) and len(value) == n_params:
            counts = Counter(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value if v is not None)
            if not counts:
                continue
            value = ", ".join(f"{v} x{n}" for v, n in counts.items())
        settings[key] = list(value) if isinstance(value, tuple) else value
    return settings


def summarize_param_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One JSON-able row per group: name, kind (when the group has one), tensors, values, settings."""
    rows = []
    for i, g in enumerate(param_groups):
        row = {
            "name": g.get("name", str(i)),
            "tensors": len(g["params"]),
            "values": sum(p.numel() for p in g["params"]),
        }
        if "kind" in g:
            row["kind"] = g["kind"]
        rows.append({**row, **group_settings(g)})
    return rows


def _format_setting(key: str, value: Any) -> str:
    if value is True:
        return key
    key = "lr" if key == "initial_lr" else key
    if isinstance(value, float):
        return f"{key}={value:g}"
    if isinstance(value, list):
        return f"{key}=({', '.join(f'{v:g}' for v in value)})"
    return f"{key}={value}"


def format_param_groups(param_groups: Sequence[dict[str, Any]]) -> str:
    """A short table: group, kind, tensors, values, then the settings as key=value (a True flag as its name)."""
    table = [("group", "kind", "tensors", "values", "settings")]
    for row in summarize_param_groups(param_groups):
        settings = " ".join(
            _format_setting(key, value)
            for key, value in row.items()
            if key not in ("name", "kind", "tensors", "values")
        )
        table.append((row["name"], row.get("kind", ""), str(row["tensors"]), f"{row['values']:,}", settings))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}" for r in table
    )
