"""run.json: every input that shaped a run, and one entry per session (start, resume point, end reason).

Rewritten atomically at each session start and end, so a crash leaves the previous complete manifest.
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from k3train.files import write_atomic

RUN_JSON = "run.json"
RUN_LOCK = ".lock"  # held by the live process that owns the run directory (run/rundir.py)


def read_run_json(run_dir: Path) -> dict:
    """A run's manifest, or {} when it has none yet or it is being replaced: readers (reports, sinks, loading) do
    without it rather than fail."""
    try:
        manifest = json.loads((Path(run_dir) / RUN_JSON).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def environment(device: torch.device) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "device": str(device),
        "cpu_threads": torch.get_num_threads(),
        "git_commit": _git_commit(),
        "argv": sys.argv,
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def _git_commit() -> str | None:
    """The code's commit when k3train runs from its own git checkout (an editable install); None otherwise,
    including a regular install that merely sits inside some other repository."""
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != repo:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


class RunManifest:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path = Path(run_dir) / RUN_JSON
        self.enabled = enabled
        self.data: dict = {}
        self.session: dict = {}

    def start_session(
        self,
        *,
        config: dict,
        overrides: list,
        model: dict,
        data: dict,
        optimizer: dict,
        env: dict,
        resume_from: str | None,
        resume_step: int | None,
        slurm: dict | None = None,
        flops: dict | None = None,
        world_size: int = 1,
    ) -> None:
        if self.path.exists():
            self.data = json.loads(self.path.read_text(encoding="utf-8"))
        else:
            self.data = {
                "run_id": uuid.uuid4().hex[:12],
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "sessions": [],
            }
        # The top level always describes the latest session; each session keeps its own overrides.
        self.data.update(config=config, model=model, data=data, optimizer=optimizer, environment=env, flops=flops)
        self.session = {
            "session": len(self.data["sessions"]),
            "start": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "overrides": overrides,
            "world_size": world_size,  # processes: a resume with as many keeps the recorded parallel layout
            "resume_from": resume_from,
            "resume_step": resume_step,
            "slurm": slurm,  # job id, array task, node list, restart count (k3train/runtime/slurm.py)
            "end": None,
            "end_reason": None,
        }
        self.data["sessions"].append(self.session)
        self._write()

    def end_session(self, reason: str, step: int, tokens: int) -> None:
        self.session.update(
            end=time.strftime("%Y-%m-%dT%H:%M:%S%z"), end_reason=reason, final_step=step, final_tokens=tokens
        )
        self._write()

    def _write(self) -> None:
        if self.enabled:
            text = json.dumps(self.data, indent=2, default=str)
            write_atomic(self.path, lambda f: f.write(text.encode("utf-8")))
