"""Initial weights that do not depend on how the model is laid out over ranks, and filling a model's tensors from
any source of whole-model values, each rank only the part it holds.

A model declares how each of its tensors starts (`init_rules()`: {name: Normal(std) | Constant(value) |
Uniform(low, high, then)}, the names those of its state_dict), and every random value is drawn by counter: a
tensor's values, in row-major order, are cut into blocks of BLOCK_VALUES, and block k of tensor `name` is drawn by
its own generator, seeded with a hash of (seed, name, k). A rank that holds part of a tensor (FSDP2's dim-0 or
dim-1 shard, an expert-parallel slice, a pipeline stage's layers) draws only the blocks its part falls in (its
part's contiguous runs: one for a dim-0 shard, one an expert for a dim-1 shard of stacked experts) and keeps its
values: the same, bit for bit, that one process holding the whole model draws, under any layout. torch's own
generator cannot do this: one stream per tensor, whose values depend on how many were drawn before. (torchtitan
gets layout-free draws from DTensor's offset-based Philox RNG, which exists on CUDA only.) Draws are made on the CPU
in fp32 and cast to the tensor's dtype and device, as `nn.init` on a CPU-built fp32 model followed by `.to()` gave.

`fill(module, source)` writes every parameter and persistent buffer of `module` from `source(name, whole_shape,
region)`, a callable giving the values of `region` (a slice per dim) of the whole tensor `name`: InitialWeights
(the rules above), a Hugging Face directory, export or checkpoint read slice by slice (k3train/inference/slices.py:
train.init_from), or a model already built whole (WholeModel: a model without init rules). Where a tensor sits in
its whole comes from the tensor (a DTensor's mesh and placements) and from the layout table
(k3train/models/layout.py: an expert-parallel slice's group). `materialise(module, device, source)` allocates a
module built on the meta device (every rank builds the model there, then cuts and shards it) and fills it; modules
with non-persistent buffers derived from their config (RotaryEmbedding) recompute them in `reset_buffers()`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from k3train.models.layout import WHOLE, parameter_layouts

# Values a generator draws at a time (256 KiB in fp32): small enough that a rank holding two rows of a [7168, 7168]
# weight (K3 over 4,096 ranks) draws under 5x what it keeps, large enough that seeding a generator per block costs
# little beside the draw.
BLOCK_VALUES = 1 << 16

Region = tuple[slice, ...]
Source = Callable[[str, tuple[int, ...], Region], torch.Tensor]


@dataclass(frozen=True)
class Normal:
    std: float
    random = True

    def fill(self, block: torch.Tensor, generator: torch.Generator) -> None:
        block.normal_(0.0, self.std, generator=generator)


@dataclass(frozen=True)
class Constant:
    value: float
    random = False

    def fill(self, block: torch.Tensor, generator: torch.Generator | None) -> None:
        block.fill_(self.value)


@dataclass(frozen=True)
class Uniform:
    """U(low, high), then `then` applied elementwise (e.g. torch.log for a log-uniform decay rate)."""

    low: float
    high: float
    then: Callable[[torch.Tensor], torch.Tensor] | None = None
    random = True

    def fill(self, block: torch.Tensor, generator: torch.Generator) -> None:
        block.uniform_(self.low, self.high, generator=generator)
        if self.then is not None:
            block.copy_(self.then(block))


Rule = Normal | Constant | Uniform
ZERO, ONE = Constant(0.0), Constant(1.0)


def conv_default(weight_shape: tuple[int, ...]) -> Uniform:
    """nn.Conv1d's own initialisation (kaiming_uniform_ with a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(math.prod(weight_shape[1:]))
    return Uniform(-bound, bound)


def declared_rules(model: nn.Module) -> dict[str, Rule]:
    """The rules every submodule of `model` with an `init_rules()` of its own declares, under `model`'s names."""
    table = {}
    for prefix, module in model.named_modules():
        if module is model or not hasattr(type(module), "init_rules"):
            continue
        for name, rule in module.init_rules().items():
            table[f"{prefix}.{name}" if prefix else name] = rule
    return table


