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


def write_unless_quick(out: Path | None, quick: bool, default: Path, result: dict) -> None:
    """A benchmark's `--out`, or nothing for a `--quick` smoke run, or else its default file under results/."""
    path = out if out is not None else (None if quick else default)
    if path is not None:
        write_results(path, result)
