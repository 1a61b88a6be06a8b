"""Write a loaded model to a new directory: k3train's export (model.safetensors + config.json) or the Hugging Face
layout (k3train/hf/write.py). The export and import_hf commands are this with their own arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

from k3train.data.tokenizers import HFTokenizer
from k3train.files import atomic_directory
from k3train.hf.read import is_hf_directory
from k3train.hf.write import check_exportable, parse_size, write_hf
from k3train.inference.loading import EXPORT_CONFIG, EXPORT_TOKENIZER, EXPORT_WEIGHTS, load


def export(
    source: str | Path,
    out_dir: Path,
    fmt: str = "k3train",
    shard_size: str = "5GB",
    dtype: str = "fp32",
    prog: str = "k3train.export",
    hf_source_only: bool = False,
) -> int:
    """What `python -m k3train.export` and `python -m k3train.import_hf` do; returns the exit status (docs/errors.md):
    0 done, 2 bad input (nothing written), 1 writing failed (nothing left at out_dir)."""
    out_dir = Path(out_dir)
    try:
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise ValueError(f"{out_dir} already exists: choose a new directory (nothing is overwritten)")
        shard_bytes = parse_size(shard_size)
        if hf_source_only and not is_hf_directory(Path(source)):
            raise ValueError(
                f"{source} is no Hugging Face Kimi Linear or Kimi K3 directory (config.json, *.safetensors)"
            )
        loaded = load(source)
        is_export = (loaded.path / EXPORT_CONFIG).is_file() and not is_hf_directory(loaded.path)  # not a .dcp dir
        if fmt == "k3train" and is_export:
            raise ValueError(f"{source} is already a k3train export: copy the directory instead")
        if fmt == "hf":  # what the layout cannot say is refused before anything is written
            check_exportable(loaded.model)
    except (ValueError, OSError) as exc:  # bad input: fix the command
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        with atomic_directory(out_dir) as tmp:
            if fmt == "hf":
                layout = write_hf(loaded.model, loaded.tokenizer, Path(tmp), shard_bytes, dtype)
            else:
                write_export(loaded, Path(tmp))
                layout = "k3train"
    except FileExistsError as exc:  # OUT_DIR appeared meanwhile: it is left as it is
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the work failed (a full disk): nothing is left at OUT_DIR
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    source_size = sum(f.stat().st_size for f in loaded.path.iterdir()) if loaded.path.is_dir() else None
    source_size = loaded.path.stat().st_size if source_size is None else source_size
    print(
        f"exported {loaded.path} (step {loaded.step}) -> {out_dir} as {layout} ({size / 2**20:.1f} MiB; the "
        f"source is {source_size / 2**20:.1f} MiB)"
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
