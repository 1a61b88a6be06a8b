"""An asynchronous checkpoint's two halves (train.checkpoint_async): the state copied at an update boundary (the
only time the loop waits), then written to the checkpoint's temporary file by a background thread while training
goes on. The Checkpointer renames it into place on the loop's thread once it is written and fsynced, so every name
(last, previous, step_N, last_good) still moves in the order a synchronous save moves them, and a kill at any
moment leaves the previous complete checkpoint (the half-written temporary file is removed on the next start).

A thread, as OLMo-core's asynchronous saves use: torch.save spends its time in the file writes, which release the
GIL. torchtitan and DCP's async_save stage to pinned shared memory and write from another process, which matters
when the pickling itself competes with a busy Python loop; on a GPU the copy below goes to pinned memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from k3train.files import write_temp


def staged_copy(tree):
    """`tree` with every tensor copied to CPU memory (pinned when it lives on a GPU), the rest as it is: what the
    loop may change after the call no longer reaches the checkpoint being written."""
    if isinstance(tree, torch.Tensor):
        if tree.device.type == "cpu":
            return tree.detach().clone()
        copy = torch.empty(tree.shape, dtype=tree.dtype, pin_memory=True)
        return copy.copy_(tree.detach(), non_blocking=True)
    if isinstance(tree, dict):
        return {key: staged_copy(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [staged_copy(value) for value in tree]
    if isinstance(tree, tuple):
        return tuple(staged_copy(value) for value in tree)
    return tree


class BackgroundWrite:
    """`path`'s temporary file written by `write` in a thread; `result()` waits and returns the temporary path, or
    raises what the write raised (files.write_temp: an OSError naming `path` for a full disk)."""

    def __init__(self, step: int, path: Path, write: Callable, blocked_s: float):
        self.step, self.path, self.blocked_s = step, path, blocked_s
        self.seconds: float | None = None  # the background write's own duration, once done
        self._tmp: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self, write: Callable) -> None:
        start = time.perf_counter()
        try:
            self._tmp = write_temp(self.path, write)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread, raised there
            self._error = exc
        self.seconds = time.perf_counter() - start

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tmp
