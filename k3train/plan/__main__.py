"""`python -m k3train.plan [overrides] --gpus N --gpu h200|h100|b200|cpu`: size a run before asking for hardware.

The overrides are `python -m k3train`'s: the config is composed by Hydra's compose API from the same conf/ and
schema (what `python -m k3train OVERRIDES --cfg job` shows), the model is built on the meta device (no weight is
allocated; model=k3 takes seconds). Prints memory per device, communication per step, step time and throughput for
a mesh, the one given (--mesh) or the one proposed for N devices (splitting each row over --cp ranks, or the
config's parallel.cp, when asked); exit 2 when nothing fits (or the given mesh does not), with what is too large.
--json prints the same as JSON.
"""

from k3train.runtime.bootstrap import bootstrap

bootstrap()  # before torch loads (runtime/bootstrap.py)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from hydra import compose, initialize_config_module  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from k3train.config import register_configs  # noqa: E402
from k3train.plan.activations import cp_kda_refusal  # noqa: E402
from k3train.plan.estimate import estimate, propose  # noqa: E402
from k3train.plan.hardware import CHOICES, lookup  # noqa: E402
from k3train.plan.mesh import Mesh  # noqa: E402
from k3train.plan.report import as_json, render  # noqa: E402
from k3train.plan.spec import build_spec, check_split  # noqa: E402


def compose_config(overrides: list[str]):
    """The config `python -m k3train OVERRIDES` runs with (Hydra's compose API on the same package)."""
    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m k3train.plan", description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m k3train (model=k3 ...)")
    ap.add_argument("--gpus", type=int, default=1, help="devices (processes) of the run")
    ap.add_argument("--gpu", choices=CHOICES, default="h200", help="the device (cpu: this machine, measured)")
    ap.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak FLOP/s the matmuls reach")
    ap.add_argument(
        "--mesh", help="dp_replicate x dp_shard x ep [x cp] (e.g. 1x1024x64, 1x1024x64x8) instead of the proposal"
    )
    ap.add_argument("--cp", type=int, help="split each row's sequence over this many ranks (default: parallel.cp)")
    ap.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free")
    ap.add_argument("--vocab-size", type=int, help="for a model whose vocab_size is null (the data's)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    if args.gpus < 1:
        ap.error("--gpus must be >= 1")
    if args.cp is not None and args.cp < 1:
        ap.error("--cp must be >= 1")
    if not 0 < args.mfu <= 1:
        ap.error("--mfu must be in (0, 1]")
    if not 0 <= args.headroom < 1:
        ap.error("--headroom must be in [0, 1)")
    return args


def vocab_for(cfg, given: int | None) -> int | None:
    """The model's vocabulary when its YAML leaves it null: --vocab-size, else the data's (as the runner does)."""
    if cfg.model.get("vocab_size") is not None or given is not None:
        return given
    return instantiate(cfg.data).vocab_size


def notes_for(mesh: Mesh, spec) -> list[str]:
    """What running `mesh` takes in k3train's config, and what k3train cannot run yet."""
    notes = []
    if mesh.world > 1:
        want = f"parallel={'ddp' if mesh.dp_shard == 1 else 'fsdp'}" + (
            f" parallel.ep={mesh.ep}" if mesh.ep > 1 else ""
        )
        want += f" parallel.cp={mesh.cp}" if mesh.cp > 1 else ""
        have = f"parallel={spec.strategy}" + (f" parallel.ep={spec.ep}" if spec.ep > 1 else "")
        have += f" parallel.cp={spec.cp}" if spec.cp > 1 else ""
        if want != have:
            notes.append(f"run it with {want} (the config says {have})")
    if mesh.strategy == "hsdp":
        notes.append("k3train runs DDP or FSDP, not both at once (HSDP), yet")
    return notes


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose_config(args.overrides)
        device_type = "cpu" if args.gpu == "cpu" else "cuda"
        spec = build_spec(cfg, device_type, vocab_for(cfg, args.vocab_size))
        hw = lookup(args.gpu)
        cp = spec.cp if args.cp is None else args.cp
        mesh = Mesh.parse(args.mesh, cp=cp) if args.mesh else None
        if mesh is not None and args.cp is not None and mesh.cp != args.cp:
            raise ValueError(f"--mesh {mesh} splits rows over cp={mesh.cp} ranks, --cp {args.cp}")
        cp = mesh.cp if mesh is not None else cp
        check_split(spec.seq_len, cp)
        if args.gpus % cp:
            raise ValueError(f"cp={cp} must divide the {args.gpus} devices: each row is split over cp ranks")
        if cp > 1 and "kda" in spec.model.layer_pattern and spec.model.kda_implementation != "chunk":
            raise ValueError(cp_kda_refusal(spec.model.kda_implementation))
    except Exception as exc:  # a bad override, model or mesh: say what, as a refusal
        print(f"k3train plan: error: {exc}", file=sys.stderr)
        return 2
    if mesh is not None and mesh.world != args.gpus:
        print(f"k3train plan: error: --mesh {mesh} has {mesh.world} ranks, --gpus {args.gpus}", file=sys.stderr)
        return 2
    if mesh is None:
        chosen, tried = propose(spec, args.gpus, hw, args.mfu, args.headroom, device_type, cp)
    else:
        tried = [estimate(spec, mesh, hw, args.mfu, args.headroom, device_type)]
        chosen = tried[0] if tried[0].fits else None
    shown = chosen or min(tried, key=lambda e: e.memory.peak)
    notes = notes_for(shown.mesh, spec)
    if args.json:
        print(json.dumps(as_json(spec, hw, chosen, tried, args.mfu), indent=2))
    else:
        print(render(spec, hw, args.gpus, args.overrides, chosen, tried, args.mfu, mesh is None, notes))
    if chosen is None:
        print(f"k3train plan: nothing fits on {args.gpus} x {hw.name} (exit 2)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
