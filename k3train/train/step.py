"""One update's work on this rank, between the loop and the model: an update's micro-batches in, gradients on the
parameters and the update's loss out (OLMo-core splits its Trainer from its TrainModule the same way).

    UpdateStep          what the Trainer asks of one (the protocol below)
    DataParallelStep    every rank holds the whole depth of the model (one process, DDP, FSDP2, HSDP, + ep, + cp):
                        each micro-batch's forward and backward in turn, gradients synchronised on the last
                        (no_sync before), the strategy's finishing (expert-parallel weights), the mean over dp
    PipelineStep        parallel.pp > 1: this rank's stages run by the pipeline's schedule (k3train/train/pipeline.py),
                        the stages' gradients averaged over their data-parallel ranks, the last stage's loss
                        broadcast over the pipeline; its checkpoint is the whole model's (pipeline_state.py)

k3train/run/build.py picks one (the only place that asks whether a run is pipelined); the Trainer runs whichever it
is given: the loop, the optimizer step and its guard, the cadence of evals and checkpoints.

A mixture's per-target losses (its train loss per source) are the step's return value: `forward_backward(...,
per_target=True)` hands the model's forward a TargetLosses (k3train/models/common/loss.py), which its loss fills,
and returns what it collected in row order (StepLoss.by_target). A model whose forward takes no `target_losses`
(a plug-in) gives none: no figure per source rather than a guess.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from k3train.checkpoint.expert_shards import expert_sharded_model, expert_sharded_optimizer, with_expert_shards
from k3train.models.common.loss import TargetLosses
from k3train.models.layout import ROUTED_EXPERTS, expert_shards
from k3train.models.protocol import LanguageModel, document_inputs
from k3train.runtime.distributed import mean_across_ranks
from k3train.runtime.parallel_dims import ParallelDims
from k3train.runtime.parallel_layout import owner_of
from k3train.train.parallel import DDP
from k3train.train.pipeline import Pipeline
from k3train.train.pipeline_state import PipelineModel, PipelineOptimizer, merge_stage_figures
from k3train.train.precision import Precision

# Accumulation: each micro-batch's mean loss is divided by the number of micro-batches, so k micro-batches of B/k
# sequences give the gradient of one batch of B (every micro-batch has the same token count). For a model whose
# training forward changes its own state (a router bias, say) this is arithmetic, not a promise of identical
# results: k micro-batches see k state changes where one big batch would see one.
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # rows, targets, document ids (None: one a row)


@dataclass
class StepLoss:
    """An update's loss: the global batch's mean over every data-parallel rank (the same on every rank, so every
    rank takes the same skip-or-step decision), and with per_target, this rank's forwards' (losses, kept) in the
    order of its rows."""

    loss: float
    by_target: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class UpdateStep(Protocol):
    model: LanguageModel  # the whole model, unwrapped (its names are the checkpoint's; on the meta device under pp)
    params: list[torch.Tensor]  # this rank's parameters the optimizer updates
    expert_shards: frozenset[int]  # ids of those each rank holds its own part of (a norm sums them over ep)
    precision: Precision
    scaler: torch.amp.GradScaler
    device: torch.device
    dims: ParallelDims

    def forward_backward(self, batches: list[Batch], per_target: bool = False) -> StepLoss:
        """The update's micro-batches forward and backward: gradients on `params`, ready for the optimizer."""
        ...

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """A val batch's mean loss (no gradient; evaluate() sets the mode and restores the state)."""
        ...

    def checkpoint_parts(self, parts: dict, optimizer: torch.optim.Optimizer) -> dict:
        """The Checkpointer's parts with "model" and "optimizer" as this layout writes and reads them."""
        ...

    def figures(self, local: dict, callbacks: dict) -> dict:
        """A train event's diagnostics from this rank's (every stage's, under pp)."""
        ...

    def buffers(self) -> list[torch.Tensor]:
        """The persistent buffers of the modules this rank runs: what a forward may move besides the gradients
        (a MoE's balancing bias), and a skipped update puts back."""
        ...


