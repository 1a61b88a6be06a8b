"""A dry run: rank R of an N-rank run, built and stepped in one process on torch's fake process group, to check a
cluster config before asking for GPUs (`python -m k3train dry_run.world_size=N dry_run.rank=R [overrides]`).

The build is a real run's (k3train/run/build.py: the model on the meta device, cut into stages, made context- and
expert-parallel, sharded, then only this rank's part allocated), then train.max_steps updates on that rank's rows of
the data. The fake group's collectives do not communicate (an all-gather repeats this rank's shard, an all-to-all
returns what it was given), so values mean nothing and only shapes and bytes count: every MoE routes its tokens
evenly (Router.route_evenly: the sizes a balanced run's all-to-all moves, as Automodel's fake balanced gate does),
an update steps whatever its loss (the non-finite guard is off), and nothing is evaluated or checkpointed.
torchtitan checks its configs the same way (its --comm.mode fake_backend).

It prints and writes `dry_run.json` in the run dir: this rank's measured bytes of parameters, gradients and
optimizer state, its peak resident memory (and on a GPU the allocator's peak) beside the process's baseline before
the build, the build's seconds, and the planner's figures for the same config and mesh (k3train/plan: parameters,
gradients and optimizer state are what it sizes exactly; its peak is a device's, activations included).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from k3train.config import DryRunConfig, TrainConfig, check_known_keys
from k3train.config_targets import check_target_settings
from k3train.files import write_atomic
from k3train.plan.memory import plan_memory
from k3train.plan.mesh import Mesh
from k3train.plan.pipeline import plan_pipeline, stage_spec
from k3train.plan.spec import build_spec
from k3train.run.build import build_parts, set_up_process
from k3train.runtime.distributed import World, world_from_env

GIB = 2**30


def start_fake_group(settings: DryRunConfig) -> World:
    """torch's fake process group as rank `settings.rank` of `settings.world_size`; refused where a real one is set
    up (a launcher's environment), since a dry run is one process standing for one rank."""
    if dist.is_initialized() or world_from_env().distributed:
        raise ValueError(
            "dry_run.world_size with a real process group set up (torchrun, srun or WORLD_SIZE in the environment): "
            "a dry run is one process standing for one rank; run it as plain `python -m k3train dry_run...`"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=settings.rank, world_size=settings.world_size)
    return World(rank=settings.rank, size=settings.world_size)


def run(cfg: DictConfig, run_dir: Path) -> str:
    """The dry run the config's dry_run node asks for; returns "dry_run". Refusals (ValueError and the like) are
    raised before anything is written."""
    settings: DryRunConfig = OmegaConf.to_object(cfg.dry_run)
    check_known_keys(cfg)
    check_target_settings(cfg)
    train_cfg: TrainConfig = OmegaConf.to_object(cfg.train)
    world = start_fake_group(settings)
    try:
        return _dry_run(cfg, run_dir, train_cfg, world)
    finally:
        dist.destroy_process_group()


def _dry_run(cfg: DictConfig, run_dir: Path, train_cfg: TrainConfig, world: World) -> str:
    baseline = _resident_bytes()
    device, threads = set_up_process(train_cfg, world, measuring_memory=True)
    start = time.perf_counter()
    parts = build_parts(cfg, run_dir, device, world, threads, resuming=False)
    built_s = time.perf_counter() - start
    built_peak = _peak_resident_bytes()
    trainer = parts["trainer"]
    trainer.skip_non_finite = False
    for module in trainer.model.modules():
        if hasattr(type(module), "route_evenly"):
            module.route_evenly()
    grads: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: grads.append(_bytes(p.grad for p in trainer.step.params)))
    steps = train_cfg.max_steps or 1
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    measured = {
        "params": _bytes(trainer.step.params),
        "grads": max(grads, default=0.0),
        "optimizer": _bytes(t for state in trainer.optimizer.state.values() for t in state.values()),
        "peak_resident": _peak_resident_bytes(),
        "baseline_resident": baseline,
        "built_peak_resident": built_peak,
        "build_s": built_s,
        "step_s": (time.perf_counter() - start) / steps,
    }
    if device.type == "cuda":
        measured["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    dims = trainer.dims
    planned = _planned(cfg, dims, parts["data"].vocab_size, device.type)
    report = {
        "world_size": world.size,
        "rank": world.rank,
        "mesh": dataclasses.asdict(dims.layout),
        "coordinates": {"pp": dims.pp_rank, "dp": dims.dp_rank, "cp": dims.cp_rank},
        "steps": steps,
        "device": str(device),
        "measured": measured,
        "planned": planned,
        "ratio": {k: measured[k] / planned[k] if planned[k] else None for k in ("params", "grads", "optimizer")},
        "note": "a fake process group: values are meaningless, shapes and bytes count; MoE tokens routed evenly",
    }
    text = (json.dumps(report, indent=2) + "\n").encode()
    write_atomic(run_dir / "dry_run.json", lambda f: f.write(text))
    _print(report, run_dir)
    return "dry_run"


def _planned(cfg: DictConfig, dims, vocab_size: int, device_type: str) -> dict:
    """The planner's bytes for this rank of the same config and mesh (a pipeline rank: its own stages')."""
    spec = build_spec(cfg, device_type, vocab_size)
    mesh = Mesh(**dataclasses.asdict(dims.layout))
    if mesh.pp > 1:
        plan = plan_pipeline(dataclasses.replace(spec, pp=mesh.pp))
        memory = plan_memory(stage_spec(spec, plan, dims.pp_rank), mesh.stage, device_type)
    else:
        memory = plan_memory(spec, mesh, device_type)
    return {
        "params": memory.params,
        "grads": memory.grads,
        "optimizer": sum(memory.optimizer.values()),
        "peak": memory.peak,
        "peak_phase": memory.peak_phase,
    }


def _bytes(tensors) -> float:
    """Bytes of memory this rank holds for `tensors`: each one's storage once (FSDP2 keeps a parameter's shard in
    a buffer padded to the largest rank's rows, the planner's count; a DTensor's local shard; None skipped)."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return float(sum(storages.values()))


def _resident_bytes(field: str = "VmRSS:") -> float:
    with open("/proc/self/status") as status:
        kb = next(line.split()[1] for line in status if line.startswith(field))
    return float(kb) * 1024


def _peak_resident_bytes() -> float:
    """This process's resident peak since it started this program: VmHWM, not getrusage's ru_maxrss, which keeps
    the high-water mark of the image before exec (a forked parent's: a test runner's gigabytes)."""
    return _resident_bytes("VmHWM:")


def _print(report: dict, run_dir: Path) -> None:
    m, p = report["measured"], report["planned"]
    mesh = " x ".join(f"{k} {v}" for k, v in report["mesh"].items())
    steps = f"{report['steps']} update(s) on a fake process group"
    print(f"dry run: rank {report['rank']} of {report['world_size']} ({mesh}), {steps}")
    for key in ("params", "grads", "optimizer"):
        ratio = report["ratio"][key]
        print(
            f"  {key:<10} measured {m[key] / GIB:10.3f} GiB   planned {p[key] / GIB:10.3f} GiB"
            + (f"   ({ratio:.4f}x)" if ratio is not None else "")
        )
    print(
        f"  peak resident {m['peak_resident'] / GIB:.2f} GiB (baseline {m['baseline_resident'] / GIB:.2f} GiB; after "
        f"the build {m['built_peak_resident'] / GIB:.2f} GiB; the planner's device peak {p['peak'] / GIB:.2f} GiB, "
        f"{p['peak_phase']}); built in {m['build_s']:.1f} s, {m['step_s']:.1f} s an update"
    )
    print(f"  written to {run_dir / 'dry_run.json'}", flush=True)
