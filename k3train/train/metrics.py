"""metrics.jsonl: one JSON event per line, flushed per event so a crash never loses a completed line.

Events: session (start), resume, train, eval, skip, checkpoint, end. Every event has "event", "time" (unix
seconds) and, where it applies, "step" (completed updates) and "tokens" (training tokens consumed). The file is
only ever appended to: a resumed session adds to the same log (its "resume" event marks where it picked up).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than invalid
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


class MetricsWriter:
    def __init__(self, path: Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled  # non-zero ranks write nothing
        self._file = None  # opened at the first event, so a run that fails its checks leaves no empty log

    def log(self, event: str, **fields) -> dict:
        record = {"event": event, "time": round(time.time(), 3), **_jsonable(fields)}
        if self.enabled:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
