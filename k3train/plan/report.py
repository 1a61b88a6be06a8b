"""The plan as text (the CLI's table) and as JSON (--json; what benchmarks and docs read)."""

from __future__ import annotations

import dataclasses
import shlex

from k3train.plan.checkpoint import checkpoint_lines, plan_checkpoint
from k3train.plan.command import launch, run_overrides, short_rows
from k3train.plan.estimate import Estimate, why
from k3train.plan.hardware import Hardware
from k3train.plan.mesh import Mesh
from k3train.plan.search import Search, overrides_for
from k3train.plan.spec import RunSpec

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:,.2f}"


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.2f}{unit}"
    return f"{x:,.0f}"


def header(spec: RunSpec, hw: Hardware, devices: int, overrides: list[str], cp: int = 1) -> list[str]:
    c = spec.model
    total = sum(p.numel for p in spec.params)
    routed = sum(p.numel for p in spec.params if p.routed)
    active = total - routed + routed * c.experts_per_token / c.n_routed_experts
    return [
        f"k3train plan: {' '.join(overrides) or '(defaults)'} on {devices} x {hw.name}",
        f"  device: {_si(hw.peak_flops(spec.precision))}FLOP/s dense {spec.precision}, {hw.memory_bytes / GB:,.0f} GB"
        + (f", link {hw.link_bytes_per_s / GB:,.0f} GB/s" if hw.link_bytes_per_s else "")
        + (f", network {hw.network_bits_per_s / 1e9:,.0f} Gb/s per device" if hw.network_bits_per_s else "")
        + (f", {hw.devices_per_node} per node" if hw.devices_per_node else ""),
        f"  model: {_si(total)} parameters ({_si(active)} active), {c.n_layers} layers, d {c.d_model}, "
        f"{c.n_routed_experts} experts top-{c.experts_per_token}; {spec.flops_per_token['training']:.3e} training "
        f"FLOPs per token at seq {spec.seq_len}",
        f"  recipe: batch {spec.batch_size} x seq {spec.seq_len} x accumulation {spec.accumulation} "
        + ("per device, " if cp == 1 else f"per cp group ({spec.seq_len // cp:,} positions a row per device), ")
        + f"{spec.precision}, checkpointing {spec.checkpointing}, {spec.optimizer}"
        + (f" (Newton-Schulz in {spec.ns_dtype})" if spec.ns_dtype else "")
        + f", configured parallel={spec.strategy}",
    ] + [f"  note: {line}" for line in [short_rows(spec)] if line]


