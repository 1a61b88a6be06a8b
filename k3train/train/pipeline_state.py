"""A pipelined run's model and optimizer as checkpoint parts: each rank holds its stages' tensors, and the checkpoint
is the whole model's, as one process would write it, so it resumes on any pp, without pipeline parallelism, in one
process, and is read by generate, evaluate and export as any other. Names are the model's (the stages keep them:
k3train/models/k3/pipeline.py); the optimizer's state is matched to its parameters by name, then numbered as the
whole model's optimizer numbers them. Two ways to write it:

- gathered (`gather=True`, stages under DDP): every stage's tensors gathered to rank 0, which writes the single file;
  the whole model must fit rank 0's memory once;
- sharded by stage (`gather=False`, stages under FSDP2 or HSDP): each rank keeps its stages' tensors (FSDP2's shards)
  in the whole model's format, every rank writes its own shards (k3train/checkpoint/dcp.py's write_sharded, which
  merges the stages' skeletons over the pipeline), and `python -m k3train.consolidate` makes one file of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _gathered(local: dict, group: dist.ProcessGroup | None) -> list[dict]:
    """Every pp rank's `local` on pp rank 0, in pp order ([local] elsewhere); a collective over `group`."""
    if group is None:
        return [local]
    parts: list | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(local, parts, group=group, group_dst=0)
    return [local] if parts is None else parts


class PipelineModel:
    """The model part: state_dict is the whole model's on the writing rank (gathered), or this rank's stages' under
    the model's names (sharded by stage); load_state_dict takes the whole model's (any checkpoint of this model) and
    keeps what this rank's stages hold."""

    def __init__(
        self,
        model: nn.Module,
        stages: list[nn.Module],
        group: dist.ProcessGroup | None,
        gather: bool = True,
        parts: list | None = None,
    ):
        self.model, self.stages, self.group, self.gather = model, stages, group, gather
        self.parts = parts or stages  # each stage as a checkpoint part (its routed experts whole under ep > 1)
        self.held = {k for stage in stages for k in stage.state_dict()}

    def state_dict(self) -> dict:
        local: dict = {}
        for part in self.parts:
            local |= {k: v.detach().clone() if self.gather else v for k, v in part.state_dict().items()}
        if not self.gather:
            return local
        merged: dict = {}
        for part in _gathered(local, self.group):
            merged |= part
        order = list(self.model.state_dict())
        return {k: merged[k] for k in order if k in merged}

    def holds(self, key: str) -> bool:
        """Whether this rank's stages hold the model's tensor `key` (a sharded checkpoint reads those alone)."""
        return key in self.held

    def load_state_dict(self, state: dict) -> None:
        for stage, part in zip(self.stages, self.parts):
            wanted = stage.state_dict()
            missing = sorted(set(wanted) - set(state))
            if missing:
                raise KeyError(f"the checkpoint's model lacks {', '.join(missing[:3])}: it is of another model")
            part.load_state_dict({k: state[k] for k in wanted})


# Each pp rank's own optimizer figures (Muon's orthogonality error per group: a group spans every stage, each stage
# measures its part), kept apart in the checkpoint so that a resume on as many pp ranks gives each its own back;
# the merged copy beside them is what a resume on another layout (or one process) reads.
STAGE_FIGURES = "pipeline_stage_figures"


