"""`python -m k3train.import_hf HF_DIR OUT_DIR`: a Hugging Face Kimi Linear or Kimi K3 directory as a k3train export.

HF_DIR: config.json (transformers' kimi_linear, or the released Kimi K3's kimi_k3), safetensors (one file or shards
with model.safetensors.index.json; MXFP4 experts decoded) and tokenizer.json (none: a 257-entry vocabulary is the
byte tokenizer). OUT_DIR gets what `python -m k3train.export` writes, which generate and evaluate read; to train
from the weights, `python -m k3train train.init_from=HF_DIR_OR_OUT_DIR` with the matching model config. Every check
(config, quantization, names, shapes) runs before OUT_DIR is written.

Exit status (docs/errors.md): 0 done, 2 bad input (nothing written), 1 writing OUT_DIR failed.
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import argparse
from pathlib import Path

from k3train.inference.writing import export


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3train.import_hf", description=__doc__.split("\n")[0])
    p.add_argument("hf_dir", help="a Hugging Face directory (config.json and safetensors)")
    p.add_argument("out_dir", type=Path, help="a new (or empty) directory to write")
    args = p.parse_args(argv)
    return export(args.hf_dir, args.out_dir, "k3train", prog="k3train.import_hf", hf_source_only=True)


if __name__ == "__main__":
    raise SystemExit(main())