def table(e: Estimate, spec: RunSpec, mfu: float, hw: Hardware) -> list[str]:
    m = e.memory
    lines = [f"mesh {e.mesh} = {e.mesh.describe()}, {e.mesh.world} device(s)"]
    if e.mesh.cp > 1:
        T = spec.seq_len
        lines.append(
            f"  context parallel: each row's {T:,} positions split over {e.mesh.cp} ranks, {T // e.mesh.cp:,} a rank "
            f"(the last rank's MLA keys: all {T:,}); {e.mesh.dp_size} ranks read different rows: a global batch of "
            f"{spec.batch_size * e.mesh.dp_size * spec.accumulation:,} rows"
        )
    lines += pipeline_lines(e, spec)
    lines += ["", "memory per device (GB)" + (" on the pp rank with the largest peak" if e.pipeline else "")]
    rows = [("parameters (fp32, as stored)", m.params), ("gradients (fp32)", m.grads)]
    rows += [(f"{name} (fp32)", value) for name, value in m.optimizer.items()]
    if m.ddp_buckets:
        rows.append(("DDP gradient buckets", m.ddp_buckets))
    if m.pipeline_buffers:
        rows.append(("pipeline receive buffers (a micro-batch each)", m.pipeline_buffers))
    if m.pipeline_gathered:
        rows.append(("FSDP2 weights gathered, backward to update's end", m.pipeline_gathered))
    rows += [
        ("activations (one micro-batch)", m.activations),
        ("weight copies held (autocast, fused)", m.weight_copies),
    ]
    if e.pipeline:
        rows.insert(-1, ("activations of the other micro-batches in flight", m.in_flight))
    lines += [f"  {name:<52} {_gb(value):>12}" for name, value in rows]
    lines.append("  transients (the largest of each kind):")
    lines += [f"    {name:<50} {_gb(value):>12}" for name, value in m.transients.items() if value]
    lines.append("  peak by phase:")
    lines += [f"    {name:<50} {_gb(value):>12}" for name, value in m.phases.items()]
    verdict = "fits" if e.fits else "DOES NOT FIT"
    lines.append(f"  peak {_gb(m.peak)} GB ({m.peak_phase}) of {_gb(e.budget)} GB usable: {verdict}")
    lines += ["", f"{'communication per step per device':<54}payload GB    wire GB    seconds  overlaps compute"]
    if e.pipeline:
        lines.append("  (of the pp rank that waits longest for its optimizer and communication)")
    for coll in e.comm:
        lines.append(
            f"  {coll.kind:<50} {_gb(coll.payload):>12} {_gb(coll.wire):>10} {e.comm_seconds[coll.kind]:>10.3f}  "
            f"{'yes' if coll.overlapped else 'no'}"
        )
    if not e.comm:
        lines.append("  none (one process)")
    peak = hw.peak_flops(spec.precision)
    lines += [
        "",
        f"step time (MFU {mfu:.2f} of {_si(peak)}FLOP/s)",
        f"  compute      {e.compute_s:10.3f} s  ({spec.flops_per_token['training']:.3e} FLOP/token"
        + (f" + {e.split_flops_per_token:.3e} for the cp split" if e.split_flops_per_token else "")
        + f" x {e.tokens_per_step // e.mesh.world:,} tokens)",
    ]
    if e.pipeline:
        lines[-1] = f"  compute      {e.compute_s:10.3f} s  (the slowest pp rank's stages, every micro-batch)"
    if e.recompute_s:
        lines.append(f"  recompute    {e.recompute_s:10.3f} s  (checkpointing {spec.checkpointing})")
    if e.newton_schulz_s:
        lines.append(f"  Newton-Schulz{e.newton_schulz_s:10.3f} s  (this rank's share)")
    if e.qk_clip_s:
        lines.append(f"  QK-Clip      {e.qk_clip_s:10.3f} s  (max logit: {e.qk_clip_flops:.3e} FLOPs in fp32)")
    if e.pipeline:
        p = e.pipeline
        lines.append(
            f"  bubble       {e.bubble_s:10.3f} s  ({p.bubble:.3f} of the pipelined work idle: {p.settings.schedule}, "
            f"pp {p.pp}, {p.microbatches} micro-batches)"
        )
    lines += [
        f"  exposed comm {e.exposed_s:10.3f} s",
        f"  step         {e.step_s:10.3f} s",
        f"throughput: {e.tokens_per_s:,.0f} tokens/s ({e.tokens_per_s / e.mesh.world:,.1f} per device), "
        f"{e.tokens_per_day:.3e} tokens/day ({e.days_per_trillion:,.1f} days per 1e12 tokens); model "
        f"{e.model_flops_per_s(spec) / 1e12:,.1f} TFLOP/s per device",
    ]
    return lines


