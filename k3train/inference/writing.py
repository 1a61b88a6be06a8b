"""Write a loaded model to a new directory: k3train's export (model.safetensors + config.json) or the Hugging Face
layout (k3train/hf/write.py). The export and import_hf commands are this with their own arguments.

A new OUT_DIR is written beside itself and renamed into place (k3train.files.atomic_directory). An existing empty
one is filled in place instead, through a temporary directory inside it: it may be a mount point, which no rename
can replace, and the export then lands on its filesystem, not its parent's. Either way what is written follows the
umask (safetensors and the temporary directory start private), and a failure leaves OUT_DIR as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from k3train.data.tokenizers import HFTokenizer
from k3train.files import atomic_directory, temp_path
from k3train.hf.shards import safetensors_os_errors
from k3train.hf.write import parse_size, write_hf
from k3train.inference.loading import (
    EXPORT_CONFIG,
    EXPORT_TOKENIZER,
    EXPORT_WEIGHTS,
    hf_adapter_for,
    is_hf_directory,
    load,
)


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
            adapter = hf_adapter_for(loaded.model)
            adapter.layout(loaded.model)
    except (ValueError, OSError) as exc:  # bad input: fix the command
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        with _output_directory(out_dir) as tmp:
            if fmt == "hf":
                layout = write_hf(adapter, loaded.model, loaded.tokenizer, tmp, shard_bytes, dtype)
            else:
                write_export(loaded, tmp)
                layout = "k3train"
            _follow_umask(tmp)
    except FileExistsError as exc:  # OUT_DIR appeared, or was filled, meanwhile: it is left as it is
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
    if fmt == "hf":
        print(how_to_load(out_dir, layout))
    return 0


def how_to_load(out_dir: Path, layout: str) -> str:
    """The one line export prints after writing the Hugging Face layout: how transformers loads it. A kimi_k3
    directory carries its own code (k3train/models/k3/hf_remote/), which transformers runs only when told to trust
    it; AutoTokenizer reads config.json too, so it is told the same (else it asks)."""
    trust = ", trust_remote_code=True" if layout == "kimi_k3" else ""
    return (
        f'load it with AutoModelForCausalLM.from_pretrained("{out_dir}"{trust}) and '
        f'AutoTokenizer.from_pretrained("{out_dir}"{trust})'
    )


def write_export(loaded, out: Path) -> None:
    from safetensors.torch import save_model

    with safetensors_os_errors(out / EXPORT_WEIGHTS):  # a full disk is an OSError
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


def _follow_umask(out: Path) -> None:
    """The directory and its files as the umask says (the temporary directory and safetensors' files start
    private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in (out, *out.iterdir()):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def _output_directory(out_dir: Path) -> Iterator[Path]:
    """A directory to fill that becomes out_dir once the block ends without an exception. A missing out_dir:
    atomic_directory's, beside it. An existing (empty) one, a mount point perhaps: a temporary directory inside
    it, whose files are renamed up into it at the end (a kill may leave that directory behind, which nothing
    reads). An exception leaves out_dir missing or empty, as it was."""
    if not out_dir.exists():
        with atomic_directory(out_dir) as tmp:
            yield Path(tmp)
        return
    tmp = Path(tempfile.mkdtemp(prefix=f"{temp_path(out_dir).name}-", dir=out_dir))
    moved: list[Path] = []
    try:
        yield tmp
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        if any(entry != tmp for entry in out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} was filled while it was being written")
        for file in sorted(tmp.iterdir()):
            os.rename(file, out_dir / file.name)
            moved.append(out_dir / file.name)
        tmp.rmdir()
        fd = os.open(out_dir, os.O_RDONLY)  # make the renames durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        for path in moved:
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when all went well
