"""`python -m k3train.export RUN_DIR_OR_CHECKPOINT OUT_DIR`: the model alone, for generate and evaluate.

OUT_DIR gets model.safetensors (the weights, no optimizer or loader state), config.json (the model class and its
config, the tokenizer's identity, the data the run trained on) and, for a Hugging Face tokenizer, tokenizer.json.
`python -m k3train.generate OUT_DIR ...` and `python -m k3train.evaluate OUT_DIR ...` read it back.

Exit status (docs/errors.md): 0 done, 2 bad input (a source that is no run, checkpoint or is refused, an OUT_DIR
that exists), 1 writing OUT_DIR failed (a full disk: nothing is left at OUT_DIR).
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

from k3train.data.tokenizers import HFTokenizer
from k3train.files import atomic_directory
from k3train.inference.loading import EXPORT_CONFIG, EXPORT_TOKENIZER, EXPORT_WEIGHTS, load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3train.export", description=__doc__.split("\n")[0])
    p.add_argument("source", help="a run directory (its last.pt or last.dcp) or a checkpoint (.pt or .dcp)")
    p.add_argument("out_dir", type=Path, help="a new (or empty) directory to write")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.out_dir.exists() and (not args.out_dir.is_dir() or any(args.out_dir.iterdir())):
            raise ValueError(f"{args.out_dir} already exists: choose a new directory (nothing is overwritten)")
        loaded = load(args.source)
        if (loaded.path / EXPORT_CONFIG).is_file():
            raise ValueError(f"{args.source} is already an export: copy the directory instead")
    except (ValueError, OSError) as exc:  # bad input: fix the command
        print(f"k3train.export: error: {exc}", file=sys.stderr)
        return 2
    try:
        with atomic_directory(args.out_dir) as tmp:
            write_export(loaded, Path(tmp))
    except FileExistsError as exc:  # OUT_DIR appeared meanwhile: it is left as it is
        print(f"k3train.export: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the work failed (a full disk): nothing is left at OUT_DIR
        print(f"k3train.export: error: {exc}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in args.out_dir.iterdir())
    print(
        f"exported {loaded.path} (step {loaded.step}) -> {args.out_dir} ({size / 2**20:.1f} MiB; the checkpoint "
        f"is {loaded.path.stat().st_size / 2**20:.1f} MiB)"
    )
    return 0


def write_export(loaded, out: Path) -> None:
    from safetensors.torch import save_model

    save_model(loaded.model, str(out / EXPORT_WEIGHTS))  # a tied lm_head is stored once
    tokenizer = loaded.tokenizer
    if isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(tokenizer.path, out / EXPORT_TOKENIZER)
    config = {
        "_target_": loaded.model_target,
        "model": dataclasses.asdict(loaded.model.config),
        "tokenizer": tokenizer.identity(),
        "data": loaded.data,
        "seq_len": loaded.seq_len,
        "step": loaded.step,
        "exported_from": str(loaded.path.resolve()),
    }
    (out / EXPORT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    for path in (out, *out.iterdir()):  # the temporary directory and safetensors' file start private
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


if __name__ == "__main__":
    raise SystemExit(main())