def pipeline_lines(e: Estimate, spec: RunSpec) -> list[str]:
    """The stages, the micro-batches and the bubble, and each pp rank's plan (k3train/plan/pipeline.py)."""
    p = e.pipeline
    if p is None:
        return []
    s = p.settings
    cuts = ", ".join(f"{a}-{b - 1}" for a, b in p.bounds)
    lines = [
        f"  pipeline: {s.n_stages} stages of layers {cuts} (the embedding with the first, the head and loss with the "
        f"last), {s.schedule}" + (f", {s.virtual_stages} stages a rank" if s.virtual_stages > 1 else ""),
        f"  each update: {p.microbatches} micro-batches of {p.rows} row(s) a data-parallel rank; bubble "
        f"{p.bubble:.3f} (the schedule's idle share of an update)",
        f"  {'pp rank':<8} {'stages':<8} {'layers':<9} {'peak GB (phase)':<24} {'work s':>8} {'waits s':>8} "
        f"{'p2p sent GB':>12} {'in flight':>10}",
    ]
    for x in e.stage_ranks:
        layers = f"{x.layers[0]}-{x.layers[-1]}"
        stages = ",".join(map(str, x.stages))
        lines.append(
            f"  {x.rank:<8} {stages:<8} {layers:<9} {f'{_gb(x.peak)} ({x.peak_phase})':<24} {x.work_s:8.3f} "
            f"{x.waits_s:8.3f} {_gb(x.sent):>12} {x.in_flight:>10}"
        )
    return lines


def alternatives(tried: list[Estimate]) -> list[str]:
    if len(tried) < 2:
        return []
    lines = ["", "meshes tried           peak GB  phase            step s   tokens/day  days/1e12  fits"]
    for e in tried:
        lines.append(
            f"  {str(e.mesh):<18} {_gb(e.memory.peak):>10}  {e.memory.peak_phase:<15} {e.step_s:8.2f}  "
            f"{e.tokens_per_day:11.3e}  {e.days_per_trillion:9.1f}  {'yes' if e.fits else 'no'}"
        )
    return lines


def run_lines(title: str, spec: RunSpec, mesh: Mesh, devices: int, hw: Hardware, given: list[str]) -> list[str]:
    """`title:`, then the commands that train `spec` on `mesh` (k3train/plan/command.py)."""
    return [f"{title}:"] + [f"  {line}" for line in launch(devices, hw, run_overrides(spec, mesh, given))]


def run_json(spec: RunSpec, mesh: Mesh, devices: int, hw: Hardware, given: list[str]) -> dict:
    overrides = run_overrides(spec, mesh, given)
    return {"overrides": overrides, "launch": launch(devices, hw, overrides)}


def render(
    spec,
    hw,
    devices,
    overrides,
    chosen,
    tried,
    mfu,
    proposed: bool,
    notes: list[str],
    lead: list[str],
    prefer="step",
    storage: float | None = None,
) -> str:
    """The plan as text: the header, then `lead` (what to run), the mesh and why, the table, the meshes tried, and
    a checkpoint's size and time (`storage`: the write bandwidth a node, bytes/s, when stated)."""
    shown = chosen or min(tried, key=lambda e: e.memory.peak)
    lines = header(spec, hw, devices, overrides, shown.mesh.cp) + ["", *lead, ""]
    lines += [("proposed " if proposed else "") + "mesh, and why:"]
    lines += [f"  {line}" for line in why(chosen, tried, spec, prefer)]
    lines += [f"  note: {n}" for n in notes]
    lines += [""] + table(shown, spec, mfu, hw) + alternatives(tried)
    lines += [""] + checkpoint_lines(plan_checkpoint(spec, shown, hw, storage), storage)
    return "\n".join(lines)


