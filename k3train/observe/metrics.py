"""Metrics: every event goes to a list of sinks; metrics.jsonl (JsonlSink) is always one of them and is the record.

A sink is any object with `write(record: dict)` and `close()` (MetricsSink); the runner adds the ones listed under
`logger` in the config (conf/logger/; none by default), so a TensorBoard or W&B sink is one more file.

metrics.jsonl: one JSON event per line, flushed per event so a crash never loses a completed line.

Events: session (start), resume, train, eval, skip, checkpoint, end. Every event has "event", "time" (unix
seconds) and, where it applies, "step" (completed updates) and "tokens" (training tokens consumed). The file is
only ever appended to: a resumed session adds to the same log (its "session" event carries the step it started
from). A process killed mid-write can leave a torn last line; the writer starts on a fresh line after it and
readers skip (and count) lines that are not JSON.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable


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


def _ends_mid_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


@runtime_checkable
class MetricsSink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends each record to a JSON-lines file, opened at the first record (so a run that fails its checks
    leaves no empty log)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = None

    def write(self, record: dict) -> None:
        try:
            if self._file is None:
                torn = _ends_mid_line(self.path)  # a killed writer's half line: never glue an event onto it
                self._file = open(self.path, "a", encoding="utf-8")
                if torn:
                    self._file.write("\n")
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as exc:  # name the file: a full disk's error on an open file names none
            raise OSError(exc.errno, exc.strerror or str(exc), str(self.path)) from exc

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class MetricsLogger:
    """`log(event, **fields)` builds one record (event, time, fields made JSON-able) and hands it to every sink:
    metrics.jsonl first, then `sinks`. With enabled=False (ranks other than 0) it builds records and writes none."""

    def __init__(self, path: Path, sinks: Sequence[MetricsSink] = (), enabled: bool = True):
        self.path = Path(path)
        self.sinks: list[MetricsSink] = [JsonlSink(self.path), *sinks]
        self.enabled = enabled

    def log(self, event: str, **fields) -> dict:
        record = {"event": event, "time": round(time.time(), 3), **_jsonable(fields)}
        if self.enabled:
            for sink in self.sinks:
                sink.write(record)
        return record

    def close(self) -> None:
        """Close every sink, even when one fails; the first failure is raised after."""
        error = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - the others must still close
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Events(list):
    """The events of a metrics.jsonl, in file order; `torn` counts the lines skipped as not valid JSON."""

    torn: int = 0


def read_metrics(path: Path, *, final_only: bool = False) -> Events:
    """Every event of the file. With final_only, drop the events a resumed session or a guard rewind redid: each
    `session` event carries the step it started from (a `rewind` the step it went back to), so earlier events past
    a later start step were repeated (a kill between two checkpoints, a rewind) and only the later ones count (one
    `train` event per step); `spike` and `rewind` events themselves are always kept."""
    events, torn = Events(), 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                torn += 1
    if final_only:
        events = _final(events)
    events.torn = torn
    return events


# What happened rather than what a step counted: kept whatever later steps redid.
_RECORDS = frozenset({"spike", "rewind"})


def _final(events: list[dict]) -> Events:
    """Segments start at each `session` event (from its step) and each guard `rewind` (from the step it went back
    to, its `to`); a segment's events past a later segment's start were redone, and only the later ones count."""
    segment = -1
    segments = []  # the segment index of each event (-1: before any session event)
    starts: list[float] = []  # each segment's start step
    for e in events:
        if e.get("event") == "session":
            segment += 1
            starts.append(e.get("step", 0))
        elif e.get("event") == "rewind" and "to" in e:
            segment += 1
            starts.append(e["to"])
        segments.append(segment)
    # redone_after[i]: the lowest start step of any segment after segment i
    redone_after = [math.inf] * (len(starts) + 1)
    for i in range(len(starts) - 1, -1, -1):
        redone_after[i] = min(starts[i], redone_after[i + 1])
    kept = Events()
    for e, s in zip(events, segments):
        later = redone_after[s + 1]
        if "step" not in e or e["step"] <= later or e.get("event") in _RECORDS:
            kept.append(e)
    return kept
