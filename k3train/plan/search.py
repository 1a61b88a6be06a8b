"""When the configured recipe fits nowhere: the recipes that fit, fastest first, and the fewest devices that fit.

Every candidate is planned by estimate.py, on the configured RunSpec with the recipe's fields replaced (the model
is built on the meta device once; its parameters, their optimizer state and FLOPs per token do not change), so
what the search reports for a recipe is what `python -m k3train.plan` prints for its overrides.

Searched, per device count N:
  precision       the configured one, then bf16 and fp32 (fp16 only when configured: it plans as bf16 does)
  checkpointing   the configured one, then none, selective, block
  micro-batch     train.batch_size b for every divisor b of R, with train.gradient_accumulation_steps R / b
  cp              parallel.cp 1, 2, 4, ... (dividing N and train.seq_len), a larger one only while nothing fits
                  with the smaller, and then with micro-batches of one row only: b rows at cp 2c are the tokens of
                  b / 2 rows at cp c, with more kept (the last rank's keys span whole rows) and more exchanged, so
                  a larger cp only adds the micro-batch of one row split further; the asked cp alone under --cp or
                  --mesh
  mesh            mesh.candidates (DDP, then FSDP over all N, ep = 1, 2, 4, ...), or the --mesh given
Held fixed: train.seq_len (a row's length is a training decision, not a memory one), the optimizer, the model, and
the tokens a device trains on per optimizer step, R x seq_len / cp: R = batch x accumulation rows, scaled with cp
(the configured recipe's R at its cp). Every recipe's step then trains the same global batch of N x those tokens,
so the fastest step is the cheapest per token; recipes are ranked by step time, each at its fastest fitting mesh.

Kept fast (K3 on 1,024 GPUs: seconds): a mesh whose parameters, gradients and optimizer state alone are over
budget (memory.stored_floor, the same for every recipe) is skipped unplanned; so is gradient accumulation where
its floor (FSDP2 keeps the gradients whole between micro-batches) is over; micro-batches are tried largest first
and the first that fits ends a (precision, checkpointing, cp, mesh): a smaller one trains the same tokens with
more micro-batches, whose collectives repeat, so it is never faster. Muon's shares are kept per mesh (muon.py).

The fewest devices (no --gpus): N = 1, 2, 4, ... up to COUNT_BOUND (on a CPU: the processes one machine runs,
up to its cores), the first N at which some searched recipe fits; N / 2 had none.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from k3train.plan.estimate import Estimate, estimate, usable_bytes
from k3train.plan.hardware import Hardware
from k3train.plan.memory import stored_floor
from k3train.plan.mesh import Mesh, candidates
from k3train.plan.settings import DEFAULT_SETTINGS, PlanSettings
from k3train.plan.spec import RunSpec

COUNT_BOUND = 65536  # GPUs the count search stops at: 8,192 nodes of 8, past the largest training clusters
PRECISIONS = ("bf16", "fp32")
CHECKPOINTING = ("none", "selective", "block")


@dataclass(frozen=True)
class Recipe:
    precision: str
    checkpointing: str
    batch_size: int  # rows per micro-batch per device (per cp group)
    accumulation: int
    cp: int

    def describe(self) -> str:
        cp = f", cp {self.cp}" if self.cp > 1 else ""
        return (
            f"{self.precision}, checkpointing {self.checkpointing}, batch {self.batch_size} x accumulation "
            f"{self.accumulation}{cp}"
        )


@dataclass
class Fit:
    recipe: Recipe
    spec: RunSpec  # the configured spec with the recipe (and the mesh's parallel settings) applied
    estimate: Estimate  # at the recipe's fastest fitting mesh


@dataclass
class Search:
    devices: int
    seq_len: int
    tokens_per_device: int  # per optimizer step, held fixed
    asked_cp: int  # the split the configured batch is at
    fits: list[Fit]  # one per recipe that fits, fastest first
    precisions: tuple[str, ...]
    checkpointings: tuple[str, ...]
    micro_batches: dict[int, list[int]]  # cp -> the micro-batches tried, largest first
    meshes: list[Mesh]  # every mesh tried, under each cp
    skipped_meshes: list[Mesh] = field(default_factory=list)  # of those, the ones whose stored state alone is over
    unaccumulated: list[Mesh] = field(default_factory=list)  # planned without accumulation: its floor is over
    plans: int = 0  # estimates made
    seconds: float = 0.0
    cp_refused: str | None = None  # why no cp > 1 was tried, where that is the model's

    @property
    def cps(self) -> list[int]:
        return list(self.micro_batches)


def with_recipe(spec: RunSpec, recipe: Recipe, mesh: Mesh) -> RunSpec:
    """`spec` as the recipe's overrides (overrides_for) would compose it: the recipe's fields, and the parallel
    settings that run `mesh`."""
    strategy = spec.strategy if mesh.world == 1 else ("ddp" if mesh.dp_shard == 1 else "fsdp")
    return dataclasses.replace(
        spec,
        precision=recipe.precision,
        checkpointing=recipe.checkpointing,
        batch_size=recipe.batch_size,
        accumulation=recipe.accumulation,
        strategy=strategy,
        ep=mesh.ep if mesh.world > 1 else spec.ep,
        cp=mesh.cp,
    )


def search_recipes(
    spec: RunSpec,
    devices: int,
    hw: Hardware,
    settings: PlanSettings = DEFAULT_SETTINGS,
    mesh: Mesh | None = None,
) -> Search:
    """Every recipe that fits on `devices` (module docstring), each at its fastest fitting mesh, fastest first.
    settings.cp: the split the configured recipe's batch is at (its R rows are per cp group of that size);
    settings.cp_fixed: search that split only (--cp or --mesh asked for it); mesh: plan that mesh only (--mesh)."""
    asked_cp, cp_fixed = settings.cp, settings.cp_fixed
    t0 = time.perf_counter()
    rows_asked = spec.batch_size * spec.accumulation
    tokens = rows_asked * spec.seq_len // asked_cp
    precisions = _configured_first(spec.precision, PRECISIONS)
    checkpointings = _configured_first(spec.checkpointing, CHECKPOINTING)
    refused = None
    if mesh is not None or cp_fixed:
        cps = [mesh.cp if mesh is not None else asked_cp]
    else:
        cps = [c for c in _powers_of_two(min(devices, spec.seq_len)) if _splits(spec, devices, c, asked_cp)]
        if "kda" in spec.model.layer_pattern and spec.model.kda_implementation != "chunk":
            refused = f"cp > 1 plans KDA's chunk kernel only (model.kda_implementation={spec.model.kda_implementation})"
            cps = [c for c in cps if c == 1]
    out = Search(devices, spec.seq_len, tokens, asked_cp, [], precisions, checkpointings, {}, [], cp_refused=refused)
    floors: dict[tuple[int, int, int, bool], float] = {}  # the same dp shape under every cp: worked out once

    def floor(m: Mesh, accumulating: bool) -> float:
        key = (m.dp_replicate, m.dp_shard, m.ep, accumulating)
        if key not in floors:
            floors[key] = stored_floor(dataclasses.replace(spec, accumulation=2 if accumulating else 1), m)
        return floors[key]

    best: dict[Recipe, Fit] = {}
    for cp in cps:
        rows = rows_asked * cp // asked_cp  # per device per step: b x accumulation, so the tokens stay
        # past the first cp only a micro-batch of one row is new: b rows at cp 2c keep and exchange more than b / 2
        # at cp c, for the same tokens
        batches = [b for b in range(rows, 0, -1) if rows % b == 0] if cp == cps[0] else [1]
        out.micro_batches[cp] = batches
        if mesh is not None:
            meshes = [mesh]
        else:
            meshes = [Mesh(cp=cp)] if devices == 1 else candidates(devices, spec.model.n_routed_experts, cp)
        out.meshes += meshes
        planned_any = False
        for m in meshes:
            budget = usable_bytes(hw, m, settings.headroom)
            if floor(m, False) > budget:
                out.skipped_meshes.append(m)
                continue
            planned_any = True
            for precision in precisions:
                for checkpointing in checkpointings:
                    for b in batches:
                        if rows // b > 1 and floor(m, True) > budget:
                            if m not in out.unaccumulated:
                                out.unaccumulated.append(m)
                            break  # every smaller micro-batch accumulates too
                        recipe = Recipe(precision, checkpointing, b, rows // b, cp)
                        planned = with_recipe(spec, recipe, m)
                        e = estimate(planned, m, hw, settings)
                        out.plans += 1
                        if e.fits:
                            if recipe not in best or e.step_s < best[recipe].estimate.step_s:
                                best[recipe] = Fit(recipe, planned, e)
                            break  # a smaller micro-batch is never faster (module docstring)
        if best or not planned_any:
            break  # a larger cp only adds smaller micro-batches, at more exchanges; nor does it change the floor
    out.fits = sorted(best.values(), key=lambda f: (f.estimate.step_s, f.estimate.memory.peak))
    out.seconds = time.perf_counter() - t0
    return out


def count_bound(device_type: str) -> int:
    """The most devices the count search tries: COUNT_BOUND GPUs, or this machine's cores as processes."""
    return COUNT_BOUND if device_type != "cpu" else max(1, os.cpu_count() or 1)


