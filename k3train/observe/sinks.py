"""Metrics sinks besides metrics.jsonl (which stays the record): TensorBoard and Weights & Biases.

Both take every number of an event as a scalar tagged `<event>/<field>` (nested dicts joined with "/":
`train/lr/muon_hidden`, `train/model/moe/1/load_max`, `eval/loss`) at the event's step. Each opens its files at the
first record, so a refused start leaves nothing, and checks at construction that its package is installed, so a
missing one stops the run before any work. Only rank 0 writes: MetricsLogger(enabled=False) on the other ranks
never calls write().
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from k3train.observe.run_manifest import read_run_json

NOT_SCALARS = ("event", "time", "step")  # the tag, the wall time and the x axis of every scalar


def scalar(value) -> float | None:
    """A number of an event as a float: metrics records carry NaN and inf as strings ("nan", "inf")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def scalars(record: dict) -> dict[str, float]:
    """Every number of a record, tagged `<event>/<field>[/<key>...]`."""
    out: dict[str, float] = {}

    def walk(tag: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{tag}/{key}", inner)
        elif (number := scalar(value)) is not None:
            out[tag] = number

    for field, value in record.items():
        if field not in NOT_SCALARS:
            walk(f"{record['event']}/{field}", value)
    return out


def _require(module: str, extra: str, logger: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"logger={logger} needs the {module} package, which is not installed: "
            f"pip install 'k3train[{extra}]' (or drop logger={logger})"
        )


class TensorBoardSink:
    """Scalars in <run_dir>/tensorboard/ (`tensorboard --logdir outputs/` shows every run); the session, resume
    and end events also as text, so a resume or the end reason shows beside the curves."""

    TEXT_EVENTS = ("session", "resume", "end")

    def __init__(self, run_dir: str | Path, subdir: str = "tensorboard"):
        _require("tensorboard", "tensorboard", "tensorboard")
        self.log_dir = Path(run_dir) / subdir
        self._writer = None

    def _open(self, first: dict):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed session redoes the steps after its checkpoint's: purge_step makes TensorBoard drop what the
        # earlier session logged from there on, as read_metrics(final_only=True) does for metrics.jsonl.
        start = first.get("step") if first.get("event") == "session" else None
        return SummaryWriter(str(self.log_dir), purge_step=start + 1 if start else None)

    def write(self, record: dict) -> None:
        if self._writer is None:
            self._writer = self._open(record)
        step, walltime = record.get("step"), record.get("time")
        if record["event"] in self.TEXT_EVENTS:
            self._writer.add_text(record["event"], f"`{json.dumps(record)}`", global_step=step, walltime=walltime)
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        self._writer.flush()  # as metrics.jsonl: what a killed run logged is on disk

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """A Weights & Biases run in <run_dir>/wandb/, offline unless mode says otherwise (`wandb sync` uploads an
    offline run later), under run.json's run id (resume="allow": every session of a k3train run logs to that id)
    and with its resolved config. Each session logs its steps as they come; offline, each writes its own
    offline-run-*-<id> directory."""

    def __init__(
        self,
        run_dir: str | Path,
        project: str = "k3train",
        mode: str = "offline",
        entity: str | None = None,
        name: str | None = None,
    ):
        _require("wandb", "wandb", "wandb")
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.wandb.mode={mode!r}: use offline, online or disabled")
        self.run_dir = Path(run_dir)
        self.settings = {"project": project, "mode": mode, "entity": entity, "name": name}
        self._run = None

    def _open(self):
        import wandb

        manifest = read_run_json(self.run_dir)  # {} for a sink used outside the runner: a fresh W&B run id
        settings = {**self.settings, "name": self.settings["name"] or self.run_dir.name}
        return wandb.init(
            dir=str(self.run_dir),
            id=manifest.get("run_id"),
            resume="allow",
            config=manifest.get("config"),
            **{k: v for k, v in settings.items() if v is not None},
        )

    def write(self, record: dict) -> None:
        if self._run is None:
            self._run = self._open()
        values = scalars(record)
        if values and record.get("step") is not None:
            self._run.log(values, step=record["step"])
        if record["event"] == "end":
            self._run.summary["end_reason"] = record.get("reason")

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
