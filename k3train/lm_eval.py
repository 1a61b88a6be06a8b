"""`python -m k3train.lm_eval run --model k3train --model_args path=RUN_OR_CKPT --tasks TASK [lm_eval's options]`:
EleutherAI's lm-evaluation-harness on a k3train model.

lm_eval 0.4.x finds models only in its own registry and has no plugin entry point for them, so a bare
`lm_eval --model k3train` cannot see k3train's adapter; this registers it (k3train/inference/lm_eval.py) and then
runs lm_eval's own CLI with the same arguments. Datasets are read offline (HF_DATASETS_OFFLINE=1 unless set):
point `--include_path` at local task YAMLs whose data files are local (docs/inference.md).
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval.__main__ as harness

        import k3train.inference.lm_eval as adapter  # registers the `k3train` model
    except ImportError as exc:
        print(f"k3train.lm_eval: error: {exc}; install it with pip install 'k3train[eval]'", file=sys.stderr)
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    given = any(a in ("-b", "--batch_size") or a.startswith("--batch_size=") for a in args)
    if args[:1] == ["run"] and not given:  # lm_eval's CLI passes its own default, 1, over the adapter's 8
        args += ["--batch_size", str(adapter.DEFAULT_BATCH_SIZE)]
    sys.argv = ["lm_eval", *args]
    try:
        harness.cli_evaluate()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