class PipelineOptimizer:
    """The optimizer part over this rank's stages (`part`: its ConfiguredOptimizer), written and read in the format
    of `whole`, the same optimizer built over the whole model (its parameter order and groups; it holds no state)."""

    def __init__(self, part, optimizer, whole: torch.optim.Optimizer, model: nn.Module, group, gather: bool = True):
        self.part, self.optimizer, self.group, self.gather = part, optimizer, group, gather
        names = {id(p): n for n, p in model.named_parameters()}
        self.local_names = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        self.whole_names = [names[id(p)] for g in whole.param_groups for p in g["params"]]
        self.whole_groups = [{k: v for k, v in g.items() if k != "params"} for g in whole.param_groups]
        self.whole_sizes = [len(g["params"]) for g in whole.param_groups]
        self.local_set = set(self.local_names)

    @property
    def changed(self) -> dict:
        return self.part.changed

    def state_dict(self) -> dict:
        """The whole model's optimizer state: its groups (each from a rank that holds it) and figures gathered; the
        per-parameter state gathered too, or sharded by stage this rank's alone, under the whole model's numbers."""
        local = self.part.state_dict()
        mine = {self.local_names[i]: s for i, s in local["state"].items()}
        entry = {
            "state": mine if self.gather else {},
            "extra": {k: v for k, v in local.items() if k not in ("state", "param_groups")},
            "groups": local["param_groups"],
        }
        state: dict = {} if self.gather else mine
        extra: dict = {}
        saved_settings: dict = {}
        parts = _gathered(entry, self.group)
        if self.group is not None and len(parts) == dist.get_world_size(self.group):  # the rank that has them all
            extra[STAGE_FIGURES] = [part["extra"] for part in parts]
        for part in parts:
            state |= part["state"]
            for key, value in part["extra"].items():  # per-group figures (Muon's orthogonality error): merged
                extra[key] = {**extra.get(key, {}), **value} if isinstance(value, dict) else value
            for group in part["groups"]:
                saved_settings.setdefault(group["name"], group)
        index = {n: i for i, n in enumerate(self.whole_names)}
        groups, start = [], 0
        for settings, size in zip(self.whole_groups, self.whole_sizes):
            current = {k: v for k, v in saved_settings.get(settings["name"], settings).items() if k != "params"}
            per_param = {k: v for k, v in settings.items() if isinstance(v, list)}  # Muon's head_splits: the whole's
            groups.append({**current, **per_param, "params": list(range(start, start + size))})
            start += size
        return {"state": {index[n]: s for n, s in sorted(state.items(), key=lambda e: index[e[0]])},
                "param_groups": groups, **extra}  # fmt: skip

    def holds(self, key: str) -> bool:
        """Whether this rank holds the optimizer state at `key` ('state/<the whole model's number>/...'), so a
        sharded checkpoint reads it."""
        kind, _, number = key.partition("/")
        if kind != "state":
            return True
        number = number.partition("/")[0]
        return not number.isdigit() or self.whole_names[int(number)] in self.local_set

    def load_state_dict(self, saved: dict) -> None:
        names = self._saved_names(saved)
        state = {names[i]: s for i, s in saved.get("state", {}).items()}
        settings = {g["name"]: g for g in saved["param_groups"]}
        local_groups, start = [], 0
        for group in self.optimizer.param_groups:
            size = len(group["params"])
            kept = {k: v for k, v in settings.get(group["name"], group).items() if k != "params"}
            kept |= {k: v for k, v in group.items() if isinstance(v, list) and k != "params"}  # this rank's own
            local_groups.append({**kept, "params": list(range(start, start + size))})
            start += size
        extra = {k: v for k, v in saved.items() if k not in ("state", "param_groups", STAGE_FIGURES)}
        stage_figures = saved.get(STAGE_FIGURES)
        if self.group is not None and len(stage_figures or []) == dist.get_world_size(self.group):
            extra |= stage_figures[dist.get_rank(self.group)]  # this pp rank's own, as it saved them
        local = {
            "state": {i: state[n] for i, n in enumerate(self.local_names) if n in state},
            "param_groups": local_groups,
            **extra,
        }
        self.part.load_state_dict(local)

    def _saved_names(self, saved: dict) -> list[str]:
        sizes = [len(g["params"]) for g in saved["param_groups"]]
        if sizes != self.whole_sizes:
            raise ValueError(
                f"the checkpoint's optimizer has groups of {sizes} parameters, this model's {self.whole_sizes}"
            )
        return self.whole_names


def merge_stage_figures(parts: list[dict], callbacks: dict) -> dict:
    """The train event's figures of every stage's rank as one: the model's (per layer: each stage has its own); the
    optimizer's as they are where every stage reports the same (lr), else each stage's under `pp<rank>/` (a weight
    norm over one stage's part of a group is not the group's); each callback's by its own `merge` when it has one
    (QK-Clip: its MLA layers are on some stages), else pp rank 0's."""
    out = dict(parts[0])
    out["model"] = {k: v for part in parts for k, v in part.get("model", {}).items()}
    if "optimizer" in out:
        figures: dict = {}
        keys = dict.fromkeys(k for part in parts for k in part.get("optimizer", {}))
        for key in keys:
            values = [part.get("optimizer", {}).get(key) for part in parts]
            if all(v == values[0] for v in values):
                figures[key] = values[0]
            else:
                figures |= {f"pp{r}/{key}": v for r, v in enumerate(values) if v is not None}
        out["optimizer"] = figures
    for name, callback in callbacks.items():
        figures = [part[name] for part in parts if name in part]
        merge = getattr(callback, "merge", None)
        if figures:
            out[name] = merge(figures) if merge is not None else figures[0]
    return out