def persistent_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """Every persistent buffer of `modules` (those their state_dict holds), once each."""
    out, seen = [], set()
    for module in modules:
        for sub in module.modules():
            for name, buffer in sub.named_buffers(recurse=False):
                if buffer is not None and name not in sub._non_persistent_buffers_set and id(buffer) not in seen:
                    seen.add(id(buffer))
                    out.append(buffer)
    return out


def takes_target_losses(model: nn.Module) -> bool:
    """Whether the model's forward takes a `target_losses` keyword (k3train/models/protocol.py)."""
    return "target_losses" in inspect.signature(model.forward).parameters


class DataParallelStep:
    """Every rank holds the model's whole depth (module docstring). `parallel`: the strategy that sharded it (DDP()
    for one process), which wraps it here (DDP's module, or the model itself); `compile`: torch.compile outside
    that wrapper, as torch recommends (its DDPOptimizer splits the graph at the gradient buckets)."""

    def __init__(
        self,
        model: LanguageModel,
        precision: Precision,
        device: torch.device,
        parallel=None,
        dims: ParallelDims | None = None,
        compile: bool = False,
    ):
        self.model, self.precision, self.device = model, precision, device
        self.parallel = parallel or DDP()
        self.dims = dims or ParallelDims(device_type=device.type)
        self.scaler = precision.make_scaler(device)
        self.replicated = self.parallel.wrap(model, device, self.dims)  # the model itself in one process
        self.forward = torch.compile(self.replicated) if compile else self.replicated
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.expert_shards = frozenset(id(p) for p in expert_shards(model))
        self.takes_target_losses = takes_target_losses(model)
        self._buffers: list[torch.Tensor] | None = None

    def forward_backward(self, batches: list[Batch], per_target: bool = False) -> StepLoss:
        losses = []
        collect = {"target_losses": TargetLosses()} if per_target and self.takes_target_losses else {}
        for i, (x, y, document_ids) in enumerate(batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            documents = document_inputs(self.model, document_ids, self.device)  # {} without boundaries
            last = i == len(batches) - 1  # only its backward all-reduces the gradients across ranks
            with self.parallel.no_sync(self.replicated) if not last else contextlib.nullcontext():
                with self.precision.autocast(self.device):
                    _, loss = self.forward(x, targets=y, **documents, **collect)
                self.scaler.scale(loss / len(batches)).backward()
            losses.append(loss.detach().double())  # exact for fp32 and fp64 losses alike
        self.parallel.finish_gradients(self.model, self.dims)  # e.g. expert-parallel weights, which DDP leaves out
        # The global batch's loss, so every rank takes the same skip-or-step decision (a NaN anywhere is NaN here).
        loss = mean_across_ranks(torch.stack(losses).mean().item(), self.device, self.dims.dp_group)
        return StepLoss(loss, collect["target_losses"].parts if collect else [])

    def eval_loss(self, x, y, document_ids) -> torch.Tensor:
        _, loss = self.model(x, targets=y, **document_inputs(self.model, document_ids, self.device))
        return loss

    def checkpoint_parts(self, parts: dict, optimizer: torch.optim.Optimizer) -> dict:
        experts = self.parallel.model_layouts.get(ROUTED_EXPERTS)  # the routed experts whole under ep > 1
        return with_expert_shards(parts, self.model, optimizer, experts)

    def figures(self, local: dict, callbacks: dict) -> dict:
        return local

    def buffers(self) -> list[torch.Tensor]:
        if self._buffers is None:  # found once: the update loop asks every update
            self._buffers = persistent_buffers([self.model])
        return self._buffers


class PipelineStep:
    """parallel.pp > 1 (module docstring). `model`: the whole model on the meta device (its names and its optimizer
    layout are the checkpoint's); `whole_optimizer`: an optimizer of it, without state, whose numbering the
    checkpoint keeps; `gather`: a single-file checkpoint gathered from the stages (DDP), else sharded by stage."""

    def __init__(
        self,
        pipeline: Pipeline,
        model: LanguageModel,
        whole_optimizer: torch.optim.Optimizer,
        precision: Precision,
        device: torch.device,
        parallel,
        dims: ParallelDims,
        gather: bool,
    ):
        self.pipeline, self.model, self.whole_optimizer = pipeline, model, whole_optimizer
        self.precision, self.device, self.parallel, self.dims, self.gather = precision, device, parallel, dims, gather
        self.scaler = precision.make_scaler(device)  # fp16 is refused with pp: a no-op scaler
        self.params = [p for p in pipeline.parameters() if p.requires_grad]
        self.expert_shards = frozenset(id(p) for p in expert_shards(model))
        self.takes_target_losses = all(takes_target_losses(m) for m in pipeline.modules)
        self._buffers: list[torch.Tensor] | None = None

    def forward_backward(self, batches: list[Batch], per_target: bool = False) -> StepLoss:
        """One schedule step over the update's micro-batches (every forward and backward), the stages' gradients
        averaged over their data-parallel ranks; the global batch's loss on every rank."""
        x = torch.cat([b[0] for b in batches]).to(self.device)
        y = torch.cat([b[1] for b in batches]).to(self.device)
        ids = [b[2] for b in batches]
        documents = None
        if any(d is not None for d in ids):  # a micro-batch without boundaries is one document a row
            documents = torch.cat([torch.zeros_like(b[0]) if d is None else d for b, d in zip(batches, ids)])
            documents = documents.to(self.device)
        collected = TargetLosses() if per_target and self.takes_target_losses else None  # on the last stage's rank
        with self.precision.autocast(self.device):
            loss = self.pipeline.step(x, y, documents, collected)
        self.pipeline.reduce_gradients(self.dims.dp_group)
        for stage in self.pipeline.modules:  # e.g. expert-parallel weights, which the pipeline's average leaves out
            self.parallel.finish_gradients(stage, self.dims)
        loss = self._from_last_stage(loss)
        by_target = collected.parts if collected is not None else []
        return StepLoss(mean_across_ranks(loss, self.device, self.dims.dp_group), by_target)

    def eval_loss(self, x, y, document_ids) -> float:
        return self._from_last_stage(self.pipeline.forward_loss(x, y, document_ids))

    def _from_last_stage(self, loss: float | None) -> float:
        """A figure of the last stage's rank, on every rank of its pipeline."""
        t = torch.tensor([math.nan if loss is None else loss], dtype=torch.float64, device=self.device)
        src = owner_of(self.pipeline.settings.n_stages - 1, self.pipeline.settings)
        dist.broadcast(t, group=self.dims.pp_group, group_src=src)
        return t.item()

    def checkpoint_parts(self, parts: dict, optimizer: torch.optim.Optimizer) -> dict:
        """The whole model's checkpoint: gathered from the stages, or sharded by stage."""
        experts = self.parallel.model_layouts.get(ROUTED_EXPERTS)
        stages = [expert_sharded_model(m, experts) for m in self.pipeline.modules]
        modules = nn.ModuleList(self.pipeline.modules)
        held = expert_sharded_optimizer(parts["optimizer"], optimizer, modules, experts)
        group, gather = self.dims.pp_group, self.gather
        parts["model"] = PipelineModel(self.model, self.pipeline.modules, group, gather, parts=stages)
        parts["optimizer"] = PipelineOptimizer(held, optimizer, self.whole_optimizer, self.model, group, gather)
        return parts

    def figures(self, local: dict, callbacks: dict) -> dict:
        """Each rank measured its own stages' layers: the log has every stage's."""
        parts = [None] * dist.get_world_size(self.dims.pp_group)
        dist.all_gather_object(parts, local, group=self.dims.pp_group)
        return merge_stage_figures(parts, callbacks)

    def buffers(self) -> list[torch.Tensor]:
        if self._buffers is None:  # found once: the update loop asks every update
            self._buffers = persistent_buffers(self.pipeline.modules)
        return self._buffers