def _generator(seed: int, name: str, block: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def runs(shape: tuple[int, ...], region: Region) -> Iterator[tuple[int, int]]:
    """The [start, stop) ranges of row-major flat indices that `region` of a tensor of `shape` covers, in order,
    adjacent ones merged: one for a whole tensor or a slice of whole rows; one a leading index otherwise."""
    partial = [d for d, s in enumerate(region) if (s.start, s.stop) != (0, shape[d])]
    if not partial:
        yield 0, math.prod(shape)
        return
    k = partial[-1]  # the dims after it are whole: each index of the dims before it is one contiguous run
    inner = math.prod(shape[k + 1 :])
    strides = [math.prod(shape[d + 1 :]) for d in range(k)]
    length = (region[k].stop - region[k].start) * inner
    run = None
    for index in itertools.product(*(range(s.start, s.stop) for s in region[:k])):
        start = sum(i * stride for i, stride in zip(index, strides)) + region[k].start * inner
        if run is not None and run[1] == start:
            run = (run[0], start + length)
            continue
        if run is not None:
            yield run
        run = (start, start + length)
    yield run


def draw(rule: Rule, seed: int, name: str, shape: tuple[int, ...], region: Region | None = None) -> torch.Tensor:
    """The fp32 values of `region` (default: all) of tensor `name` of whole shape `shape`, drawn block by block."""
    shape = tuple(shape)
    region = region if region is not None else tuple(slice(0, n) for n in shape)
    out = torch.empty([s.stop - s.start for s in region])
    if not rule.random:
        rule.fill(out, None)
        return out
    if out.numel() == 0:  # an empty shard (FSDP2's last ranks of a short dim 0)
        return out
    total, flat, written = math.prod(shape), out.view(-1), 0
    drawn_k, block = None, None
    for start, stop in runs(shape, region):
        for k in range(start // BLOCK_VALUES, (stop - 1) // BLOCK_VALUES + 1):
            lo, hi = k * BLOCK_VALUES, min((k + 1) * BLOCK_VALUES, total)
            if k != drawn_k:  # consecutive runs (an expert's rows, the next expert's) may share a block
                block = torch.empty(hi - lo)
                rule.fill(block, _generator(seed, name, k))
                drawn_k = k
            a, b = max(lo, start), min(hi, stop)
            flat[written : written + b - a] = block[a - lo : b - lo]
            written += b - a
    return out


class InitialWeights:
    """A model's initial weights as a fill source: `rules` drawn by counter from `seed` (module docstring)."""

    def __init__(self, rules: dict[str, Rule], seed: int) -> None:
        self.rules, self.seed = rules, int(seed)

    def __call__(self, name: str, shape: tuple[int, ...], region: Region) -> torch.Tensor:
        rule = self.rules.get(name)
        if rule is None:
            raise KeyError(f"no initialisation rule for {name!r}: the model's init_rules() must name every tensor")
        return draw(rule, self.seed, name, shape, region)


class WholeModel:
    """A model built whole (on the CPU, by its own __init__) as a fill source: what a model without init_rules()
    starts from, so that every rank still takes its part of the same weights."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.state = model, model.state_dict()

    def __call__(self, name: str, shape: tuple[int, ...], region: Region) -> torch.Tensor:
        return self.state[name][region]


def where_held(name: str, tensor: torch.Tensor, layouts: dict) -> tuple[tuple[int, ...], Region, torch.Tensor]:
    """(the whole tensor's shape, the region of it this rank holds, the local tensor holding it) for `tensor` named
    `name`: a DTensor's shard by its mesh and placements, then an expert-parallel slice (dim 0) by its layout."""
    local, offset = tensor, (0,) * tensor.dim()
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    shape = list(tensor.shape)
    split = layouts.get(name, WHOLE)
    if split.expert_parallel > 1:  # this rank's experts [r E/ep, (r+1) E/ep) of the whole [E, ...]
        offset = (offset[0] + dist.get_rank(split.expert_group) * shape[0], *offset[1:])
        shape[0] *= split.expert_parallel
    region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
    return tuple(shape), region, local


@torch.no_grad()
def fill(module: nn.Module, source: Source) -> None:
    """Every parameter and persistent buffer of `module` (only this rank's part of each) from `source`, cast to the
    tensor's dtype; then the buffers modules derive from their config (reset_buffers)."""
    layouts = parameter_layouts(module)
    non_persistent = {
        f"{prefix}.{name}" if prefix else name
        for prefix, m in module.named_modules()
        for name in m._non_persistent_buffers_set
    }
    tensors = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if n not in non_persistent)]
    for name, tensor in tensors:
        shape, region, local = where_held(name, tensor, layouts)
        local.copy_(source(name, shape, region))
    for m in module.modules():
        if hasattr(type(m), "reset_buffers"):
            m.reset_buffers()


def materialise(module: nn.Module, device: torch.device, source: Source) -> nn.Module:
    """`module`, built (and sharded) on the meta device, allocated on `device` (only what this rank holds) and
    filled from `source`. A parameter two modules share (tied embeddings) is shared again after: to_empty gives
    each module a new one."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, name))
    module.to_empty(device=device)
    for (first, first_name), *others in (h for h in holders.values() if len(h) > 1):
        for m, name in others:
            m._parameters[name] = first._parameters[first_name]
    fill(module, source)
    return module
