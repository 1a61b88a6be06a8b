"""`python -m k3train.evaluate RUN_DIR_OR_CHECKPOINT [data=prepared data.path=...]`: loss, perplexity and bits
per byte of a trained model on a dataset's val split (by default the data it trained on), written as JSON beside
the checkpoint. The loss is k3train/train/evaluate.py's, the one training reports.
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import argparse
import json
import math
import sys

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from k3train.config import register_configs
from k3train.data.tokenizers import ByteTokenizer
from k3train.files import write_atomic
from k3train.inference.loading import Loaded, load
from k3train.runtime.devices import parse_device
from k3train.train.evaluate import evaluate
from k3train.train.precision import Precision


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3train.evaluate", description=__doc__.split("\n")[0])
    p.add_argument(
        "source", help="a run directory (its last.pt or last.dcp), a checkpoint (.pt or .dcp), or an export directory"
    )
    p.add_argument("overrides", nargs="*", help="data overrides as in training: data=prepared data.path=DIR")
    p.add_argument(
        "--split", choices=("val", "train"), default="val", help="which split of the dataset (default: %(default)s)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward (default: %(default)s)")
    p.add_argument("--seq-len", type=int, help="default: the run's train.seq_len, else the model's max_seq_len")
    p.add_argument(
        "--max-batches",
        type=int,
        help="default: the whole split; training's val loss is over its first train.eval_batches (8 by default)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        loaded = load(args.source, parse_device(args.device, "--device"))
        data = instantiate(data_config(loaded, args.overrides))
        result = evaluate_split(loaded, data, args)
    except (ValueError, OSError, HydraException, OmegaConfBaseException) as exc:
        cause = exc.__cause__ if isinstance(exc, HydraException) and exc.__cause__ else exc  # the data's own error
        print(f"k3train.evaluate: error: {cause}", file=sys.stderr)
        return 2
    out = loaded.path.with_name(f"{loaded.path.stem}.eval.{args.split}.{result['data']['fingerprint'][:12]}.json")
    if loaded.path.is_dir():  # an export: the result goes inside it
        out = loaded.path / f"eval.{args.split}.{result['data']['fingerprint'][:12]}.json"
    try:
        write_atomic(out, lambda f: f.write(json.dumps(result, indent=2).encode() + b"\n"))
    except OSError as exc:  # the work is done but not kept: a failure during work, not bad input
        print(f"k3train.evaluate: error: writing {out} failed ({exc.strerror or exc})", file=sys.stderr)
        return 1
    print(
        f"{args.split}: loss {result['loss']:.4f} | perplexity {result['perplexity']:.3f} | "
        f"bits/byte {result['bits_per_byte']:.4f} | {measured(result, args)} -> {out}"
    )
    return 0


def measured(result: dict, args: argparse.Namespace) -> str:
    """What the loss averaged over, so that it is not read as training's final val loss, which averages the first
    train.eval_batches batches (the run's eval events say how many tokens): the same number only over the same rows."""
    rows = f"{result['batches']} batches of {result['batch_size']} x {result['seq_len']}, {result['tokens']:,} tokens"
    if result["whole_split"]:
        return f"the whole {args.split} split ({rows}; training's val loss reads its first train.eval_batches only)"
    return f"the first {rows} of the {args.split} split"


def data_config(loaded: Loaded, overrides: list[str]) -> dict:
    """The data node the model trained on, or the one these overrides compose (as `python -m k3train` would); either
    way with the document masking the model trained with, unless an override sets data.document_masking."""
    if not overrides:
        if loaded.data is None:
            raise ValueError(
                f"{loaded.path} does not say which data it trained on: name a dataset, e.g. data=prepared data.path=DIR"
            )
        return {**loaded.data, **trained_masking(loaded.data)}
    foreign = [o for o in overrides if not o.lstrip("+~").startswith("data")]
    if foreign:
        raise ValueError(f"evaluate takes only data overrides (data=..., data.path=...); got {foreign}")
    register_configs()
    with initialize_config_module("k3train.conf", version_base="1.3"):
        node = OmegaConf.to_container(compose("config", overrides=overrides).data, resolve=True)
    if loaded.data is None or any("document_masking" in o for o in overrides) or "document_masking" not in node:
        return node
    return {**node, **trained_masking(loaded.data)}


def trained_masking(run_data: dict) -> dict:
    """{"document_masking": what the run trained with} for a k3train data node: its own setting, or off for a run
    from before the setting existed (it trained each row as one sequence); {} for a data class of another kind."""
    if not str(run_data.get("_target_", "")).startswith("k3train.data.TokenData"):
        return {}
    return {"document_masking": run_data.get("document_masking", False)}


def evaluate_split(loaded: Loaded, data, args: argparse.Namespace) -> dict:
    model, tokenizer = loaded.model, loaded.tokenizer
    for option in ("batch_size", "seq_len", "max_batches"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            raise ValueError(f"--{option.replace('_', '-')}={getattr(args, option)} must be >= 1")
    if data.identity()["tokenizer"] != tokenizer.identity():
        raise ValueError(
            f"{data.path} was prepared with tokenizer {data.identity()['tokenizer']}, the model with "
            f"{tokenizer.identity()}: prepare it with the model's tokenizer"
        )
    seq_len = args.seq_len or loaded.seq_len or model.config.max_seq_len
    model.check_data(data.vocab_size, seq_len)
    loader = dict(zip(("train", "val"), data.loaders(args.batch_size, seq_len)))[args.split]
    batches = loader_batches = loader.batches_remaining()
    if args.max_batches is not None:
        batches = min(batches, args.max_batches)
    if batches < 1:
        raise ValueError(
            f"the {args.split} split of {data.path} holds fewer than {args.batch_size} x {seq_len} "
            "tokens: lower --batch-size or --seq-len"
        )
    device = next(model.parameters()).device
    result = evaluate(model, loader, batches, Precision("fp32"), device)
    tokens, text_bytes = result["val_tokens"], count_text_bytes(loader, batches, tokenizer)
    return {
        "source": str(loaded.path),
        "step": loaded.step,
        "split": args.split,
        "data": {k: v for k, v in data.identity().items() if k in ("fingerprint", "val_fingerprint", "tokenizer")},
        "batch_size": args.batch_size,
        "seq_len": seq_len,
        "batches": result["batches"],
        "whole_split": result["batches"] == loader_batches,
        "tokens": tokens,
        "bytes": text_bytes,
        "loss": result["loss"],
        "perplexity": math.exp(result["loss"]),
        # Nats per token times tokens per byte, in bits: comparable across tokenizers.
        "bits_per_byte": result["loss"] * tokens / (math.log(2) * text_bytes),
    }


def count_text_bytes(loader, batches: int, tokenizer) -> int:
    """UTF-8 bytes of the target tokens of the first `batches` batches (end-of-document ids count none)."""
    loader.reset()
    total = 0
    for _ in range(batches):
        targets = loader.next_batch().targets.numpy()
        if isinstance(tokenizer, ByteTokenizer):
            total += int((targets != tokenizer.eod_id).sum())
        else:
            total += sum(len(tokenizer.decode(row[row != tokenizer.eod_id]).encode()) for row in targets)
    loader.reset()
    return total


if __name__ == "__main__":
    raise SystemExit(main())
