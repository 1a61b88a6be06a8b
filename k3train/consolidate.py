"""`python -m k3train.consolidate RUN_DIR_OR_CHECKPOINT [OUT]`: a sharded (FSDP2) checkpoint as one file.

The sharded checkpoint (a `.dcp` directory, or a run directory's last.dcp) is read in this one process, every
shard gathered into whole tensors, and written as the single-file checkpoint a 1-process run, a DDP run or the
generation tool loads (`torch.load(weights_only=True)`): the same parts, meta and format version. OUT defaults to
`consolidated_step_<N>.pt` beside the checkpoint; an existing file is never overwritten. Other tools call
`consolidate(path) -> Path`. Exit status (docs/errors.md): 0 done, 2 bad input (no sharded checkpoint there, a
corrupt or refused one, an existing OUT), 1 writing OUT failed (a full disk: nothing is left under its name).
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import argparse
import sys
from pathlib import Path

from k3train.checkpoint.checkpointer import CheckpointError, load_checkpoint, save_checkpoint
from k3train.checkpoint.latest import newest_checkpoint


def sharded_checkpoint(path: Path) -> Path:
    """The sharded checkpoint `path` names: itself, or a run directory's last.dcp where that is the run's newest
    checkpoint (as resume, generate and evaluate choose it). A run that went on in one process after its sharded
    sessions has a newer last.pt: consolidating last.dcp would hand back an older step, so that is refused."""
    path = Path(path)
    if (path / "last.dcp").exists():
        newest = newest_checkpoint(path)
        if newest is not None and newest.name != "last.dcp":
            raise CheckpointError(
                f"{path}'s newest checkpoint is {newest.name}, written after last.dcp and already one file: resume, "
                f"generate or evaluate from it as it is; to consolidate the older last.dcp, pass {path / 'last.dcp'}"
            )
        return path / "last.dcp"
    if path.is_dir() and (path / "extra.pt").is_file():
        return path
    raise CheckpointError(
        f"{path} is neither a sharded checkpoint (a .dcp directory) nor a run directory holding "
        "last.dcp: pass one of those"
    )


def consolidate(path: Path, out: Path | None = None) -> Path:
    """Write the sharded checkpoint at `path` (or a run directory's last.dcp) as one file; returns its path."""
    checkpoint = sharded_checkpoint(path)
    payload = load_checkpoint(checkpoint)  # whole tensors, read in this process
    step = payload["meta"]["step"]
    out = Path(out) if out is not None else checkpoint.parent / f"consolidated_step_{step:07d}.pt"
    if out.exists():
        raise FileExistsError(f"{out} already exists: pass another OUT path, or remove it first")
    save_checkpoint(out, payload)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3train.consolidate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a .dcp checkpoint directory, or a run directory")
    parser.add_argument(
        "out", type=Path, nargs="?", help="the file to write (default: consolidated_step_<N>.pt beside the checkpoint)"
    )
    args = parser.parse_args(argv)
    try:
        out = consolidate(args.checkpoint, args.out)
    except (CheckpointError, FileExistsError) as exc:  # bad input: fix the command
        print(f"k3train.consolidate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # writing OUT failed (a full disk): nothing is left under its name
        print(f"k3train.consolidate: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}: resume from it with resume={out} (one process or parallel=ddp)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
