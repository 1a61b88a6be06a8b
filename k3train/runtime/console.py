"""The two ways k3train talks to a person: `say` for what a run reports as it goes (stdout: progress, summaries,
how it ended), `notice` for the framework's own word about the process (stderr, prefixed `k3train:`: a stop
signal, a requeue), so that piping stdout keeps the run's record and stderr its interruptions. Both flush at once:
a job killed a moment later must have said it."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path


def say(message: str) -> None:
    print(message, flush=True)


def notice(message: str) -> None:
    if first_on_this_node(message):
        print(f"k3train: {message}", file=sys.stderr, flush=True)


def first_on_this_node(message: str) -> bool:
    """Whether this rank is the first of its launch on this node to say `message`. torchrun's ranks share its agent
    as their parent and, unless it redirects them to a file each (--redirects, --log-dir), its stderr; most
    refusals are every rank's alike (a bad setting): one copy on that shared stream is enough, and a rank's own
    message (another text) still gets through. A marker file per (agent, message) in the temp directory decides;
    anything unusual (one process, a stream of its own, no /proc, a read-only temp dir) says it."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return True
    try:  # the agent's pid and start time: unique to this launch, whatever the rendezvous id
        agent = os.getppid()
        if not _shares_stderr_with(agent):
            return True
        started = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]
        key = hashlib.sha256(f"{agent} {started}\0{message}".encode()).hexdigest()[:24]
        os.close(os.open(Path(tempfile.gettempdir()) / f"k3train-said-{key}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except (OSError, IndexError):
        return True
    return True


def _shares_stderr_with(pid: int) -> bool:
    """Whether this process writes its stderr where process `pid` writes its own (the same terminal, pipe or file)."""
    mine, theirs = os.fstat(2), os.stat(f"/proc/{pid}/fd/2")
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)