def as_json(
    spec: RunSpec,
    hw: Hardware,
    chosen: Estimate | None,
    tried: list[Estimate],
    mfu: float,
    storage: float | None = None,
) -> dict:
    def one(e: Estimate) -> dict:
        m = e.memory
        return {
            "mesh": {name: getattr(e.mesh, name) for name in ("dp_replicate", "dp_shard", "ep", "cp", "pp")},
            "fits": e.fits,
            "usable_bytes": e.budget,
            "memory_bytes": {
                "pipeline_buffers": m.pipeline_buffers,
                "pipeline_gathered": m.pipeline_gathered,
                "in_flight": m.in_flight,
                "parameters": m.params,
                "gradients": m.grads,
                "optimizer": m.optimizer,
                "ddp_buckets": m.ddp_buckets,
                "activations": m.activations,
                "weight_copies": m.weight_copies,
                "transients": m.transients,
                "phases": m.phases,
                "peak": m.peak,
                "first_step_added": m.first_step_added,
            },
            "communication": [
                {
                    "kind": c.kind,
                    "payload_bytes": c.payload,
                    "wire_bytes": c.wire,
                    "ranks": c.ranks,
                    "calls": c.calls,
                    "overlapped": c.overlapped,
                    "seconds": e.comm_seconds[c.kind],
                }
                for c in e.comm
            ],  # fmt: skip
            "seconds": {
                "compute": e.compute_s,
                "recompute": e.recompute_s,
                "newton_schulz": e.newton_schulz_s,
                "qk_clip": e.qk_clip_s,
                "exposed_communication": e.exposed_s,
                "step": e.step_s,
            },  # fmt: skip
            "split_flops_per_token": e.split_flops_per_token,
            "pipeline": None
            if e.pipeline is None
            else {
                "schedule": e.pipeline.settings.schedule,
                "virtual_stages": e.pipeline.settings.virtual_stages,
                "microbatches": e.pipeline.microbatches,
                "microbatch_rows": e.pipeline.rows,
                "stage_layers": [list(b) for b in e.pipeline.bounds],
                "bubble": e.pipeline.bubble,
                "bubble_s": e.bubble_s,
                "ranks": [dataclasses.asdict(x) for x in e.stage_ranks],
            },
            "tokens_per_step": e.tokens_per_step,
            "tokens_per_s": e.tokens_per_s,
            "tokens_per_day": e.tokens_per_day,
            "days_per_1e12_tokens": e.days_per_trillion,
            "model_tflops_per_device": e.model_flops_per_s(spec) / 1e12,
        }

    return {
        "device": hw.name,
        "mfu": mfu,
        "flops_per_token": spec.flops_per_token,
        "notes": [line for line in [short_rows(spec)] if line],
        "chosen": one(chosen) if chosen else None,
        "tried": [one(e) for e in tried],
        "checkpoint": dataclasses.asdict(
            plan_checkpoint(spec, chosen or min(tried, key=lambda e: e.memory.peak), hw, storage)
        ),
    }


