"""`python -m k3train.export SOURCE OUT_DIR [--format k3train|hf]`: the model alone, for generate and evaluate.

SOURCE: a run directory, a checkpoint, an export or a Hugging Face directory. `--format k3train` (the default):
OUT_DIR gets model.safetensors (the weights, no optimizer or loader state), config.json (the model class and its
config, the tokenizer's identity, the data the run trained on) and, for a Hugging Face tokenizer, tokenizer.json.
`python -m k3train.generate OUT_DIR ...` and `python -m k3train.evaluate OUT_DIR ...` read it back.
`--format hf`: the Hugging Face layout (k3train/hf/write.py): transformers' kimi_linear for a Kimi Linear-form
model (AutoModelForCausalLM loads it), the released Kimi K3's layout for one with K3's components; sharded
safetensors (`--shard-size`, default 5GB) in `--dtype fp32|bf16`.

Exit status (docs/errors.md): 0 done, 2 bad input (a source that is no run, checkpoint or is refused, an OUT_DIR
that exists and is not empty, a --shard-size of no bytes), 1 writing OUT_DIR failed (a full disk: nothing is left
at OUT_DIR).
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import argparse
from pathlib import Path

from k3train.inference.writing import export


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3train.export", description=__doc__.split("\n")[0])
    p.add_argument("source", help="a run directory, a checkpoint (.pt or .dcp), an export or a Hugging Face directory")
    p.add_argument("out_dir", type=Path, help="a new (or empty) directory to write")
    p.add_argument(
        "--format",
        choices=("k3train", "hf"),
        default="k3train",
        help="k3train's own or Hugging Face's (default: %(default)s)",
    )
    p.add_argument(
        "--shard-size", default="5GB", help="--format hf: the largest safetensors shard (default: %(default)s)"
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="--format hf: the weights' dtype (default: %(default)s)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return export(args.source, args.out_dir, args.format, args.shard_size, args.dtype, prog="k3train.export")


if __name__ == "__main__":
    raise SystemExit(main())
