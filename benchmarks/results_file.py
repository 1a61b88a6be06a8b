"""Where a benchmark script's figures go: one indented JSON file, by default under benchmarks/results/."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(path: Path, result: dict, echo: bool = False) -> None:
    """Write `result` to `path` (making its folder) and say where; echo: print the JSON first, too."""
    text = json.dumps(result, indent=2) + "\n"
    if echo:
        print(text, end="")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
