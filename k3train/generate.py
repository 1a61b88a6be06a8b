"""`python -m k3train.generate RUN_DIR_OR_CHECKPOINT --prompt "..."`: sample text from a trained model.

The prompt is prefilled in one forward, then tokens are decoded one at a time from the model's cache (KDA's
recurrent state, MLA's latent cache: k3train/inference/sampling.py) and streamed to stdout. Timing goes to stderr.
"""

from __future__ import annotations

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import argparse
import sys
import time
from pathlib import Path

import torch

from k3train.inference.loading import Loaded, load
from k3train.inference.sampling import Sampler, generate, supports_cache
from k3train.runtime.devices import parse_device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3train.generate", description=__doc__.split("\n")[0])
    p.add_argument(
        "source", help="a run directory (its last.pt or last.dcp), a checkpoint (.pt or .dcp), or an export directory"
    )
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="the text to continue")
    prompts.add_argument("--prompt-file", type=Path, help="a file of prompts, one per line, each continued in turn")
    p.add_argument(
        "--max-new-tokens", type=int, default=200, help="tokens to add to each prompt (default: %(default)s)"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all; default: %(default)s)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="keep the smallest set with this much probability (default: %(default)s)",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=1,
        help="continuations per prompt, decoded as one batch (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--no-cache", action="store_true", help="recompute the full forward for every token (the reference)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.max_new_tokens < 1 or args.num_samples < 1:
            raise ValueError("--max-new-tokens and --num-samples must be >= 1")
        sampler = Sampler(args.temperature, args.top_k, args.top_p)
        prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompt_file)
        loaded = load(args.source, parse_device(args.device, "--device"))
    except (ValueError, OSError) as exc:  # SourceError, CheckpointError and bad options are ValueErrors
        print(f"k3train.generate: error: {exc}", file=sys.stderr)
        return 2
    generator = torch.Generator(next(loaded.model.parameters()).device).manual_seed(args.seed)
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"=== prompt {i + 1}/{len(prompts)}", flush=True)
        try:
            continue_prompt(loaded, prompt, args, sampler, generator)
        except ValueError as exc:
            print(f"k3train.generate: error: {exc}", file=sys.stderr)
            return 2
    return 0


def continue_prompt(
    loaded: Loaded, prompt: str, args: argparse.Namespace, sampler: Sampler, generator: torch.Generator
) -> None:
    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    ids = torch.from_numpy(tokenizer.encode_batch([prompt])[0].astype("int64")).to(device)
    check_length(loaded, len(ids) + args.max_new_tokens)
    batch = ids[None].expand(args.num_samples, -1).contiguous()
    stream = StreamPrinter(tokenizer) if args.num_samples == 1 else None
    if stream:
        print(prompt, end="", flush=True)
    use_cache = not args.no_cache
    new_tokens, start, stamps = [], time.perf_counter(), []
    for token in generate(model, batch, args.max_new_tokens, sampler, generator, use_cache=use_cache):
        stamps.append(time.perf_counter())  # the first one comes after the prefill
        new_tokens.append(token)
        if stream:
            stream.add(int(token[0]))
    if stream:
        stream.finish()
    else:
        for j, sample in enumerate(torch.stack(new_tokens, dim=1).tolist()):
            print(f"--- sample {j + 1}/{args.num_samples}\n{prompt}{tokenizer.decode(sample)}", flush=True)
    decoded = args.num_samples * (len(stamps) - 1)
    rate = f"{decoded / (stamps[-1] - stamps[0]):,.1f}" if decoded else "-"
    way = "incremental (KDA state + MLA latent cache)" if use_cache and supports_cache(model) else "full recompute"
    print(
        f"[{len(ids)} prompt tokens in {stamps[0] - start:.2f} s; {args.num_samples} x {args.max_new_tokens} new "
        f"tokens, {rate} tok/s decoding, {way}, {device}]",
        file=sys.stderr,
        flush=True,
    )


class StreamPrinter:
    """Prints new text as tokens arrive, holding back bytes that do not yet form a whole UTF-8 character."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # an unfinished character decodes as U+FFFD until its last byte comes
            print(text[self.printed :], end="", flush=True)
            self.printed = len(text)

    def finish(self) -> None:
        print(self.tokenizer.decode(self.ids)[self.printed :], flush=True)


def check_length(loaded: Loaded, total: int) -> None:
    config = loaded.model.config
    if getattr(config, "mla_rope", False) and total > config.max_seq_len:
        raise ValueError(
            f"prompt + --max-new-tokens = {total} positions exceeds the model's max_seq_len="
            f"{config.max_seq_len} (its rotary table): shorten the prompt or lower --max-new-tokens"
        )
    if total > config.max_seq_len:
        print(
            f"[note: {total} positions is beyond the {config.max_seq_len} the model was built for; "
            "KDA and NoPE MLA run past it, untrained]",
            file=sys.stderr,
        )


def read_prompts(path: Path) -> list[str]:
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts: write one prompt per line")
    return prompts


if __name__ == "__main__":
    raise SystemExit(main())
