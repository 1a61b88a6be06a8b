"""Pipeline parallelism (parallel.pp): the model cut by block into stages over pp ranks, micro-batches run through
them by one of torch.distributed.pipelining's schedules (an existing engine: PipelineStage and its schedules).

    Pipeline                    this rank's stage modules (model.pipeline_stage: the Pipelines protocol), their
                                PipelineStages and the schedule; step(x, y, document_ids) runs one update's
                                forward and backward

A step takes the update's rows (gradient_accumulation_steps x batch_size of them) as one batch and splits them into
n_microbatches; the last stage's loss_fn divides each micro-batch's mean loss by n_microbatches before its backward,
as the Trainer divides by gradient_accumulation_steps, and gradients are not scaled again (scale_grads=False), so a
pipelined update sums what an accumulating one does. The geometry (PipelineSettings, stage_bounds, stages_of,
owner_of) is k3train/runtime/parallel_layout.py's, which the planner shares. The schedules: https://docs.pytorch.org/docs/stable/distributed.pipelining.html
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor

from k3train.models.layout import expert_shards
from k3train.runtime.parallel_layout import SCHEDULES, PipelineSettings, owner_of, stage_bounds, stages_of


class Pipeline:
    """This rank's stages of `model` and the schedule that runs them, over the ranks of `group` (one per pp rank,
    in pp order)."""

    def __init__(
        self,
        model: nn.Module,
        settings: PipelineSettings,
        pp_rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        n_microbatches: int,
        micro_shape: tuple[int, int],
        parallelize: Callable[[nn.Module], object] | None = None,
    ) -> None:
        self.settings, self.n_microbatches, self.group = settings, n_microbatches, group
        bounds = stage_bounds(len(model.layers), settings.n_stages)
        # what crosses a cut is in the weights' dtype: fp32, or fp64 under precision=fp64
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.stage_ids = stages_of(pp_rank, settings)
        self.modules = [model.pipeline_stage(*bounds[s]) for s in self.stage_ids]
        # spread over the stage's ranks (FSDP2: each stage its own root) and allocated (a run's `parallelize` does
        # both: k3train/run/build.py), then staged
        for module in self.modules:
            if parallelize is not None:
                parallelize(module)
        # each rank's own routed experts (expert parallelism): averaged apart, by the strategy's finish_gradients
        self.expert_shards = {id(p) for module in self.modules for p in expert_shards(module)}
        rows, seq = micro_shape
        width = self.width = model.config.d_model
        self.stages = [
            PipelineStage(
                module,
                s,
                settings.n_stages,
                device,
                input_args=_example_inputs(module, rows, seq, width, self.dtype),
                output_args=_example_outputs(module, rows, seq, width, self.dtype),
                group=group,
            )
            for s, module in zip(self.stage_ids, self.modules)
        ]
        name, multi = SCHEDULES[settings.schedule]
        schedule_class = get_schedule_class(name)
        stages = self.stages if multi else self.stages[0]
        self.schedule = schedule_class(stages, n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False)

    @property
    def holds_last(self) -> bool:
        return any(m.is_last for m in self.modules)

    @property
    def holds_first(self) -> bool:
        return any(m.is_first for m in self.modules)

    def _loss(self, loss: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        return loss.sum() / self.n_microbatches  # [1]: the micro-batch's mean loss

    def parameters(self):
        for module in self.modules:
            yield from module.parameters()

    def step(
        self, x: torch.Tensor, y: torch.Tensor, document_ids: torch.Tensor | None = None, target_losses=None
    ) -> float | None:
        """One update's forward and backward over the rows x, y [rows, T]; the mean loss over them on a rank that
        holds the last stage, else None. Every rank of the pipeline calls it with the same rows. target_losses (a
        TargetLosses): the last stage adds each target's loss to it, micro-batch by micro-batch in order (the
        schedule hands a non-tensor keyword to every micro-batch as it is)."""
        kwargs = {"targets": y} | ({} if document_ids is None else {"document_ids": document_ids})
        kwargs |= {} if target_losses is None else {"target_losses": target_losses}
        losses: list[torch.Tensor] = []
        args = (x,) if self.holds_first else ()
        self.schedule.step(*args, target=y, losses=losses, **kwargs)
        if not self.holds_last:
            return None
        return float(torch.stack([loss.detach().double() for loss in losses]).sum())

    @torch.no_grad()
    def forward_loss(self, x: torch.Tensor, y: torch.Tensor, document_ids: torch.Tensor | None = None) -> float | None:
        """The mean loss over rows x, y without a backward (evaluation): the stages in turn, each sending what
        crosses its cut to the next stage's rank; the loss on the rank of the last stage, else None. Any number of
        rows: no schedule, so no micro-batch count to match."""
        kwargs = {"targets": y} | ({} if document_ids is None else {"document_ids": document_ids})
        mine = dict(zip(self.stage_ids, self.modules))
        carried: tuple[torch.Tensor, ...] = (x,)
        loss = None
        for stage in range(self.settings.n_stages):
            before = owner_of(stage - 1, self.settings) if stage else None
            here = owner_of(stage, self.settings)
            module = mine.get(stage)
            if module is None:
                continue
            if stage and before != here:  # received from the rank of the stage before
                carried = tuple(
                    torch.empty(*y.shape, self.width, dtype=self.dtype, device=y.device)
                    for _ in range(1 + module.blocks_in)
                )
                for t in carried:
                    dist.recv(t, group=self.group, group_src=before)
            out = module(*carried, **kwargs)
            if module.is_last:
                loss = float(out.double().sum())
                continue
            carried = out
            after = owner_of(stage + 1, self.settings)
            if after != here:
                for t in carried:
                    dist.send(t.contiguous(), group=self.group, group_dst=after)
        return loss

    def reduce_gradients(self, group: dist.ProcessGroup | None) -> None:
        """The stages' replicated gradients averaged over the ranks holding the same stages (DDP's all-reduce, once
        an update: no backward runs through a DDP module here). FSDP2's shards (DTensors) were reduce-scattered by
        the stage's last backward (PipelineStage ends FSDP2's gradient sync itself); the routed experts of expert
        parallelism are the strategy's finish_gradients'."""
        if group is None:
            return
        size = dist.get_world_size(group)
        for p in self.parameters():
            if p.grad is not None and not isinstance(p.grad, DTensor) and id(p) not in self.expert_shards:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(size)


# What crosses a cut, as meta tensors for PipelineStage's buffers. requires_grad: what the stage receives and sends
# has a gradient to return (without it the schedule sends none back and the earlier stages learn nothing).
def _example_inputs(module: nn.Module, rows: int, seq: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    if module.is_first:
        return (torch.empty(rows, seq, dtype=torch.long, device="meta"),)
    return _activations(rows, seq, width, 1 + module.blocks_in, dtype)


def _example_outputs(
    module: nn.Module, rows: int, seq: int, width: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    if module.is_last:
        return (torch.empty(1, dtype=dtype, device="meta", requires_grad=True),)
    return _activations(rows, seq, width, 1 + module.blocks_out, dtype)


def _activations(rows: int, seq: int, width: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(rows, seq, width, dtype=dtype, device="meta", requires_grad=True) for _ in range(n))
