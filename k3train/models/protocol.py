"""What the Trainer and the runner need from a model: the LanguageModel protocol.

Any torch.nn.Module with these members trains (k3train/models/smoke.py is the smallest example, 70 lines). The
runner checks a built model against it and names what is missing; nothing else probes the model.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class LanguageModel(Protocol):
    # A dataclass of the model's settings: run.json records it and a checkpoint pins it (a resume must match).
    config: Any
    # Prefixed to every log line of the run; "" for a real model, e.g. "[plumbing: smoke_test_lm] " for a check
    # whose numbers must never be read as model results.
    log_label: str

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [B, T] token ids -> (logits [B, T, V], None); with targets [B, T] (x shifted by one token) -> (logits
        or None, loss): the mean next-token cross-entropy over all B*T positions in fp32. A model may skip the
        logits when it has the targets (KimiK3 does: it never builds them whole), so callers that want logits
        call it without targets.

        Optional: a keyword `document_ids` ([B, T] or None, k3train/models/common/documents.py), the documents packed in
        each row, which the model keeps from attending to each other (document masking). The Trainer passes it to a
        forward that names it (takes_document_ids), and only when a batch has boundaries.

        Optional: a keyword `target_losses` (a TargetLosses, k3train/models/common/loss.py), to which a training
        forward adds each target's loss when it is handed one (a mixture's loss per source: the update step hands it
        to a forward that names it; linear_cross_entropy takes it as it is)."""
        ...

    def check_data(self, vocab_size: int, seq_len: int) -> None:
        """Raise ValueError, saying what to change, if data of this vocabulary and sequence length cannot train it."""
        ...

    def diagnostics(self) -> dict[str, float]:
        """Flat, JSON-able health figures of the last training pass (may be empty); logged in every train event."""
        ...

    def param_counts(self) -> dict[str, int]:
        """total, active (what one token uses), embedding."""
        ...


@runtime_checkable
class CountsFlops(Protocol):
    """Optional: a model that knows its own FLOPs per token, so the Trainer can log `mfu` (k3train/observe/mfu.py)."""

    def flops_per_token(self, seq_len: int) -> dict[str, float]:
        """{"forward": ..., "training": ...}: FLOPs per token of a [*, seq_len] batch; training is forward plus
        backward."""
        ...


@runtime_checkable
class Parallelizes(Protocol):
    """Optional: a model that spreads itself over a run's ranks (k3train/models/k3/parallelize.py is KimiK3's), as
    torchtitan's models each have a parallelize function. The parallel strategy (k3train/train/parallel.py) calls it
    once, before the optimizer is built, in one process too; a model without it gets
    k3train.models.common.parallelize.parallelize_blocks (FSDP2 over its blocks, nothing else)."""

    def parallelize(self, dims: Any, fully_shard: Any) -> dict:
        """Spread over `dims` (a ParallelDims); `fully_shard` is a FullyShard (FSDP2's options) under FSDP2, else
        None. Returns the layouts of its sharded-checkpoint tensors beyond FSDP2's own, {what: (mesh,
        placements)} (empty when it has none): under k3train.models.layout.ROUTED_EXPERTS the whole routed-expert
        weights' (k3train/checkpoint/expert_shards.py reads it). A parameter it leaves different on every rank (its
        own slice of a whole) has a layout (k3train/models/layout.py) whose `expert_parallel` is the ranks it is
        split over."""
        ...


@runtime_checkable
class Pipelines(Protocol):
    """Optional: a model that can be cut into pipeline stages by block (parallel.pp; k3train/models/k3/pipeline.py
    is KimiK3's). It has `layers` (its blocks) and `config.d_model` (the width of what crosses a cut)."""

    def pipeline_stage(self, first: int, last: int) -> torch.nn.Module:
        """Layers [first, last) as a module under the model's names, with the embedding when first is 0 and the
        loss when last is the layer count; forward(tokens or (h, *carried), document_ids=, targets=) returns what
        the next stage takes, or on the last the micro-batch's mean loss, shape [1]. It has is_first, is_last,
        blocks_in and blocks_out (how many tensors beside h it receives and sends)."""
        ...


@runtime_checkable
class HasParametrizationBase(Protocol):
    """Optional: a model whose learning rates scale with its width against a base of its family (muP; KimiK3 under
    model.parametrization=mup, k3train/models/k3/mup.py). The optimizer builders (k3train/optim/mup.py) compare each
    parameter's shape, and its matrix views, with the base's of the same name."""

    def parametrization_base(self) -> torch.nn.Module | None:
        """The family's base model on the meta device, its parameters under this model's names; None when this
        model's learning rates do not scale (standard parametrization)."""
        ...


def missing_members(model: object) -> list[str]:
    """The LanguageModel members `model` lacks (empty when it has them all)."""
    methods = [name for name, value in vars(LanguageModel).items() if callable(value) and not name.startswith("_")]
    wanted = [*LanguageModel.__annotations__, *methods]
    return [name for name in wanted if not hasattr(model, name)]


def takes_document_ids(model: object) -> bool:
    """Whether `model`'s forward takes the `document_ids` keyword (document masking). One that does not sees each
    row as one sequence, as before document masking existed."""
    return "document_ids" in inspect.signature(model.forward).parameters


def document_inputs(model: object, document_ids: torch.Tensor | None, device: torch.device) -> dict:
    """The document keyword for model.forward: {"document_ids": ...} on `device` when the batch has boundaries and
    the model takes them, else {} (a model without the keyword is called as before)."""
    if document_ids is None or not takes_document_ids(model):
        return {}
    return {"document_ids": document_ids.to(device, non_blocking=True)}