def smallest_count(
    spec: RunSpec,
    hw: Hardware,
    settings: PlanSettings = DEFAULT_SETTINGS,
) -> tuple[Search | None, list[Search]]:
    """(the search at the fewest devices where a recipe fits, or None up to count_bound; every search made): N = 1,
    2, 4, ..., those that cp divides."""
    searches = []
    for devices in _powers_of_two(count_bound(settings.device_type)):
        if devices % settings.cp:
            continue
        searches.append(search_recipes(spec, devices, hw, settings))
        if searches[-1].fits:
            return searches[-1], searches
    return None, searches


def overrides_for(fit: Fit, configured: RunSpec, given: list[str]) -> list[str]:
    """The overrides that run `fit`: the given ones, less those of a key this sets, then this recipe's values that
    differ from the configured ones. A change of parallel strategy drops every given parallel.* override (DDP's
    keys are not FSDP's); ep and cp are then set whenever they are not the new group's 1."""
    r, m = fit.recipe, fit.estimate.mesh
    wanted: dict[str, str] = {}
    if r.precision != configured.precision:
        wanted["precision"] = r.precision
    if r.checkpointing != configured.checkpointing:
        wanted["train.activation_checkpointing"] = r.checkpointing
    if r.batch_size != configured.batch_size:
        wanted["train.batch_size"] = str(r.batch_size)
    if r.accumulation != configured.accumulation:
        wanted["train.gradient_accumulation_steps"] = str(r.accumulation)
    switched = fit.spec.strategy != configured.strategy
    if switched:
        wanted["parallel"] = fit.spec.strategy
    if fit.spec.ep != (1 if switched else configured.ep):
        wanted["parallel.ep"] = str(fit.spec.ep)
    if fit.spec.cp != (1 if switched else configured.cp):
        wanted["parallel.cp"] = str(m.cp)

    def kept(override: str) -> bool:
        key = override.split("=", 1)[0].lstrip("+~")
        return key not in wanted and not (switched and key.startswith("parallel."))

    return [o for o in given if kept(o)] + [f"{k}={v}" for k, v in wanted.items()]


def _configured_first(configured: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    return (configured, *(c for c in choices if c != configured))


def _splits(spec: RunSpec, devices: int, cp: int, asked_cp: int) -> bool:
    """Whether rows split over cp ranks: cp divides the devices and the row, and the held tokens are whole rows."""
    return devices % cp == 0 and spec.seq_len % cp == 0 and (spec.batch_size * spec.accumulation * cp) % asked_cp == 0


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out
