"""k3train models in EleutherAI's lm-evaluation-harness (lm_eval 0.4.x): the `k3train` model of its registry.

`K3TrainLM(path=RUN_DIR_OR_CHECKPOINT)` opens what k3train/inference/loading.py opens (a run directory, a
checkpoint, an export or a Hugging Face Kimi directory) with the run's own tokenizer (byte or BPE), and answers
lm_eval's three request kinds through k3train's own model:

- loglikelihood: context and continuation are split by tokens as lm_eval's HFLM splits them (the whole text
  encoded, the context's tokens cut off its front); the continuation's tokens' log-probabilities (fp32 log-softmax
  of the model's logits) are summed, and is_greedy says whether each was the argmax. Requests are batched, longest
  first, padded on the right (a causal model's earlier positions never see the padding). A text longer than the
  model's context keeps its last max_length + 1 tokens, as HFLM does (max_length: the model's max_seq_len).
- loglikelihood_rolling: lm_eval's rolling windows of max_length tokens, each scored as above.
- generate_until: k3train's sampler and cache (k3train/inference/sampling.py: KDA state and MLA latent cache),
  greedy unless the task asks for a temperature, stopping at the task's `until` strings or end-of-document.

lm_eval 0.4.x finds models only in its own registry (no plugin entry point), so `lm_eval --model k3train` works
in a process that has imported this module: `python -m k3train.lm_eval ...` registers it and runs lm_eval's CLI.
`K3TrainLM.from_model` wraps a model already in memory (the training loop's in-loop tasks).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from k3train.data.tokenizers import Tokenizer
from k3train.inference.loading import load
from k3train.inference.sampling import Sampler, generate
from k3train.runtime.devices import parse_device

DEFAULT_MAX_GEN_TOKS = 256
DEFAULT_BATCH_SIZE = 8  # rows a forward, unless model_args or lm_eval's --batch_size says otherwise


def token_logprobs(logits: torch.Tensor, targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] at the positions that predict targets -> each target's log-probability (fp32 log-softmax, as
    the model's cross-entropy takes it) and whether it was the argmax."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, device=logprobs.device)
    return logprobs.gather(-1, target[:, None]).squeeze(-1), logprobs.argmax(-1) == target


@register_model("k3train")
class K3TrainLM(TemplateLM):
    """lm_eval's `k3train` model. model_args: path (required), device (auto), batch_size (8), max_length (the
    model's max_seq_len, the positions it was built for; a run trained at a shorter train.seq_len may do better at
    that: max_length=<train.seq_len>)."""

    def __init__(
        self,
        path: str | Path | None = None,
        device: str | None = None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_length: int | str | None = None,
        **_ignored,
    ) -> None:
        super().__init__()
        if path is None:
            raise ValueError("the k3train model needs model_args path=RUN_DIR_OR_CHECKPOINT")
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's CLI passes its default, cuda:0, when --device is not given; HFLM then runs on the CPU too
            print(f"[k3train: device={device} but CUDA is not available here: running on the CPU]", file=sys.stderr)
            device = "cpu"
        loaded = load(path, parse_device(device or "auto", "device"))
        self._setup(loaded.model, loaded.tokenizer, max_length, batch_size)

    @classmethod
    def from_model(
        cls, model: nn.Module, tokenizer: Tokenizer, max_length: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE
    ) -> K3TrainLM:
        """The adapter around a model in memory (in eval mode: the caller sets and restores its mode)."""
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        self._setup(model, tokenizer, max_length, batch_size)
        return self

    def _setup(self, model: nn.Module, tokenizer: Tokenizer, max_length, batch_size) -> None:
        self.model, self.tok = model, tokenizer
        self._max_length = int(max_length) if max_length else int(model.config.max_seq_len)
        # lm_eval passes "auto" or "auto:N" for a batch size it should search; k3train takes a number
        self.batch_size = int(batch_size) if str(batch_size).isdigit() and int(batch_size) > 0 else DEFAULT_BATCH_SIZE

    # ---- what lm_eval asks of a TemplateLM -------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eod_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.identity().get("name", "k3train"))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return [int(i) for i in self.tok.encode_batch([string])[0]]

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tok.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation), context ids, continuation ids) -> (sum of the continuation's log-probs,
        whether every continuation token was the argmax)."""
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm_eval asked for the loglikelihood of an empty continuation")
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens is longer than max_length={self.max_length}: "
                    "raise max_length (model_args) or shorten the task's answers"
                )
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((whole[:-1], whole[-len(continuation) :]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = len(rows[chunk[0]][0])
            x = torch.full((len(chunk), width), self.eot_token_id, dtype=torch.long)
            for r, i in enumerate(chunk):
                x[r, : len(rows[i][0])] = torch.tensor(rows[i][0])
            logits = self.model(x.to(self.device))[0]
            for r, i in enumerate(chunk):
                inputs, targets = rows[i]
                chosen, greedy = token_logprobs(logits[r, len(inputs) - len(targets) : len(inputs)], targets)
                results[i] = (float(chosen.double().sum()), bool(greedy.all()))
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in windows of max_length tokens (the first after end-of-document)."""
        out = []
        for request in requests:
            (string,) = request.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scored = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            out.append(sum(logprob for logprob, _ in scored))
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued by k3train's generation (its cache where the model has one) until one of the
        request's `until` strings or end-of-document; the text before the stop string."""
        out = []
        for request in requests:
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            temperature = float(gen_kwargs.pop("temperature", 0.0) or 0.0)
            if not gen_kwargs.pop("do_sample", temperature > 0):
                temperature = 0.0
            sampler = Sampler(temperature, int(gen_kwargs.pop("top_k", 0) or 0), float(gen_kwargs.pop("top_p", 1.0)))
            ids = self.tok_encode(context) or [self.eot_token_id]
            ids = ids[-max(1, self.max_length - max_new) :]
            prompt = torch.tensor([ids], device=self.device)
            generator = torch.Generator(self.device).manual_seed(int(gen_kwargs.pop("seed", 0)))
            new: list[int] = []
            text = ""
            for token in generate(self.model, prompt, max_new, sampler, generator):
                if int(token[0]) == self.eot_token_id:
                    break
                new.append(int(token[0]))
                text = self.tok.decode(new)
                # a trailing U+FFFD may be a character whose bytes have not all come yet (the next token completes
                # it): stop strings are looked for before it, or a stop containing U+FFFD would match too early
                if any(stop in text.rstrip("\ufffd") for stop in until):
                    break
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out
