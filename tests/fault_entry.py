"""`python tests/fault_entry.py <overrides>`: `python -m k3train` with faults injected from outside the product.

The product has no test hooks; this wrapper patches the functions a fault needs before Hydra starts.
K3TRAIN_FAULT is a comma-separated list of `kind:N` (N counts from 1), K3TRAIN_FAULT_DIR a directory for the
handshake files:
  pause_step:N     after the train event of step N is written, create <dir>/paused-step-N and wait until
                   <dir>/go-step-N exists: a step boundary the test can signal or kill at
  pause_replace:N  at the N-th rename of last.pt's temporary file (written and fsynced, not yet renamed), create
                   <dir>/paused-replace-N and wait until <dir>/go-replace-N exists: a kill here lands while the
                   temporary file exists
  enospc:N         the N-th write of last.pt's temporary file meets a full disk half-way: torch.save's writes
                   fail with ENOSPC, and torch reacts as it does on a real full disk
  die_step:N       after the train event of step N, SIGKILL this process if its RANK is K3TRAIN_FAULT_RANK (default
                   1): one rank of a multi-process run dies
  die_rewind:N     at the N-th guard rewind, once the last good checkpoint is restored and before the loader moves
                   past the spike's data, SIGKILL this process if its RANK (0 in one process) is K3TRAIN_FAULT_RANK
  pause_build:1    when the runner starts building the run (the directory claimed, .hydra/ written, nothing
                   trained), create <dir>/paused-build-1 and wait until <dir>/go-build-1 exists: start-up
  pause_materialise:N  half-way through the N-th allocation of the model's part (run/build.py's materialise: the
                   memory allocated, half its tensors filled), create <dir>/paused-materialise-N and wait until
                   <dir>/go-materialise-N exists: a kill here lands while the weights are being drawn or read
"""

import errno
import io
import os
import signal
import time
from pathlib import Path

import torch

TEMP_PREFIX = ".last.pt.tmp-"  # the checkpoint writer's temporary file: .<name>.tmp-<pid>


def _faults() -> dict[str, int]:
    spec = os.environ.get("K3TRAIN_FAULT", "")
    return {kind: int(n) for kind, n in (item.split(":") for item in spec.split(",") if item)}


def _pause(kind: str, n: int) -> None:
    handshake = Path(os.environ["K3TRAIN_FAULT_DIR"])
    (handshake / f"paused-{kind}-{n}").touch()
    while not (handshake / f"go-{kind}-{n}").exists():
        time.sleep(0.005)  # signal handlers run between sleeps, as they would between steps


def _is_checkpoint_temp(path) -> bool:
    return Path(os.fsdecode(path)).name.startswith(TEMP_PREFIX)


def install(faults: dict[str, int]) -> None:
    from k3train.observe import metrics

    counts = {"replace": 0, "save": 0, "materialise": 0, "rewind": 0}

    if "pause_step" in faults:
        log = metrics.MetricsLogger.log

        def log_then_pause(self, event, **fields):
            record = log(self, event, **fields)
            if event == "train" and fields.get("step") == faults["pause_step"]:
                _pause("step", faults["pause_step"])
            return record

        metrics.MetricsLogger.log = log_then_pause

    if "die_step" in faults and os.environ.get("RANK") == os.environ.get("K3TRAIN_FAULT_RANK", "1"):
        log_before_death = metrics.MetricsLogger.log

        def log_then_die(self, event, **fields):
            record = log_before_death(self, event, **fields)
            if event == "train" and fields.get("step") == faults["die_step"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return record

        metrics.MetricsLogger.log = log_then_die

    if "die_rewind" in faults and os.environ.get("RANK", "0") == os.environ.get("K3TRAIN_FAULT_RANK", "1"):
        from k3train.checkpoint.checkpointer import Checkpointer

        load = Checkpointer.load

        def load_then_die(self, path):
            step = load(self, path)
            if path == self.good_path:
                counts["rewind"] += 1
                if counts["rewind"] == faults["die_rewind"]:
                    os.kill(os.getpid(), signal.SIGKILL)
            return step

        Checkpointer.load = load_then_die

    if "pause_build" in faults:
        from k3train.run import runner

        build_parts = runner.build_parts

        def pause_then_build(*args, **kwargs):
            _pause("build", faults["pause_build"])
            return build_parts(*args, **kwargs)

        runner.build_parts = pause_then_build

    if "pause_materialise" in faults:
        from k3train.run import build

        def materialise_then_pause(module, device, source):
            counts["materialise"] += 1
            calls = iter(range(10**9))
            half = len(list(module.parameters())) // 2

            def pausing_source(name, shape, region):
                if next(calls) == half and counts["materialise"] == faults["pause_materialise"]:
                    _pause("materialise", counts["materialise"])
                return source(name, shape, region)

            return real_materialise(module, device, pausing_source)

        real_materialise = build.materialise
        build.materialise = materialise_then_pause

    if "pause_replace" in faults:
        replace = os.replace

        def pause_then_replace(src, dst, *args, **kwargs):
            if _is_checkpoint_temp(src):
                counts["replace"] += 1
                if counts["replace"] == faults["pause_replace"]:
                    _pause("replace", counts["replace"])
            return replace(src, dst, *args, **kwargs)

        os.replace = pause_then_replace

    if "enospc" in faults:
        save = torch.save

        def save_until_the_disk_is_full(obj, f, *args, **kwargs):
            if _is_checkpoint_temp(str(getattr(f, "name", ""))):
                counts["save"] += 1
                if counts["save"] == faults["enospc"]:
                    size = len(_serialized(save, obj))
                    f = _FullDisk(f, budget=size // 2)  # torch itself meets the full disk, as on a real one
            return save(obj, f, *args, **kwargs)

        torch.save = save_until_the_disk_is_full


def _serialized(save, obj) -> bytes:
    buffer = io.BytesIO()
    save(obj, buffer)
    return buffer.getvalue()


class _FullDisk:
    """A file whose disk fills after `budget` bytes: the write that crosses it writes what fits and raises ENOSPC."""

    def __init__(self, file, budget: int):
        self.file, self.budget = file, budget

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self.budget:
            self.file.write(data[: self.budget])
            self.budget = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


if __name__ == "__main__":
    # As a terminal's foreground job: a test runner started in the background of a script (CI) passes SIGINT on
    # ignored, and k3train leaves an ignored SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    install(_faults())
    from k3train.__main__ import main

    main()