def search_lines(
    search: Search, configured: RunSpec, given: list[str], flags: list[str], hw: Hardware, shown: int = 5
) -> list[str]:
    """The recipes that fit, fastest first, each with the commands that train it (run:) and plan it (plan:), then
    what was held and what searched. flags: the planner's own (--gpu, --mfu, ...)."""
    n = search.devices
    lines = [
        "",
        f"recipes that fit on {n} device(s), fastest step first: each trains the same tokens a step, so the cheapest "
        "first",
    ]
    if not search.fits:
        lines.append("  none: no recipe searched fits")
    else:
        lines.append(
            f"  {'step s':>8}  {'peak GB (phase)':<26} {'mesh':<14} {'tokens/day':>10} {'days/1e12':>9}  recipe"
        )
    for fit in search.fits[:shown]:
        e = fit.estimate
        peak = f"{_gb(e.memory.peak)} ({e.memory.peak_phase})"
        lines.append(
            f"  {e.step_s:8.2f}  {peak:<26} {str(e.mesh):<14} {e.tokens_per_day:10.3e} {e.days_per_trillion:9.1f}  "
            f"{fit.recipe.describe()}"
        )
        lines += [f"      run:  {line}" for line in launch(n, hw, run_overrides(fit.spec, e.mesh, given))]
        command = ["python", "-m", "k3train.plan", *overrides_for(fit, configured, given), "--gpus", str(n)]
        words = [*command, *flags, "--mesh", str(e.mesh)]
        lines.append("      plan: " + " ".join(shlex.quote(word) for word in words))
    if len(search.fits) > shown:
        lines.append(f"  ... and {len(search.fits) - shown} more recipes that fit (--json lists every one)")
    rows = configured.batch_size * configured.accumulation
    split = f" / cp {search.asked_cp}" if search.asked_cp > 1 else ""
    lines.append(
        f"  held fixed: train.seq_len {search.seq_len:,}, the model, the optimizer, and the tokens a device trains on "
        f"per optimizer step (batch x accumulation x seq_len / cp), as configured: {rows} x {search.seq_len:,}{split} "
        f"= {search.tokens_per_device:,}, a global batch of {search.tokens_per_device * n:,} tokens"
    )
    batches = sorted({b for bs in search.micro_batches.values() for b in bs}, reverse=True)
    cps = ", ".join(str(c) for c in search.cps) or "none"
    lines.append(
        f"  searched in {search.seconds:.1f} s, {search.plans} plans: precision {', '.join(search.precisions)}; "
        f"checkpointing {', '.join(search.checkpointings)}; micro-batch (rows) {', '.join(map(str, batches))}, with "
        f"the accumulation that keeps the tokens; cp {cps} (a larger cp only while nothing fits"
        + (f"; {search.cp_refused}" if search.cp_refused else "")
        + f"); meshes {_meshes(search.meshes)}"
    )
    if search.skipped_meshes:
        skipped = list(dict.fromkeys(Mesh(m.dp_replicate, m.dp_shard, m.ep) for m in search.skipped_meshes))
        lines.append(
            f"  not planned, their parameters, gradients and optimizer state alone over the usable memory: "
            f"{_meshes(skipped)}"
        )
    if search.unaccumulated:
        lines.append(
            f"  gradient accumulation not planned on {_meshes(search.unaccumulated)}: its floor (FSDP2 keeps whole "
            "gradients between micro-batches) is over the usable memory alone"
        )
    return lines


def _meshes(meshes: list[Mesh]) -> str:
    """'1024x1xE and 1x1024xE, ep 1 to 128' where every family has the same eps (mesh.candidates' do), else each."""
    families: dict[str, list[int]] = {}
    for m in meshes:
        families.setdefault(f"{m.dp_replicate}x{m.dp_shard}xE" + (f"x{m.cp}" if m.cp > 1 else ""), []).append(m.ep)
    eps = list(families.values())
    if len(meshes) < 3 or any(e != eps[0] for e in eps):
        return ", ".join(str(m) for m in meshes)
    return f"{' and '.join(families)}, ep {eps[0][0]} to {eps[0][-1]}"


def search_json(search: Search, configured: RunSpec, given: list[str], hw: Hardware) -> dict:
    return {
        "devices": search.devices,
        "held": {"seq_len": search.seq_len, "tokens_per_device_per_step": search.tokens_per_device},
        "searched": {
            "precision": list(search.precisions),
            "activation_checkpointing": list(search.checkpointings),
            "micro_batches_by_cp": {str(c): bs for c, bs in search.micro_batches.items()},
            "meshes": [str(m) for m in search.meshes],
            "skipped_meshes": [str(m) for m in search.skipped_meshes],
            "unaccumulated_meshes": [str(m) for m in search.unaccumulated],
            "plans": search.plans,
            "seconds": search.seconds,
        },
        "fits": [
            {
                "overrides": overrides_for(fit, configured, given),
                "mesh": str(fit.estimate.mesh),
                "step_s": fit.estimate.step_s,
                "peak_bytes": fit.estimate.memory.peak,
                "peak_phase": fit.estimate.memory.peak_phase,
                "tokens_per_day": fit.estimate.tokens_per_day,
                "days_per_1e12_tokens": fit.estimate.days_per_trillion,
                "run": run_json(fit.spec, fit.estimate.mesh, search.devices, hw, given),
            }
            for fit in search.fits
        ],
    }
