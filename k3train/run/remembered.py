"""A resume remembers how its run was started: `python -m k3train hydra.run.dir=DIR resume=auto` (or `resume=DIR`)
composes the overrides the run was started with, then the ones given now, which win key by key. So
`train.max_steps=400` is all a longer run needs, and forgetting `model=k3_small` no longer builds another model.
What the run is (model, optim, data, schedule, precision, the recipe) is remembered; how a session runs (device,
threads, compile, a time slice's stop_after: SESSION_KEYS) is each session's own. The parallel layout is the run's
while the processes are: a session with as many processes as the run's last one keeps its `parallel` overrides
(a pipelined run resumes pipelined), unless the command line gives any `parallel` override; with another number of
processes they are dropped, and the line that says so names them.

This runs on the command line before Hydra composes (`remember_run_overrides`), so the composed config, `--cfg job`
and the .hydra/overrides.yaml that Hydra writes for the new session all hold the whole list. The overrides come
from run.json's last session (each session records the whole list it was composed from), else from the run's
.hydra/overrides.yaml. A sweep (`-m`) is left alone: each job of it names its own directory.

`resume=DIR`, where DIR is a run directory (it holds run.json or a checkpoint), means that run: without
hydra.run.dir it continues in DIR (`hydra.run.dir=DIR resume=auto`); with another hydra.run.dir it starts there
from DIR's newest checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from k3train.checkpoint.latest import LATEST_NAMES, newest_checkpoint
from k3train.config import RESUME_MAY_CHANGE_MODEL
from k3train.observe.run_manifest import RUN_JSON, read_run_json

# How a session runs, not what the run is: each session says its own (a time slice's train.stop_after is that
# slice's), so these are never remembered; LAYOUT_KEY only where the number of processes is the run's last session's
# (a run started on 2 ranks with parallel.cp=2 may go on in one process).
LAYOUT_KEY = "parallel"
SESSION_KEYS = (
    LAYOUT_KEY,
    "train.device",
    "train.cpu_threads",
    "train.compile",
    "train.progress",
    "train.stop_after",
    "profile",
    *(f"model.{field}" for field in RESUME_MAY_CHANGE_MODEL),  # an implementation, not the function
)


@dataclass
class Remembered:
    """What a resume took from its run: the run's directory, the overrides it was started with (all of them) and
    those of them the command line now replaced or added to."""

    run_dir: Path
    recorded: list[str]
    given: list[str]
    kept_layout: bool = False  # the recorded parallel overrides were kept (same number of processes)
    layout_note: str = ""  # why they were not, where the run had any

    def describe(self) -> str:
        started = " ".join(started_with(self.recorded)) or "(no overrides)"
        line = f"k3train: resuming {self.run_dir} with its overrides: {started}"
        session = [
            line
            for line in started_with(self.recorded)
            if _is_session_key(_key(line)) and not (self.kept_layout and _is_layout_key(_key(line)))
        ]
        if session:
            line += f" (not {' '.join(session)}: how a session runs is each session's own{self.layout_note})"
        return line + (f"; given now: {' '.join(self.given)}" if self.given else "")


def remember_run_overrides(argv: list[str], world_size: int = 1) -> tuple[list[str], Remembered | None]:
    """argv with the resumed run's recorded overrides put before the ones given now (argv[0] kept), and what was
    remembered; argv unchanged and None where this is not a resume of a recorded run. world_size: this session's
    number of processes (the recorded parallel layout is kept where the run's last session had as many)."""
    args, _ = get_args_parser().parse_known_args(argv[1:])
    if args.multirun or not args.overrides:
        return argv, None
    try:
        given = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:
        return argv, None  # Hydra says what is wrong with the line itself
    by_key = {override.key_or_group: override for override in given}
    resume = by_key.get("resume")
    if resume is None or not isinstance(resume.value(), str):
        return argv, None
    run_dir_given = by_key.get("hydra.run.dir")
    replace: dict[str, str] = {}
    if resume.value() == "auto":
        if run_dir_given is None:
            return argv, None  # a new timestamped directory: nothing to continue
        run_dir = Path(str(run_dir_given.value())).expanduser()
    else:
        run_dir = Path(resume.value()).expanduser()
        if not _is_run_dir(run_dir):
            return argv, None  # a checkpoint file, or nothing there (the runner says so)
        if run_dir_given is None:
            replace[resume.input_line] = "resume=auto"
            replace[""] = f"hydra.run.dir={run_dir}"
        elif Path(str(run_dir_given.value())).expanduser().resolve() == run_dir.resolve():
            replace[resume.input_line] = "resume=auto"
        else:
            newest = newest_checkpoint(run_dir)
            if newest is None:
                return argv, None
            replace[resume.input_line] = f"resume={newest}"
    recorded = recorded_overrides(run_dir)
    if recorded is None:
        return argv, None
    given_lines = [replace.get(line, line) for line in args.overrides] + ([replace[""]] if "" in replace else [])
    given_keys = {override.key_or_group for override in given} | {"hydra.run.dir", "resume"}
    layout = layout_overrides(recorded)
    recorded_world = recorded_world_size(run_dir)
    keep_layout = bool(layout) and recorded_world == world_size and not any(map(_is_layout_key, given_keys))
    layout_note = ""
    if layout and not keep_layout and not any(map(_is_layout_key, given_keys)):
        processes = "an unrecorded number of" if recorded_world is None else str(recorded_world)
        layout_note = (
            f"; its layout ({' '.join(layout)}) ran on {processes} process(es), this session has {world_size}: "
            "give this session's parallel.* overrides, or the same ones to keep it"
        )
    kept = [
        line
        for line in recorded
        if _key(line) not in given_keys
        and (not _is_session_key(_key(line)) or (keep_layout and _is_layout_key(_key(line))))
    ]
    flags = list(argv[1:])  # Hydra's own flags (--cfg job, -c ...) stay; the overrides follow them
    for line in args.overrides:
        flags.remove(line)
    return (
        [argv[0], *flags, *kept, *given_lines],
        Remembered(
            run_dir,
            recorded,
            [line for line in args.overrides if _key(line) != "resume"],
            kept_layout=keep_layout,
            layout_note=layout_note,
        ),
    )


def layout_overrides(recorded: list[str]) -> list[str]:
    """The recorded overrides that set the parallel layout (`parallel=...`, `parallel.*`)."""
    return [line for line in recorded if _is_layout_key(_key(line))]


def recorded_world_size(run_dir: Path) -> int | None:
    """How many processes the run's last session had (run.json); None where it predates the record."""
    sessions = read_run_json(run_dir).get("sessions") or []
    size = sessions[-1].get("world_size") if sessions else None
    return size if isinstance(size, int) else None


def recorded_overrides(run_dir: Path) -> list[str] | None:
    """The overrides of the run's last session (run.json), else its .hydra/overrides.yaml; None: neither."""
    sessions = read_run_json(run_dir).get("sessions") or []
    if sessions and isinstance(sessions[-1].get("overrides"), list):
        return [str(line) for line in sessions[-1]["overrides"]]
    try:
        overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return [str(line) for line in overrides] if isinstance(overrides, list) else None


def started_with(recorded: list[str]) -> list[str]:
    """The recorded overrides that say what the run is (not where it lives, nor that it was itself a resume)."""
    return [line for line in recorded if _key(line) not in ("resume", "hydra.run.dir")]


def _is_session_key(key: str | None) -> bool:
    return key is not None and any(key == k or key.startswith(f"{k}.") for k in SESSION_KEYS)


def _is_layout_key(key: str | None) -> bool:
    return key is not None and (key == LAYOUT_KEY or key.startswith(f"{LAYOUT_KEY}."))


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in (RUN_JSON, *LATEST_NAMES))


def _key(line: str) -> str | None:
    try:
        return OverridesParser.create().parse_override(line).key_or_group
    except HydraException:
        return None


def config_changes(before: dict, now: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for every leaf of two composed configs that differs (a key on one side only included)."""
    changes = []
    for key in sorted(set(before) | set(now), key=str):
        old, new = before.get(key, "(absent)"), now.get(key, "(absent)")
        if isinstance(old, dict) and isinstance(new, dict):
            changes += config_changes(old, new, f"{prefix}{key}.")
        elif old != new:
            changes.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changes
